"""Worker choice for one pool (prefill or decode) from the workers' KV event streams, and the P/D decision.

Contract:
- `Router(addresses, config)` serves one pool (`--prefill-workers` or `--decode-workers`, parsed by
  `parse_worker_list`). Each worker has a `WorkerIndex` (gateway/prefix_index.py) fed by its KV event stream
  (`apply_kv_event`, from gateway/kv_events.py): what its prefix cache holds, and its load as it last reported.
- Reusable tokens of a prompt on a worker (`Pick.cached_tokens`): `max(local, importable)`, where `local` is what
  its own cache serves (`WorkerIndex.cached_tokens`: the engine's prefix hit rule over the hashes the worker
  reported) and `importable` what the cache service holds under the same rule in that worker's hash space
  (`CacheServiceView`, fed by the cache service's own KV event stream) — counted only for a worker whose snapshot
  says it loads remote prefixes (`loads_remote_prefix`: it imports that prefix, blocks + snapshot, before computing;
  worker/prefix.py). `transfer_tokens = cached_tokens - local` of them travel from the cache service.
- Cost (`pick(prompt)`): the healthy worker of least
  `cost = uncached_tokens + transfer_weight * transfer_tokens + load_weight * queue + kv_usage_weight * kv_usage`:
  a token cached nowhere the worker can reach costs 1 (a prefill), one imported `transfer_weight` (default 1/8: a
  copy, far cheaper than computing it), one in its own cache 0; `uncached_tokens = prompt - cached_tokens`; `queue = active + max(0, running + waiting - active_then)` (`active`: this gateway's
  requests in flight there, known at once; `running + waiting`: the worker's last report, of which the `active_then`
  this gateway had in flight when it arrived are its own: the rest are other gateways') and `kv_usage` the reported fraction of its KV pool in use. Ties go to the worker listed first. No
  healthy worker: `NoHealthyWorker`. `costs(prompt)` lists every healthy worker's `Pick`.
- Nothing is guessed: a worker whose index is not live (no snapshot yet, a gap or a new epoch until the resync, a
  broken stream) or whose stream was silent for `config.stale_after_s` counts as holding nothing.
- `route(prompt)` is `pick` + `start` under one lock; `finish(address)` ends a request. `observe(pick, actual)`: a
  request reported fewer cached tokens than its pick predicted: an index was wrong (events not yet arrived, or a
  restart not yet seen), so it is emptied at once — no second request is routed on that belief — and the caller
  resubscribes: the worker's (`WORKER`) when even its local share was not served, else the cache service's
  (`CACHE`).
- Health: workers start healthy; `mark_unhealthy` / `mark_healthy` are called by the app's health-check loop.
  Marking a worker unhealthy empties its index; its in-flight count stays until those requests `finish`.
- Pool membership: `set_addresses(addresses)` replaces the worker set (service discovery calls it through
  `MeshClient.set_worker_addresses`); new workers start empty and healthy, removed ones get no new requests.
- Thread-safe; nothing blocks. Unknown addresses raise `KeyError`, except `finish` and `apply_kv_event` (no-ops for a
  removed worker).
- The P/D decision (`PDDecider`, used by `gateway.mesh_client.MeshClient` for every request): prefill on the decode
  worker ("local") when there is no healthy prefill worker, the request has `n > 1`, or prefill is saturated
  (`max_prefill_inflight` prefills in flight from this gateway; 0: no limit); else remote prefill exactly when at
  least `min_uncached_tokens` prompt tokens are not reusable on the chosen decode worker — neither in its prefix
  cache nor importable by it from the cache service — read from the same `Pick` that chose it (`Pick.cached_tokens`;
  `should_prefill_remotely`). So a prefix that only the cache service holds sends a request down the colocated path
  when the decode worker imports it (a transfer instead of a second prefill and a handoff).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.prefix_index import RESYNC, PromptKey, WorkerIndex

WORKER, CACHE = "worker", "cache"  # which index `Router.observe` found wrong
from protos import kv_events_pb2


class NoHealthyWorker(Exception):
    """Every worker of the pool is unhealthy (the REST layer answers 503)."""


@dataclass(frozen=True)
class RouterConfig:
    # One queued request (in flight here, or running/waiting as the worker reports) costs this many uncached tokens.
    load_weight: float = 128.0
    # A full KV pool costs this many uncached tokens (it preempts or queues; proportional below).
    kv_usage_weight: float = 256.0
    # One prompt token imported from the cache service costs this many uncached tokens (a copy, not a prefill).
    transfer_weight: float = 0.125
    # A worker whose event stream said nothing for this long (seconds) counts as holding nothing (heartbeats: 0.5 s).
    stale_after_s: float = 3.0
    # A connected worker whose health answer is late is busy, not dead: it stays in the pool until it has not
    # answered for this long (seconds; gateway/worker_pool.py `health_verdict`).
    busy_grace_s: float = 30.0

    def __post_init__(self):
        if not 0 <= self.transfer_weight <= 1:
            raise ValueError(f"transfer_weight must be in [0, 1], got {self.transfer_weight}")
        if self.load_weight < 0 or self.kv_usage_weight < 0:
            raise ValueError(f"load_weight and kv_usage_weight must be >= 0, got {self.load_weight}, "
                             f"{self.kv_usage_weight}")
        if self.stale_after_s <= 0 or self.busy_grace_s < 0:
            raise ValueError(f"stale_after_s must be positive and busy_grace_s >= 0, got {self.stale_after_s}, "
                             f"{self.busy_grace_s}")


@dataclass(frozen=True)
class Pick:
    address: str
    cached_tokens: int  # reusable there: in its own cache, or importable from the cache service
    uncached_tokens: int
    queue: int  # this gateway's requests in flight + the others the worker last reported
    kv_usage: float
    cost: float
    local_tokens: int = 0  # of `cached_tokens`, in the worker's own cache
    transfer_tokens: int = 0  # of `cached_tokens`, to import from the cache service


class CacheServiceView:
    """What the cache service holds, from its KV event stream (gateway/kv_events.py feeds it like a worker's index:
    `apply_kv_event`, `clear_index`); shared by the mesh's routers. Silent for `stale_after_s`: holds nothing."""

    def __init__(self, stale_after_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.index = WorkerIndex()
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()

    def apply_kv_event(self, address: str, message: kv_events_pb2.KVEventMessage) -> str:
        with self._lock:
            return self.index.apply(message, self._clock())

    def clear_index(self, address: str | None = None) -> None:
        with self._lock:
            self.index.clear()

    def held_tokens(self, prompt: PromptKey, reader: WorkerIndex) -> int:
        """The prompt tokens the worker of index `reader` could import (its hash space and hit rule)."""
        with self._lock:
            if self.index.expired(self._clock(), self.stale_after_s):
                self.index.clear()
            return self.index.cached_tokens(prompt, reader)

    def observe_wrong(self) -> bool:
        """A worker imported less than this view promised: empties it -> True when it was live (resubscribe)."""
        with self._lock:
            if not self.index.live:
                return False
            self.index.resyncs += 1
            self.index.clear()
            return True


def parse_worker_list(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`"host1:50051,host2:50051"` (or a list of such strings) → addresses; empty → (); duplicates are an error."""
    items = [text] if isinstance(text, str) else list(text or ())
    addresses = [a.strip() for item in items for a in item.split(",") if a.strip()]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ValueError(f"worker addresses listed twice: {', '.join(duplicates)}")
    return tuple(addresses)


class _WorkerState:
    def __init__(self, address: str):
        self.address = address
        self.healthy = True
        self.active = 0
        self.active_at_report = 0  # `active` when the worker's last load report arrived
        self.index = WorkerIndex()


class Router:
    def __init__(self, addresses: Sequence[str], config: RouterConfig = RouterConfig(),
                 clock: Callable[[], float] = time.monotonic, cache_view: CacheServiceView | None = None):
        if not addresses:
            raise ValueError("a router needs at least one worker address")
        addresses = parse_worker_list(list(addresses))
        self.config = config
        self._clock = clock
        self.cache_view = cache_view  # None: no cache service events; only the workers' own caches count
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

    def pick(self, prompt: PromptKey | None = None) -> Pick:
        """The cheapest healthy worker for `prompt` (None: an empty prompt, load only); changes nothing."""
        with self._lock:
            return self._pick(prompt)

    def costs(self, prompt: PromptKey | None = None) -> list[Pick]:
        """Every healthy worker's cost for this prompt, in list order (for metrics and debugging)."""
        with self._lock:
            return self._costs(prompt)

    def route(self, prompt: PromptKey | None = None) -> Pick:
        """`pick` then `start` on the chosen worker, atomically; call `finish(pick.address)` when the request ends."""
        with self._lock:
            choice = self._pick(prompt)
            self._workers[choice.address].active += 1
            return choice

    def start(self, address: str) -> None:
        """A request starts on `address`."""
        with self._lock:
            self._workers[address].active += 1

    def finish(self, address: str) -> None:
        """A request on `address` ended (finished, failed or cancelled)."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is not None:  # None: dropped by `set_addresses` while the request ran
                worker.active = max(0, worker.active - 1)

    # -- the KV event streams -----------------------------------------------------------------------------------

    def apply_kv_event(self, address: str, message: kv_events_pb2.KVEventMessage) -> str:
        """One message of `address`'s stream -> `APPLIED`, or `RESYNC` (resubscribe; see `WorkerIndex.apply`)."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is None:
                return RESYNC
            worker.active_at_report = worker.active
            return worker.index.apply(message, self._clock())

    def clear_index(self, address: str) -> None:
        """`address`'s stream broke or went silent: it counts as holding nothing until its next snapshot."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is not None:
                worker.index.clear()

    def observe(self, pick: Pick, actual_tokens: int) -> str | None:
        """A request routed on `pick` was served `actual_tokens` from the worker's cache (after any import) -> the
        index emptied for a belief too high (`WORKER` or `CACHE`: resubscribe it), or None."""
        if actual_tokens >= pick.cached_tokens:
            return None
        if actual_tokens >= pick.local_tokens and pick.transfer_tokens:
            return CACHE if self.cache_view is not None and self.cache_view.observe_wrong() else None
        with self._lock:
            worker = self._workers.get(pick.address)
            if worker is None or not worker.index.live:
                return None
            worker.index.resyncs += 1
            worker.index.clear()
            return WORKER

    def index(self, address: str) -> WorkerIndex:
        """`address`'s prefix index (read it under no assumption of stability: for tests and metrics)."""
        with self._lock:
            return self._workers[address].index

    # -- health -------------------------------------------------------------------------------------------------

    def mark_healthy(self, address: str) -> None:
        with self._lock:
            self._workers[address].healthy = True

    def mark_unhealthy(self, address: str) -> None:
        with self._lock:
            worker = self._workers[address]
            worker.healthy = False
            worker.index.clear()

    def is_healthy(self, address: str) -> bool:
        with self._lock:
            return self._workers[address].healthy

    def active(self, address: str) -> int:
        with self._lock:
            return self._workers[address].active

    # -- cost ---------------------------------------------------------------------------------------------------

    def _cost(self, worker: _WorkerState, prompt: PromptKey | None, now: float) -> Pick:
        index = worker.index
        if index.expired(now, self.config.stale_after_s):
            index.clear()  # silent for too long: nothing it said can be trusted
        local = index.cached_tokens(prompt) if prompt is not None else 0
        importable = self.cache_view.held_tokens(prompt, index) if (
            prompt is not None and self.cache_view is not None and index.loads_remote_prefix) else 0
        cached = max(local, importable)
        uncached = (prompt.num_tokens if prompt is not None else 0) - cached
        others = max(0, index.load.running + index.load.waiting - worker.active_at_report)
        queue = worker.active + others
        cost = (uncached + self.config.transfer_weight * (cached - local) + self.config.load_weight * queue
                + self.config.kv_usage_weight * index.load.kv_usage)
        return Pick(worker.address, cached, uncached, queue, index.load.kv_usage, cost, local, cached - local)

    def _costs(self, prompt: PromptKey | None) -> list[Pick]:
        now = self._clock()
        return [self._cost(w, prompt, now) for w in self._workers.values() if w.healthy]

    def _pick(self, prompt: PromptKey | None) -> Pick:
        picks = self._costs(prompt)
        if not picks:
            raise NoHealthyWorker(f"no healthy worker among {', '.join(self._workers) or 'no workers'}")
        return min(picks, key=lambda p: p.cost)  # min keeps the first of equal costs: list order breaks ties


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

    def decide(self, num_prompt_tokens: int, n: int, cached_tokens: int, prefill_inflight: int,
               have_prefill: bool) -> str:
        """"remote" or "local" for a prompt of which `cached_tokens` are reusable on the decode worker (its prefix
        cache, or imported by it from the cache service: `Pick.cached_tokens`)."""
        if not have_prefill or n != 1:
            return "local"
        saturated = bool(self.max_prefill_inflight) and prefill_inflight >= self.max_prefill_inflight
        uncached = max(0, num_prompt_tokens - cached_tokens)
        return "remote" if should_prefill_remotely(uncached, self.min_uncached_tokens, saturated) else "local"
