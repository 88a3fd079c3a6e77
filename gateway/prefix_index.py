"""The gateway's picture of one worker's prefix cache, built from that worker's KV event stream.

Contract:
- `WorkerIndex` holds the block hashes and KDA snapshot hashes a worker's cache holds (a hash-chain map: a chained
  block hash names its whole prefix, so membership of each of a prompt's hashes, in order, finds the longest cached
  prefix), its hash space (`HashSpace`: fingerprint and block size, as the worker's snapshot said), its load, and
  the stream position (`epoch`, `next_sequence`).
- `apply(message, now)` takes one `KVEventMessage` (protos/kv_events.proto) and returns `APPLIED` or `RESYNC`:
  a snapshot replaces everything (and makes the index live); a batch applies in order only when the index is live,
  of the same epoch, and the batch starts at `next_sequence`; any other batch (a gap, another epoch, no snapshot
  yet) empties the index and answers `RESYNC` (the subscriber then resubscribes for a fresh snapshot).
- `clear()` empties it (not live): the stream broke or went silent (`expired(now, stale_after_s)`: nothing heard
  for that long), the worker restarted, or a request showed the index was wrong. A not-live index holds nothing.
- `cached_tokens(prompt)` is the prompt tokens this worker would serve from its cache under the engine's prefix hit
  rule (`engine.memory.hit_rule.resumable_blocks`: every block present, a snapshot at the last one when the model
  has KDA layers, one token left to compute) over the prompt's hashes in the worker's hash space.
  `cached_tokens(prompt, reader)` reads this index in `reader`'s hash space and hit rule instead: the index of the
  cache service (its snapshot says `any_model`: hashes of every model, no space of its own; live on its snapshot),
  for the worker `reader` that would import from it. The snapshot's `loads_remote_prefix` (a worker that imports
  what the cache service holds) is kept as `loads_remote_prefix`.
- `PromptKey` is a prompt as the routers see it (token ids, the tenant's engine cache salt, image spans); it hashes
  lazily, once per hash space, exactly as the engine does (engine/memory/hashing.py).
Not thread-safe by itself: the router calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.memory.hashing import BlockHasher, MediaSpan, root_hash
from engine.memory.hit_rule import resumable_blocks
from protos import kv_events_pb2

APPLIED, RESYNC = "applied", "resync"
_STORE = {kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED: ("blocks", True),
          kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED: ("blocks", False),
          kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED: ("snapshots", True),
          kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED: ("snapshots", False)}


@dataclass(frozen=True)
class HashSpace:
    fingerprint: bytes
    block_size: int


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass
class PromptKey:
    """A prompt for routing: its tokens, the tenant's engine cache salt (hex; None: no tenant), its image spans."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    media: tuple[MediaSpan, ...] = ()
    _hashes: dict[HashSpace, list[bytes]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def hashes(self, space: HashSpace) -> list[bytes]:
        """The prompt's full-block hashes as a worker of this hash space computes them."""
        if space not in self._hashes:
            hashes: list[bytes] = []
            BlockHasher(space.block_size, root_hash(space.fingerprint, self.cache_salt), self.media).extend(
                hashes, list(self.token_ids))
            self._hashes[space] = hashes
        return self._hashes[space]


class WorkerIndex:
    def __init__(self):
        self.live = False
        self.blocks: set[bytes] = set()
        self.snapshots: set[bytes] = set()
        self.space: HashSpace | None = None
        self.snapshots_required = True
        self.any_model = False  # the cache service's index: hashes of every model
        self.loads_remote_prefix = False  # this worker imports what the cache service holds
        self.epoch: int | None = None
        self.next_sequence = 0
        self.load = WorkerLoad()
        self.heard_at: float | None = None
        self.resyncs = 0  # times the index was emptied for a gap, an epoch change or a wrong belief

    def apply(self, message: kv_events_pb2.KVEventMessage, now: float) -> str:
        body = message.WhichOneof("body")
        if body == "snapshot":
            self._reset(message)
        elif body == "events" and self.live and message.epoch == self.epoch \
                and message.sequence == self.next_sequence:
            for event in message.events.events:
                name, stored = _STORE.get(event.kind, (None, False))
                if name is None:
                    continue  # a kind this gateway does not know: ignored
                target = getattr(self, name)
                target.add(event.block_hash) if stored else target.discard(event.block_hash)
            self.next_sequence += len(message.events.events)
        else:
            self.resyncs += 1
            self.clear()
            return RESYNC
        self.heard_at = now
        self.load = WorkerLoad(message.load.running, message.load.waiting, message.load.kv_usage)
        return APPLIED

    def _reset(self, message: kv_events_pb2.KVEventMessage) -> None:
        snap = message.snapshot
        self.blocks, self.snapshots = set(snap.block_hashes), set(snap.snapshot_hashes)
        self.space = HashSpace(snap.fingerprint, snap.block_size) if snap.block_size > 0 else None
        self.snapshots_required = snap.snapshots_required
        self.any_model, self.loads_remote_prefix = snap.any_model, snap.loads_remote_prefix
        self.epoch, self.next_sequence = message.epoch, message.sequence
        self.live = self.space is not None or self.any_model

    def clear(self) -> None:
        self.live = False
        self.blocks, self.snapshots = set(), set()
        self.load = WorkerLoad()
        self.heard_at = None

    def expired(self, now: float, stale_after_s: float) -> bool:
        return self.live and (self.heard_at is None or now - self.heard_at > stale_after_s)

    def cached_tokens(self, prompt: PromptKey, reader: WorkerIndex | None = None) -> int:
        reader = reader or self
        if not self.live or not reader.live or reader.space is None or prompt.num_tokens == 0:
            return 0
        hashes, bs = prompt.hashes(reader.space), reader.space.block_size
        snapshots = (h in self.snapshots for h in hashes) if reader.snapshots_required else None
        return resumable_blocks(prompt.num_tokens, bs, (h in self.blocks for h in hashes), snapshots) * bs
