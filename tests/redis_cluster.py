"""Redis Clusters for tests, started by the same script as CI (`deploy/redis_cluster.sh`).

- `RedisCluster(ports, directory)`: `start()` (idempotent: a running cluster is reused, new nodes are joined into
  one with `redis-cli --cluster create`, a restarted node rejoins), `kill_node(port)`, `stop()` (and forget it),
  `url` (`redis+cluster://...`), `node(port)` (a plain client of one master), `names(pattern)` (port, key) over
  every master, `flush()`.
- `shared_cluster()`: the CI cluster on `KDAMESH_TEST_REDIS_CLUSTER_PORTS` (default 7000,7001,7002), started when it
  is not running and left running for the next test, like the shared single Redis; `stop_shared_if_started()` (at
  the session's end, tests/conftest.py) stops it when this process started it.
The script runs `redis-server` / `redis-cli` from PATH (checked first: tests/redis_server.py).
- `private_ports(n)`: n free ports whose cluster bus ports (+10000) are free too.
Nothing is skipped: a missing redis-server, or a cluster that does not come up in time, fails the test and says
why.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from tests.redis_server import answers, redis_binary

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "redis_cluster.sh"
SHARED_PORTS = tuple(int(p) for p in os.environ.get("KDAMESH_TEST_REDIS_CLUSTER_PORTS", "7000,7001,7002").split(","))
SCRIPT_TIMEOUT_S = 60


class RedisCluster:
    def __init__(self, ports: tuple[int, ...], directory: str | None = None):
        self.ports = ports
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        self._directory = directory

    def _script(self, *args: str) -> None:
        redis_binary("redis-server"), redis_binary("redis-cli")  # missing or too old: a failed test that says so
        env = {**os.environ, **({"KDAMESH_REDIS_CLUSTER_DIR": self._directory} if self._directory else {})}
        try:
            done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env,
                                  timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{SCRIPT.name} {' '.join(args)} did not finish within {SCRIPT_TIMEOUT_S} s", pytrace=False)
        if done.returncode:
            pytest.fail(f"{SCRIPT.name} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}",
                        pytrace=False)

    def start(self) -> None:
        self._script("start", *map(str, self.ports))

    def kill_node(self, port: int) -> None:
        self._script("kill-node", str(port))

    def stop(self) -> None:
        self._script("stop", *map(str, self.ports))

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=5)

    def names(self, pattern: bytes) -> list[tuple[int, bytes]]:
        return sorted((port, name) for port in self.ports for name in self.node(port).scan_iter(match=pattern))

    def flush(self) -> None:
        for port in self.ports:
            self.node(port).flushall()


_started_shared: list[RedisCluster] = []  # the shared cluster, when this process started it


def shared_cluster() -> RedisCluster:
    cluster = RedisCluster(SHARED_PORTS)
    fresh = not _started_shared and not all(answers("127.0.0.1", port) for port in SHARED_PORTS)
    cluster.start()
    if fresh:
        _started_shared.append(cluster)
    return cluster


def stop_shared_if_started() -> None:
    while _started_shared:
        _started_shared.pop().stop()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def private_ports(n: int) -> tuple[int, ...]:
    rng = random.Random()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(20000, 30000)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
            if len(ports) == n:
                return tuple(ports)
    pytest.fail(f"no {n} free ports (with free cluster bus ports) in 20000-30000", pytrace=False)
