"""Worker choice for one pool (prefill or decode): prefix-aware, load-aware, health-aware; and the P/D decision.

Contract:
- `Router(addresses, config)` serves one pool (`--prefill-workers` or `--decode-workers`, parsed by
  `parse_worker_list`). `pick(block_hashes)` returns the healthy worker of least
  `cost = uncached_blocks + load_weight * active`, where `uncached_blocks` counts the prompt's full blocks after the
  longest prefix the worker has likely cached, and `active` is the number of requests this gateway has in flight on it.
  Ties go to the worker listed first. No healthy worker: `NoHealthyWorker`.
- `block_hashes` is the prompt's chain of full-block hashes (`prompt_block_hashes`: the engine's chained hashing with
  the tenant's cache salt, so affinity never crosses tenants); a hash names its whole prefix.
- What a worker has cached is inferred, not asked: `start(address, block_hashes)` records the chain (the worker will
  hold those blocks) in a per-worker LRU of at most `config.prefix_capacity` hashes, and counts the request in flight;
  `finish(address)` uncounts it. `route(block_hashes)` is `pick` + `start` under one lock.
- Health: workers start healthy; `mark_unhealthy` / `mark_healthy` are called by the app's health-check loop.
  Marking a worker unhealthy forgets its remembered prefixes (it may come back with an empty cache); its in-flight
  count stays until those requests `finish`.
- Pool membership: `set_addresses(addresses)` replaces the worker set (service discovery calls it through
  `MeshClient.set_worker_addresses`); new workers start empty and healthy, removed ones get no new requests.
- Thread-safe; nothing blocks. Unknown addresses raise `KeyError`, except `finish` (a no-op for a removed worker).
- The P/D decision (`PDDecider`, used by `gateway.mesh_client.MeshClient` for every request): prefill on the decode
  worker ("local") when there is no healthy prefill worker, the request has `n > 1`, or prefill is saturated
  (`max_prefill_inflight` prefills in flight from this gateway; 0: no limit); else remote prefill exactly when at
  least `min_uncached_tokens` prompt tokens are not in the chosen decode worker's prefix cache
  (`should_prefill_remotely`). The decode worker is asked what it holds (`Probe`) only when the answer can change
  the decision (`needs_probe`: the prompt reaches the threshold).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.memory.hashing import BlockHasher, root_hash


class NoHealthyWorker(Exception):
    """Every worker of the pool is unhealthy (the REST layer answers 503)."""


@dataclass(frozen=True)
class RouterConfig:
    # One request in flight costs as much as this many uncached blocks to prefill (8 blocks = 128 tokens at 16).
    load_weight: float = 8.0
    # Block hashes remembered per worker (LRU); 65536 hashes ≈ 1M tokens of prefixes at block size 16, ≈ 6 MB.
    prefix_capacity: int = 65536

    def __post_init__(self):
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.prefix_capacity < 0:
            raise ValueError(f"prefix_capacity must be >= 0, got {self.prefix_capacity}")


@dataclass(frozen=True)
class Pick:
    address: str
    cached_blocks: int
    uncached_blocks: int
    active: int
    cost: float


def parse_worker_list(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`"host1:50051,host2:50051"` (or a list of such strings) → addresses; empty → (); duplicates are an error."""
    items = [text] if isinstance(text, str) else list(text or ())
    addresses = [a.strip() for item in items for a in item.split(",") if a.strip()]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ValueError(f"worker addresses listed twice: {', '.join(duplicates)}")
    return tuple(addresses)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                        namespace: bytes = b"") -> list[bytes]:
    """The chained hashes of the prompt's full blocks, salted per tenant; `namespace` (e.g. the model name)
    separates models served by the same pool."""
    hashes: list[bytes] = []
    BlockHasher(block_size, root_hash(namespace, cache_salt)).extend(hashes, token_ids)
    return hashes


class _WorkerState:
    def __init__(self, address: str):
        self.address = address
        self.healthy = True
        self.active = 0
        self.prefixes: OrderedDict[bytes, None] = OrderedDict()

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Length of the longest prefix of `block_hashes` whose every block is remembered."""
        n = 0
        for h in block_hashes:
            if h not in self.prefixes:
                break
            n += 1
        return n

    def remember(self, block_hashes: Sequence[bytes], capacity: int) -> None:
        """Refreshes the chain deepest block first, so its root is the most recent entry and eviction takes the
        deepest blocks of the oldest chains first (what remains is still a prefix)."""
        for h in reversed(block_hashes):
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > capacity:
            self.prefixes.popitem(last=False)


class Router:
    def __init__(self, addresses: Sequence[str], config: RouterConfig = RouterConfig()):
        if not addresses:
            raise ValueError("a router needs at least one worker address")
        addresses = parse_worker_list(list(addresses))
        self.config = config
        self._workers = {a: _WorkerState(a) for a in addresses}
        self._lock = threading.Lock()

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def set_addresses(self, addresses: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Replaces the pool's worker set (what service discovery resolved: every pod of a headless Service).

        - A new address joins with an empty prefix index, healthy until a health check or its event stream says
          otherwise, and no requests in flight.
        - An address no longer listed is dropped at once: it gets no new requests; its requests in flight finish
          normally (their later `finish(address)` is a no-op).
        - An address listed before and now keeps its state (index, health, in-flight count).
        - The list order becomes the tie-break order. Duplicates raise `ValueError`; an empty list is allowed
          (the pool is empty until the next resolution: `pick` raises `NoHealthyWorker`).
        Returns `(added, removed)` addresses, in order (the caller opens / closes their channels and streams)."""
        wanted = parse_worker_list(list(addresses))
        with self._lock:
            old = self._workers
            added = tuple(a for a in wanted if a not in old)
            removed = tuple(a for a in old if a not in wanted)
            self._workers = {a: old.get(a) or _WorkerState(a) for a in wanted}
            return added, removed

    def pick(self, block_hashes: Sequence[bytes] = ()) -> Pick:
        """The cheapest healthy worker for a prompt with these full-block hashes; changes nothing."""
        with self._lock:
            return self._pick(block_hashes)

    def costs(self, block_hashes: Sequence[bytes] = ()) -> list[Pick]:
        """Every healthy worker's cost for this prompt, in list order (for metrics and debugging)."""
        with self._lock:
            return self._costs(block_hashes)

    def route(self, block_hashes: Sequence[bytes] = ()) -> Pick:
        """`pick` then `start` on the chosen worker, atomically; call `finish(pick.address)` when the request ends."""
        with self._lock:
            choice = self._pick(block_hashes)
            self._start(self._workers[choice.address], block_hashes)
            return choice

    def start(self, address: str, block_hashes: Sequence[bytes] = ()) -> None:
        """A request with these block hashes starts on `address`."""
        with self._lock:
            self._start(self._workers[address], block_hashes)

    def finish(self, address: str) -> None:
        """A request on `address` ended (finished, failed or cancelled)."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is not None:  # None: dropped by `set_addresses` while the request ran
                worker.active = max(0, worker.active - 1)

    def mark_healthy(self, address: str) -> None:
        with self._lock:
            self._workers[address].healthy = True

    def mark_unhealthy(self, address: str) -> None:
        with self._lock:
            worker = self._workers[address]
            worker.healthy = False
            worker.prefixes.clear()

    def is_healthy(self, address: str) -> bool:
        with self._lock:
            return self._workers[address].healthy

    def active(self, address: str) -> int:
        with self._lock:
            return self._workers[address].active

    def _cost(self, worker: _WorkerState, block_hashes: Sequence[bytes]) -> Pick:
        cached = worker.cached_blocks(block_hashes)
        uncached = len(block_hashes) - cached
        return Pick(worker.address, cached, uncached, worker.active,
                    uncached + self.config.load_weight * worker.active)

    def _costs(self, block_hashes: Sequence[bytes]) -> list[Pick]:
        return [self._cost(w, block_hashes) for w in self._workers.values() if w.healthy]

    def _pick(self, block_hashes: Sequence[bytes]) -> Pick:
        picks = self._costs(block_hashes)
        if not picks:
            raise NoHealthyWorker(f"no healthy worker among {', '.join(self._workers)}")
        return min(picks, key=lambda p: p.cost)  # min keeps the first of equal costs: list order breaks ties

    def _start(self, worker: _WorkerState, block_hashes: Sequence[bytes]) -> None:
        worker.active += 1
        worker.remember(block_hashes, self.config.prefix_capacity)


def should_prefill_remotely(uncached_tokens: int, min_uncached_tokens: int, prefill_saturated: bool) -> bool:
    """Remote (disaggregated) prefill pays a KV transfer, so it is worth it only for enough uncached prompt tokens,
    and only when the prefill pool has room; otherwise the decode worker prefills locally."""
    if uncached_tokens < 0:
        raise ValueError(f"uncached_tokens must be >= 0, got {uncached_tokens}")
    return not prefill_saturated and uncached_tokens >= min_uncached_tokens


@dataclass(frozen=True)
class PDDecider:
    """Chooses remote prefill ("remote") or prefill on the decode worker ("local"); see the module docstring."""

    min_uncached_tokens: int = 256
    max_prefill_inflight: int = 0  # 0: no limit

    def __post_init__(self):
        if self.min_uncached_tokens < 0 or self.max_prefill_inflight < 0:
            raise ValueError("min_uncached_tokens and max_prefill_inflight must be >= 0")

    def needs_probe(self, num_prompt_tokens: int, n: int = 1, have_prefill: bool = True) -> bool:
        """Whether the decode worker's prefix hit can change the decision (remote prefill is possible and the
        prompt reaches the threshold)."""
        return (have_prefill and n == 1 and self.min_uncached_tokens > 0
                and num_prompt_tokens >= self.min_uncached_tokens)

    def decide(self, num_prompt_tokens: int, n: int, cached_tokens: int, prefill_inflight: int,
               have_prefill: bool) -> str:
        """"remote" or "local" for a prompt of which `cached_tokens` are in the decode worker's prefix cache."""
        if not have_prefill or n != 1:
            return "local"
        saturated = bool(self.max_prefill_inflight) and prefill_inflight >= self.max_prefill_inflight
        uncached = max(0, num_prompt_tokens - cached_tokens)
        return "remote" if should_prefill_remotely(uncached, self.min_uncached_tokens, saturated) else "local"
