"""Redis Cluster for the Redis store (`redis+cluster://host:port,host:port`): per-node pipelines through the gate.

Contract:
- `parse_cluster_url(url)` -> ((host, port), ...): the seed nodes of `redis+cluster://h1:p1,h2:p2[/0]` (port 6379
  when omitted). ValueError for no node, a bad port, or a database other than 0 (a cluster has only database 0).
- `ClusterClient(url, gate, ...)` offers the store the part of `redis.Redis` it uses: `pipeline(transaction=False)`,
  `smembers`, `hgetall`, `scan_iter(match, count)` (over every master), `info(section)` (integer fields summed over
  the masters) and `close()`. Each master is reached with the single store's client (`gated_redis`: one retry on a
  connection error, none on a timeout, every round trip through the store's `RedisGate`, so its operation deadline
  and breaker hold per node). The slot map is read lazily, through the gate, by the first round trip (a cluster
  that is down when the store is made costs errors per key, not a failed start), and again after it went stale.
- `ClusterPipeline.execute(raise_on_error)` sends the queued commands grouped by the master that owns their first
  key's slot: one pipeline, one round trip per node, replies in queue order. A command's keys must share a slot
  (the layout's hash tags, `redis_layout.RedisKeys(tagged=True)`); Redis refuses CROSSSLOT otherwise.
- Per-node failures: a node that cannot be reached turns its own commands' replies into that error
  (`raise_on_error=False`: the store answers ERROR for those keys, the other nodes' keys succeed), or the first error
  is raised. When no node could be reached for any command, `execute` raises even with `raise_on_error=False`, as a
  single Redis client does for a connection error (the store's "Redis unavailable" path). A redirection (MOVED / ASK: slots migrated or failed over), CLUSTERDOWN, TRYAGAIN, an uncovered slot or
  an unreachable node marks the slot map stale; the next operation re-reads it first. Redirections are not followed
  within an operation: the command fails closed (ERROR), never retried on a guessed node.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import redis
import redis.client
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError

from cache_service.redis_deadlines import RedisGate, gated_redis

SCHEME = "redis+cluster"
DEFAULT_PORT = 6379
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
_TOPOLOGY_ERRORS = (AskError, ClusterDownError, TryAgainError, redis.ConnectionError, redis.TimeoutError, OSError)


def is_cluster_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def parse_cluster_url(url: str) -> tuple[tuple[str, int], ...]:
    """The seed nodes of a `redis+cluster://h1:p1,h2:p2` URL (see the module docstring)."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"a Redis Cluster URL starts with {SCHEME}://, got {url!r}")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got {parts.path!r} in {url!r}")
    seeds = []
    for item in filter(None, (s.strip() for s in parts.netloc.rpartition("@")[2].split(","))):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad Redis Cluster node {item!r} in {url!r} (host:port)")
        seeds.append((host.strip("[]"), int(port)))
    if not seeds:
        raise ValueError(f"a Redis Cluster URL names at least one node, got {url!r}")
    return tuple(seeds)


class ClusterClient:
    """The store's client of one Redis Cluster (see the module docstring)."""

    def __init__(self, url: str, gate: RedisGate, *, socket_timeout_s: float, connect_timeout_s: float,
                 max_connections: int, socket_read_bytes: int):
        self.url = url
        self.seeds = parse_cluster_url(url)
        self.gate = gate
        self._timeouts = (socket_timeout_s, connect_timeout_s)
        self._pool = (max_connections, socket_read_bytes)
        self._cluster: RedisCluster | None = None
        self._stale = False
        self._nodes: dict[str, redis.Redis] = {}  # node name -> its gated client
        self._lock = threading.Lock()

    # -- topology ------------------------------------------------------------------------------------------------

    def mark_stale(self) -> None:
        self._stale = True

    def _slot_map(self) -> RedisCluster:
        """The cluster's slot map, read (or re-read when stale) through the gate."""
        with self._lock:
            try:
                if self._cluster is None:
                    self._cluster = self.gate.call(self._connect)
                elif self._stale:
                    self.gate.call(self._cluster.nodes_manager.initialize)
            except RedisClusterException as exc:  # not a RedisError: the store counts RedisErrors as ERROR per key
                raise redis.ConnectionError(f"redis cluster {self.url}: {exc}") from exc
            self._stale = False
            return self._cluster

    def _connect(self) -> RedisCluster:
        socket_timeout_s, connect_timeout_s = self._timeouts
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.seeds], socket_timeout=socket_timeout_s,
                            socket_connect_timeout=connect_timeout_s, require_full_coverage=False)

    def node_client(self, host: str, port: int) -> redis.Redis:
        name = f"{host}:{port}"
        with self._lock:
            client = self._nodes.get(name)
            if client is None:
                socket_timeout_s, connect_timeout_s = self._timeouts
                max_connections, socket_read_bytes = self._pool
                client = self._nodes[name] = gated_redis(
                    f"redis://{name}/0", self.gate, socket_timeout_s=socket_timeout_s,
                    connect_timeout_s=connect_timeout_s, max_connections=max_connections,
                    socket_read_bytes=socket_read_bytes)
            return client

    def clients_of_slots(self, slots: list[int]) -> list[redis.Redis | Exception]:
        """Per slot: the gated client of its master, or why there is none (an uncovered slot)."""
        nodes = self._slot_map().nodes_manager
        out: list[redis.Redis | Exception] = []
        for slot in slots:
            try:
                node = nodes.get_node_from_slot(slot)
            except RedisClusterException as exc:  # the slot is not covered (its master failed)
                self.mark_stale()
                out.append(redis.ConnectionError(f"redis cluster {self.url}: {exc}"))
                continue
            out.append(self.node_client(node.host, node.port))
        return out

    def masters(self) -> list[redis.Redis]:
        return [self.node_client(n.host, n.port) for n in self._slot_map().get_primaries()]

    # -- the commands the store uses -----------------------------------------------------------------------------

    def pipeline(self, transaction: bool = False) -> "ClusterPipeline":
        if transaction:
            raise ValueError("a Redis Cluster pipeline here is never a transaction")
        return ClusterPipeline(self)

    def smembers(self, name: bytes) -> set:
        return self._one("smembers", name)

    def hgetall(self, name: bytes) -> dict:
        return self._one("hgetall", name)

    def _one(self, command: str, name: bytes):
        pipe = self.pipeline()
        getattr(pipe, command)(name)
        return pipe.execute()[0]

    def scan_iter(self, match: bytes, count: int = 1000) -> Iterator[bytes]:
        for client in self.masters():
            cursor = None
            while cursor != 0:
                cursor, names = client.scan(cursor or 0, match=match, count=count)  # gated: one round trip
                yield from names

    def info(self, section: str) -> dict[str, int]:
        totals: dict[str, int] = {}
        for client in self.masters():
            for field, value in client.info(section).items():
                if isinstance(value, int) and not isinstance(value, bool):
                    totals[field] = totals.get(field, 0) + value
        return totals

    def close(self) -> None:
        with self._lock:
            clients, self._nodes = list(self._nodes.values()), {}
            cluster, self._cluster = self._cluster, None
        for client in clients:
            client.close()
        if cluster is not None:
            cluster.close()


class ClusterPipeline(redis.client.Pipeline):
    """Queues commands like a redis-py pipeline; `execute` sends them per node (see the module docstring)."""

    def __init__(self, client: ClusterClient):
        super().__init__(connection_pool=None, response_callbacks={}, transaction=False, shard_hint=None)
        self._client = client

    def execute(self, raise_on_error: bool = True) -> list:
        stack, self.command_stack = self.command_stack, []
        replies: list = [None] * len(stack)
        try:
            targets = self._client.clients_of_slots([key_slot(args[1]) for args, _ in stack])
        except (redis.RedisError, OSError) as exc:  # no slot map: the cluster cannot be reached
            targets = [exc] * len(stack)
        groups: dict[int, tuple[redis.Redis, list[int]]] = {}
        for i, target in enumerate(targets):
            if isinstance(target, Exception):
                replies[i] = target
            else:
                groups.setdefault(id(target), (target, []))[1].append(i)
        for node, positions in groups.values():
            pipe = node.pipeline(transaction=False)
            pipe.command_stack = [stack[i] for i in positions]
            try:
                results = pipe.execute(raise_on_error=False)  # gated: one round trip
            except (redis.RedisError, OSError) as exc:
                results = [exc] * len(positions)
            for i, result in zip(positions, results):
                replies[i] = result
        errors = [r for r in replies if isinstance(r, Exception)]
        if any(isinstance(e, _TOPOLOGY_ERRORS) for e in errors):
            self._client.mark_stale()
        unreachable = [e for e in errors if isinstance(e, _UNREACHABLE)]
        if errors and (raise_on_error or len(unreachable) == len(replies)):
            raise (unreachable or errors)[0]  # no node answered: like a single Redis that cannot be reached
        return replies
