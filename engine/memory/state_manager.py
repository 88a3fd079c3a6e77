"""KDA states per request and the snapshots of the prefix cache (the state half of the cache manager), and the
exports of the snapshots that leave it.

Contract:
- Running slot groups: `assign(req)` gives a request a group (`req.state_group`, `req.slot_offset` 0) -> its
  running slot; `release(req)` takes it back (its rolling turn end stays, as an ordinary turn-end snapshot).
  `running_slot(req)` holds its state; a verification of n positions writes `verify_slots(req, n)`, and
  `settle(req, kept)` makes the slot of the last kept position the running one (an index change, no copy) -> the
  slots holding the state after each kept position.
- Snapshots: `take_snapshot(req, num_tokens, src, priority, rolling)` gives the state after the first `num_tokens`
  of `req` (a block boundary; its last block's hash names it) a snapshot slot -> the `(src, slot)` copy the runner
  applies before the next step (then `copies_applied()`), or none when it exists already (refreshed) or the state
  pool keeps it out (retention by priority, then LRU: engine/memory/state_pool.py). `rolling`: the request's turn
  end, replacing its previous one. `reserve_snapshot(hash)` gives an imported snapshot a slot (top priority).
  `block_evicted(hash)` (the block manager's eviction callback): the block a snapshot ends left the block cache, so
  the snapshot goes too.
- Exports (while `exporting`): a snapshot that leaves — evicted for a slot, or dropped with its last block — and a
  finished request's turn end whose prompt blocks the cache service already holds (`record_turn_end`) become
  `PendingExport`s naming the slot and the blocks of its prefix not sent before (`note_sent`). A victim whose slot
  still awaits its copy holds nothing yet and is not exported. Their contents are intact until the next pool write,
  so every write operation that can queue one, here and in the cache manager, ends with `drain_exports()`: the queue
  goes to the export reader (`set_export_reader`: the exchange, engine/exchange.py) before it returns, and the
  engine never has to remember to. Without a reader they wait for `take_exports()`. `not_exporting()` suspends
  exports (a prefix cache reset).
- Nothing here touches device memory; slot ids are exact and deterministic.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from engine.memory.events import CacheEventSink
from engine.memory.state_pool import SnapshotPriority, StatePool
from engine.request import Request

MIN_SENT_MEMORY = 1024  # block hashes remembered as already in the cache service (at least; 4 per pool block)


@dataclass
class SnapshotInfo:
    """What the state manager knows about a snapshot it took: the prefix it ends (the first `num_blocks` of
    `hashes`, a request's append-only hash list), the block holding its last block, the tenant's salt, whether it is
    a request's rolling turn end (`owner`: that request's id)."""

    hashes: list[bytes]
    num_blocks: int
    last_block: int
    cache_salt: str | None
    owner: str | None = None


@dataclass(frozen=True)
class PendingExport:
    """A snapshot to read out before its slot or blocks are written again (see the module docstring)."""

    reason: str  # "evicted" | "turn_end"
    block_hash: bytes  # the prefix's last block
    slot: int
    blocks: tuple[tuple[bytes, int], ...]  # (hash, block id) of the prefix's blocks not sent before, in order
    cache_salt: str | None
    num_tokens: int


ExportReader = Callable[[list[PendingExport]], None]


class StateManager:
    def __init__(self, num_groups: int, slots_per_request: int, num_snapshot_slots: int, block_size: int,
                 cached_block: Callable[[bytes], int | None], events: CacheEventSink, sent_memory: int):
        self.block_size = block_size
        self.pool = StatePool(num_groups, slots_per_request, num_snapshot_slots, on_evict=self._snapshot_evicted,
                              events=events)
        self._cached_block = cached_block  # the block manager's lookup: block hash -> block id or None
        self._info: dict[bytes, SnapshotInfo] = {}  # snapshots taken here (not imported ones)
        self._rolling: dict[str, bytes] = {}  # request id -> its rolling turn-end snapshot
        self._unwritten: set[int] = set()  # snapshot slots handed out whose copies are not applied yet
        self._sent: OrderedDict[bytes, None] = OrderedDict()  # block hashes the cache service holds (LRU-bounded)
        self._sent_memory = max(MIN_SENT_MEMORY, sent_memory)
        self.pending_exports: list[PendingExport] = []
        self._reader: ExportReader | None = None
        self.exporting = False
        self._suspended = False  # not_exporting(): snapshots leaving are not exported
        self.num_exports = 0
        self.num_snapshots_taken = 0

    # -- running slot groups ---------------------------------------------------------------------------------

    def assign(self, req: Request) -> int:
        """Gives `req` (holding none) a running slot group -> its running slot."""
        assert req.state_group is None, f"{req.request_id} already holds a running slot group"
        req.state_group = self.pool.allocate_group()
        req.slot_offset = 0
        return self.pool.running_slot(req.state_group)

    def release(self, req: Request) -> None:
        """Takes back the request's group; its rolling turn end stays, as an ordinary turn-end snapshot."""
        if req.state_group is not None:
            self.pool.free_group(req.state_group)
            req.state_group = None
            req.slot_offset = 0
        rolling = self._rolling.pop(req.request_id, None)
        if rolling is not None:
            self._info[rolling].owner = None

    def running_slot(self, req: Request) -> int:
        """The slot of the request's group that holds its running state (`req.slot_offset`)."""
        return self.pool.running_slot(req.state_group) + req.slot_offset

    def verify_slots(self, req: Request, num_tokens: int) -> tuple[int, ...]:
        """Out-slots of a verification of `num_tokens` positions: the group's slots after the running one, in turn
        (the last may be the running slot itself: the kernels read every state before writing any)."""
        spr = self.pool.slots_per_request
        assert num_tokens <= spr, f"{num_tokens} verified positions, {spr} slots per request"
        base = self.pool.running_slot(req.state_group)
        return tuple(base + (req.slot_offset + 1 + i) % spr for i in range(num_tokens))

    def settle(self, req: Request, kept: int) -> tuple[int, ...]:
        """After a verification whose first `kept` positions are committed: the out-slot of the last kept one
        becomes the running slot -> the out-slots of the kept positions, in order."""
        slots = self.verify_slots(req, kept)
        req.slot_offset = (req.slot_offset + kept) % self.pool.slots_per_request
        return slots

    # -- snapshots -------------------------------------------------------------------------------------------

    def has_snapshot(self, block_hash: bytes) -> bool:
        return self.pool.has_snapshot(block_hash)

    def get_snapshot(self, block_hash: bytes) -> int | None:
        """The snapshot's slot (marked most recently used), or None."""
        return self.pool.get_snapshot(block_hash)

    def take_snapshot(self, req: Request, num_tokens: int, src: int, priority: SnapshotPriority,
                      rolling: bool) -> list[tuple[int, int]]:
        """A snapshot slot for the state after `num_tokens` tokens of `req`, now in slot `src` -> the copy to apply
        ([] when the snapshot exists already or the state pool keeps it out)."""
        h = req.block_hashes[num_tokens // self.block_size - 1]
        if rolling:
            self._drop_rolling(req.request_id)
        slot = self.pool.put_snapshot(h, priority)
        info = self._info.get(h)
        self.drain_exports()  # the slot's previous snapshot, if it was evicted
        if slot is None:
            if info is not None and not rolling and info.owner is not None:  # now a point of its own right
                self._rolling.pop(info.owner, None)
                info.owner = None
            return []
        self._info[h] = SnapshotInfo(req.block_hashes, num_tokens // self.block_size, self._cached_block(h),
                                     req.cache_salt, req.request_id if rolling else None)
        if rolling:
            self._rolling[req.request_id] = h
        self._unwritten.add(slot)
        self.num_snapshots_taken += 1
        return [(src, slot)]

    def copies_applied(self) -> None:
        """The runner applied the copies `take_snapshot` returned: those slots now hold their snapshots."""
        self._unwritten.clear()

    def reserve_snapshot(self, block_hash: bytes) -> int | None:
        """A slot for an imported snapshot, at the top priority (a request is about to resume from it; it came from
        the cache service, so it is never exported again); None when it exists."""
        slot = self.pool.put_snapshot(block_hash, SnapshotPriority.HINT)
        self.drain_exports()  # the slot's previous snapshot, if it was evicted
        return slot

    def _drop_rolling(self, request_id: str) -> None:
        """Drops the request's previous rolling turn end (superseded by a later one on the same chain)."""
        h = self._rolling.pop(request_id, None)
        if h is not None:
            self.pool.drop_snapshot(h)
            del self._info[h]

    # -- snapshots leaving -----------------------------------------------------------------------------------

    def _snapshot_evicted(self, block_hash: bytes, slot: int) -> None:
        """A snapshot evicted for a slot (state pool callback): exported when its contents are in its slot."""
        info = self._forget(block_hash)
        if info is not None and slot not in self._unwritten:
            self._record_export("evicted", block_hash, slot, info)

    def block_evicted(self, block_hash: bytes) -> None:
        """A cached block left the block cache (block manager callback): the snapshot it ends goes with it."""
        slot = self.pool.get_snapshot(block_hash)
        if slot is None:
            return
        info = self._forget(block_hash)
        if info is not None:
            self._record_export("evicted", block_hash, slot, info)
        self.pool.drop_snapshot(block_hash)

    def _forget(self, block_hash: bytes) -> SnapshotInfo | None:
        info = self._info.pop(block_hash, None)
        if info is not None and info.owner is not None:
            self._rolling.pop(info.owner, None)
        return info

    # -- exports ---------------------------------------------------------------------------------------------

    def set_export_reader(self, reader: ExportReader | None) -> None:
        """Who reads the pending exports out of the pools at the end of every write operation (None: they wait for
        `take_exports`)."""
        self._reader = reader

    def drain_exports(self) -> None:
        """Hands the pending exports to the reader, if one is registered. Every write operation that can queue one
        ends with it (a decorator would cost a microsecond per call on the step's hot path)."""
        if self._reader is not None and self.pending_exports:
            self._reader(self.take_exports())

    def take_exports(self) -> list[PendingExport]:
        pending, self.pending_exports = self.pending_exports, []
        return pending

    @contextlib.contextmanager
    def not_exporting(self) -> Iterator[None]:
        """Snapshots leaving inside this block are not exported (a prefix cache reset)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def _record_export(self, reason: str, block_hash: bytes, slot: int, info: SnapshotInfo) -> None:
        if not self.exporting or self._suspended:
            return
        blocks = []
        for i, h in enumerate(info.hashes[: info.num_blocks]):
            block = self._cached_block(h)
            if block is None and i == info.num_blocks - 1:
                block = info.last_block  # being evicted now: its contents are still there
            if h not in self._sent and block is not None:
                blocks.append((h, block))
        self.note_sent(h for h, _ in blocks)
        self.pending_exports.append(PendingExport(reason, block_hash, slot, tuple(blocks), info.cache_salt,
                                           info.num_blocks * self.block_size))
        self.num_exports += 1

    def record_turn_end(self, req: Request) -> None:
        """Queues a finished request's turn-end snapshot for export when its prompt's full blocks are known to be
        in the cache service (only its output blocks are new: a handoff's turn)."""
        h = self._rolling.get(req.request_id)
        info = self._info.get(h) if h is not None else None
        if info is None or not self.exporting:
            return
        if all(b in self._sent for b in req.block_hashes[: req.num_prompt_tokens // self.block_size]):
            self._record_export("turn_end", h, self.pool.get_snapshot(h), info)
            self.drain_exports()

    def note_sent(self, hashes: Iterable[bytes]) -> None:
        """Remembers blocks the cache service holds (imported from it, or exported), so exports skip them."""
        for h in hashes:
            self._sent[h] = None
            self._sent.move_to_end(h)
        while len(self._sent) > self._sent_memory:
            self._sent.popitem(last=False)

    # -- checks ----------------------------------------------------------------------------------------------

    def check_integrity(self, reqs: Sequence[Request]) -> None:
        """Raises AssertionError when the pool, the snapshot records and the (all holding) requests disagree."""
        for r in reqs:
            assert r.state_group is not None, f"{r.request_id} holds blocks but no running slot"
        self.pool.check_integrity([r.state_group for r in reqs])
        for h in self.pool.snapshot_order():
            assert self._cached_block(h) is not None, "a snapshot outlived its last block"
        assert set(self._info) <= set(self.pool.snapshot_order()), "a snapshot's record outlived it"
        for rid, h in self._rolling.items():
            assert h in self._info and self._info[h].owner == rid, f"{rid}: its rolling turn end is not recorded"
