"""The hybrid cache manager: MLA blocks and KDA slots per request, plus the prefix cache over both.

Contract:
- A request holds `block_ids` covering at least its `num_computed_tokens` (plus the tokens of the step being
  scheduled) and one running slot group (`state_group`) while it runs; `free(req)` returns both.
- Prefix hit rule (`resumable_blocks`, engine/memory/hit_rule.py, the one rule: admission, the decode worker's probe and the prefill worker's
  choice between its own cache and the cache service's all use it): a request resumes at the longest prefix `p`
  such that every block up to `p` is cached, a KDA snapshot keyed by the hash of block `p/block_size - 1` exists,
  and `p < len(token_ids)` (at least one token is computed, to produce logits). Without KDA layers any cached block
  boundary qualifies. `resumable_prefix(hashes, n)` applies it to this cache, `presence(hashes)` says which blocks
  and snapshots it holds; neither changes anything.
- Snapshot points of a request and their retention priorities: engine/memory/policy.py (prompt ends, periodic
  ones, and in the "hybrid" policy structure hints, junctions and the rolling turn end). The scheduler ends prefill
  chunks at the next point lacking a snapshot (`next_chunk_end`) so that after the step `commit` can copy the
  running slot into a snapshot slot; `junction(req, hit)` plans where a waiting request's chain leaves what it shares.
- `commit(req)` after a step registers the newly full blocks under their hashes and returns the `(src, dst)` slot
  copies the runner must apply before the next step (then `copies_applied()`). `admit` returns the `StateInit` for
  the request's running slot (zero it, or copy a snapshot into it) that the runner must apply before its first step.
- Exports (while `exporting`): a snapshot that leaves this cache — evicted for a slot, or dropped because its last
  block was evicted — and a finished request's turn end whose earlier blocks the cache service already holds
  (`record_turn_end`) are queued as `PendingExport`s naming the slot and the blocks (not sent before) to read out.
  Their contents are intact until the next forward, `copies_applied()` or pool write, so the caller reads them
  (`take_exports()`) before those; a victim whose slot still awaits its copy is not exported.
- Events: `events` (engine/memory/events.py) records the blocks and snapshots stored and removed once
  `start_events()` turned it on; that call also returns the `CacheListing` they start from.
- Counters: `lookup_tokens` (prompt tokens of admitted requests), `hit_tokens` (of those, served from the cache),
  `num_junctions`, `num_exports`, `num_snapshots_taken` (state copies into snapshot slots after steps).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.config import CachePlan
from engine.memory.block_pool import KVBlockPool
from engine.memory.events import CacheEventSink
from engine.memory.hit_rule import resumable_blocks
from engine.memory.policy import Junction, SnapshotPolicy, plan_junction
from engine.memory.state_pool import SnapshotPriority, StatePool
from engine.request import Request
from engine.transfer import RequestState

MIN_SENT_MEMORY = 1024  # block hashes remembered as already in the cache service (at least; 4 per pool block)


@dataclass(frozen=True)
class PrefixPresence:
    """Which of a prompt's full blocks (by hash, in order) a prefix cache holds, and which have a KDA snapshot."""

    blocks: list[bool]
    snapshots: list[bool]


@dataclass(frozen=True)
class CacheListing:
    """Everything the prefix cache holds at one moment (`CacheManager.start_events`)."""

    block_hashes: list[bytes]
    snapshot_hashes: list[bytes]
    block_size: int
    snapshots_required: bool  # the model has KDA layers: a hit must end at a snapshot (`resumable_blocks`)


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    snapshot_hash: bytes | None = None
    imported: bool = False  # the tokens come with the request (`Request.imported`), not from the cache
    cached_blocks: int = 0  # leading full blocks of the request cached here (with or without a snapshot)


@dataclass(frozen=True)
class StateInit:
    """What the runner does to a request's running slot (and blocks) before its first step."""

    dst: int
    src: int | None = None  # copy the snapshot slot `src`; with neither `src` nor `load`: zero the slot
    load: RequestState | None = None  # write this imported state into `dst` and its KV into `load_blocks`
    load_blocks: tuple[int, ...] = ()


@dataclass
class SnapshotInfo:
    """What the manager knows about a snapshot it took: the prefix it ends (the first `num_blocks` of `hashes`, a
    request's append-only hash list), the block holding its last block, the tenant's salt, whether it is a request's
    rolling turn end (`owner`: that request's id)."""

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


class CacheManager:
    def __init__(self, plan: CachePlan, has_kda: bool):
        self.plan = plan
        self.block_size = plan.block_size
        self.has_kda = has_kda
        self.caching = plan.snapshot_interval > 0
        self.policy = SnapshotPolicy(plan.block_size, plan.snapshot_interval, plan.snapshot_policy)
        self.events = CacheEventSink()  # off until `start_events`
        self.state_pool = StatePool(plan.num_running_slots // plan.slots_per_request, plan.slots_per_request,
                                    plan.num_snapshot_slots, on_evict=self._snapshot_evicted, events=self.events)
        self.block_pool = KVBlockPool(plan.num_blocks, on_evict=self._block_evicted, events=self.events)
        self._committed: dict[str, int] = {}  # request id -> blocks registered in the cache so far
        self._info: dict[bytes, SnapshotInfo] = {}  # snapshots taken here (not imported ones)
        self._rolling: dict[str, bytes] = {}  # request id -> its rolling turn-end snapshot
        self._unwritten: set[int] = set()  # snapshot slots handed out by `commit` whose copies are not applied yet
        self._sent: OrderedDict[bytes, None] = OrderedDict()  # block hashes the cache service holds (LRU-bounded)
        self._sent_memory = max(MIN_SENT_MEMORY, 4 * plan.num_blocks)
        self._pending: list[PendingExport] = []
        self.exporting = False
        self._forgetting = False  # reset_prefix_cache: evictions are not exported
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.num_junctions = 0
        self.num_exports = 0
        self.num_snapshots_taken = 0

    # -- sizes -----------------------------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def snapshots_enabled(self) -> bool:
        return self.caching and self.has_kda and self.state_pool.num_snapshot_slots > 0

    # -- prefix cache ----------------------------------------------------------------------------------------

    def lookup(self, req: Request) -> PrefixHit:
        """The longest resumable cached prefix of `req.token_ids` (no side effects); an imported request's own."""
        if req.imported is not None:
            return PrefixHit(req.imported.num_computed_tokens, imported=True)
        if req.params.prompt_logprobs is not None:  # the cached part would have no logits: compute everything
            return PrefixHit()
        hashes = req.block_hashes[: self.resumable_prefix(req.block_hashes, req.num_tokens)]
        cached = 0
        if self.caching:
            cached = next((i for i, h in enumerate(req.block_hashes) if self.block_pool.get_cached(h) is None),
                          len(req.block_hashes))
        return PrefixHit(len(hashes) * self.block_size, [self.block_pool.get_cached(h) for h in hashes],
                         hashes[-1] if self.has_kda and hashes else None, cached_blocks=cached)

    def resumable_prefix(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Blocks of the longest prefix this cache serves to `num_tokens` tokens whose full blocks hash to
        `hashes` (the prefix hit rule; 0 with prefix caching off)."""
        if not self.caching:
            return 0
        pool, states = self.block_pool, self.state_pool
        return resumable_blocks(num_tokens, self.block_size, (pool.get_cached(h) is not None for h in hashes),
                                (states.has_snapshot(h) for h in hashes) if self.has_kda else None)

    def presence(self, hashes: Sequence[bytes]) -> PrefixPresence:
        return PrefixPresence([self.block_pool.get_cached(h) is not None for h in hashes],
                              [self.state_pool.has_snapshot(h) for h in hashes])

    def start_events(self) -> CacheListing:
        """Turns `events` on (nothing pending) and lists what the cache holds now: the state the events that follow
        change. Call on the step thread (between steps)."""
        self.events.restart()
        return CacheListing(self.block_pool.cached_hashes(), self.state_pool.snapshot_hashes(),
                            self.block_size, self.has_kda and self.caching)

    def snapshot_boundaries(self, req: Request) -> set[int]:
        return self.policy.prompt_ends(req)

    def next_chunk_end(self, req: Request, computed: int, end: int | None = None) -> int:
        """Where the chunk starting at `computed` must end: the next snapshot point still lacking a snapshot, else
        `end` (default: all known tokens; a verification passes its last draft position + 1)."""
        end = req.num_tokens if end is None else end
        if not self.snapshots_enabled:
            return end
        for b in self.policy.candidates(req, computed, end):
            i = b // self.block_size - 1  # a point among a verification's drafts has no hash yet: it lacks one
            if i >= len(req.block_hashes) or not self.state_pool.has_snapshot(req.block_hashes[i]):
                return b
        return end

    def junction(self, req: Request, hit: PrefixHit, running: Sequence[Request]) -> Junction | None:
        """Where `req` (waiting, about to be admitted with `hit`) leaves the prefix it shares with the cache or a
        running request (`policy.plan_junction`); the point is recorded on the request that will take the snapshot
        (`req` itself, or the producer `req` waits for). None under the periodic policy or without snapshots."""
        if hit.imported or not (self.policy.hybrid and self.snapshots_enabled):
            return None
        plan = plan_junction(req, hit.num_tokens // self.block_size, hit.cached_blocks, running, self.block_size)
        if plan is not None:
            target = plan.producer if plan.producer is not None else req
            if plan.position not in target.snapshot_points:
                target.snapshot_points[plan.position] = SnapshotPriority.HINT
                self.num_junctions += 1
        return plan

    # -- admission and growth --------------------------------------------------------------------------------

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Whether `admit` + `allocate(num_new_tokens)` would succeed now."""
        need = self.blocks_for(hit.num_tokens + num_new_tokens) - len(hit.block_ids)
        revived = sum(1 for b in hit.block_ids if self.block_pool.ref_cnt[b] == 0)
        return self.state_pool.num_free_groups > 0 and self.block_pool.num_free_blocks - revived >= need

    def admit(self, req: Request, hit: PrefixHit) -> StateInit:
        """Gives `req` the hit's blocks and a running slot group; sets `num_computed_tokens` to the hit length."""
        assert not req.block_ids and req.state_group is None
        self.block_pool.touch(hit.block_ids)
        req.block_ids = list(hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        req.state_group = self.state_pool.allocate_group()
        req.slot_offset = 0
        self._committed[req.request_id] = len(hit.block_ids)
        slot = self.state_pool.running_slot(req.state_group)
        if hit.imported:
            return StateInit(dst=slot)  # the scheduler attaches the data once the blocks are allocated
        self.lookup_tokens += req.num_tokens
        self.hit_tokens += hit.num_tokens
        if hit.snapshot_hash is None:
            return StateInit(dst=slot)
        return StateInit(dst=slot, src=self.state_pool.get_snapshot(hit.snapshot_hash))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Adds blocks so `req` covers `num_computed_tokens + num_new_tokens`; False (nothing changed) if short."""
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.block_pool.num_free_blocks:
            return False
        req.block_ids.extend(self.block_pool.allocate(need))
        return True

    def free(self, req: Request) -> None:
        """Returns the request's blocks (tail first) and its running slot group; its rolling turn-end snapshot
        stays, as an ordinary turn-end snapshot."""
        self.block_pool.free(reversed(req.block_ids))
        req.block_ids = []
        if req.state_group is not None:
            self.state_pool.free_group(req.state_group)
            req.state_group = None
            req.slot_offset = 0
        self._committed.pop(req.request_id, None)
        rolling = self._rolling.pop(req.request_id, None)
        if rolling is not None:
            self._info[rolling].owner = None

    def running_slot(self, req: Request) -> int:
        """The slot of the request's group that holds its running state (`req.slot_offset`)."""
        return self.state_pool.running_slot(req.state_group) + req.slot_offset

    # -- speculative verification ----------------------------------------------------------------------------

    def verify_slots(self, req: Request, num_tokens: int) -> tuple[int, ...]:
        """Out-slots of a verification of `num_tokens` positions: the group's slots after the running one, in turn
        (the last may be the running slot itself: the kernels read every state before writing any)."""
        spr = self.state_pool.slots_per_request
        assert num_tokens <= spr, f"{num_tokens} verified positions, {spr} slots per request"
        base = self.state_pool.running_slot(req.state_group)
        return tuple(base + (req.slot_offset + 1 + i) % spr for i in range(num_tokens))

    def settle_verification(self, req: Request, start: int, kept: int) -> dict[int, int]:
        """After a verification from `start` whose first `kept` positions are committed: the running slot becomes
        the out-slot of the last kept position (an index change, no copy), the blocks past the committed tokens
        go back to the pool (rejected positions' KV is dropped; they were never in the prefix cache) ->
        {computed tokens p: slot holding the state after p} for the kept positions (for `commit`)."""
        slots = self.verify_slots(req, kept)
        req.num_computed_tokens = start + kept
        req.slot_offset = (req.slot_offset + kept) % self.state_pool.slots_per_request
        keep = self.blocks_for(req.num_computed_tokens)
        tail, req.block_ids = req.block_ids[keep:], req.block_ids[:keep]
        self.block_pool.free(reversed(tail))
        return {start + 1 + i: slot for i, slot in enumerate(slots)}

    # -- after a step ----------------------------------------------------------------------------------------

    def commit(self, req: Request, states: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """Registers newly computed full blocks; returns the snapshot copies (running slot -> snapshot slot).
        `states` (a verification, `settle_verification`): slots holding the state after earlier token counts of
        this step, so a rolling turn end crossed inside the verified positions is snapshotted from its slot."""
        if not self.caching:
            return []
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(self._committed.get(req.request_id, 0), full):
            self.block_pool.cache(req.block_ids[i], req.block_hashes[i])
        self._committed[req.request_id] = full
        p, src = req.num_computed_tokens, self.running_slot(req)
        point = self.policy.point(req, p) if self.snapshots_enabled else None
        for b in sorted(states or (), reverse=True):
            if point is not None:
                break
            p, src, point = b, states[b], self.policy.point(req, b)
        if point is None:
            return []
        priority, rolling = point
        h = req.block_hashes[p // self.block_size - 1]
        if rolling:
            self._drop_rolling(req.request_id)
        slot = self.state_pool.put_snapshot(h, priority)
        info = self._info.get(h)
        if slot is None:
            if info is not None and not rolling and info.owner is not None:  # now a point of its own right
                self._rolling.pop(info.owner, None)
                info.owner = None
            return []
        self._info[h] = SnapshotInfo(req.block_hashes, p // self.block_size, self.block_pool.get_cached(h),
                                     req.cache_salt, req.request_id if rolling else None)
        if rolling:
            self._rolling[req.request_id] = h
        self._unwritten.add(slot)
        self.num_snapshots_taken += 1
        return [(src, slot)]

    def copies_applied(self) -> None:
        """The runner applied the copies `commit` returned: those slots now hold their snapshots."""
        self._unwritten.clear()

    def _drop_rolling(self, request_id: str) -> None:
        """Drops the request's previous rolling turn end (superseded by a later one on the same chain)."""
        h = self._rolling.pop(request_id, None)
        if h is not None:
            self.state_pool.drop_snapshot(h)
            del self._info[h]

    # -- snapshots leaving, and exports ------------------------------------------------------------------------

    def _snapshot_evicted(self, block_hash: bytes, slot: int) -> None:
        """A snapshot evicted for a slot (state pool callback): exported when its contents are in its slot."""
        info = self._forget(block_hash)
        if info is not None and slot not in self._unwritten:
            self._record_export("evicted", block_hash, slot, info)

    def _block_evicted(self, block_hash: bytes) -> None:
        """A cached block left the block pool (block pool callback): the snapshot it ends goes with it."""
        slot = self.state_pool.get_snapshot(block_hash)
        if slot is None:
            return
        info = self._forget(block_hash)
        if info is not None:
            self._record_export("evicted", block_hash, slot, info)
        self.state_pool.drop_snapshot(block_hash)

    def _forget(self, block_hash: bytes) -> SnapshotInfo | None:
        info = self._info.pop(block_hash, None)
        if info is not None and info.owner is not None:
            self._rolling.pop(info.owner, None)
        return info

    def _record_export(self, reason: str, block_hash: bytes, slot: int, info: SnapshotInfo) -> None:
        if not self.exporting or self._forgetting:
            return
        blocks = []
        for i, h in enumerate(info.hashes[: info.num_blocks]):
            block = self.block_pool.get_cached(h)
            if block is None and i == info.num_blocks - 1:
                block = info.last_block  # being evicted now: its contents are still there
            if h not in self._sent and block is not None:
                blocks.append((h, block))
        self.note_sent(h for h, _ in blocks)
        self._pending.append(PendingExport(reason, block_hash, slot, tuple(blocks), info.cache_salt,
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
            self._record_export("turn_end", h, self.state_pool.get_snapshot(h), info)

    def note_sent(self, hashes: Iterable[bytes]) -> None:
        """Remembers blocks the cache service holds (imported from it, or exported), so exports skip them."""
        for h in hashes:
            self._sent[h] = None
            self._sent.move_to_end(h)
        while len(self._sent) > self._sent_memory:
            self._sent.popitem(last=False)

    def take_exports(self) -> list[PendingExport]:
        pending, self._pending = self._pending, []
        return pending

    # -- imports (transfer) ----------------------------------------------------------------------------------

    def reserve_blocks(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Blocks to receive imported cached blocks (hashes not cached yet, as many as are free), owned by the
        caller until `release_blocks`; each is registered under its hash."""
        todo = [h for h in dict.fromkeys(hashes) if self.block_pool.get_cached(h) is None]
        todo = todo[: self.block_pool.num_free_blocks]
        blocks = self.block_pool.allocate(len(todo))
        for h, b in zip(todo, blocks):
            self.block_pool.cache(b, h)
        return list(zip(todo, blocks))

    def release_blocks(self, blocks: Iterable[int]) -> None:
        self.block_pool.free(list(blocks)[::-1])

    def reserve_snapshot(self, block_hash: bytes) -> int | None:
        """A snapshot slot for an imported snapshot (the top priority: a request is about to resume from it; never
        exported again, it came from the cache service); None when its last block is not cached or it exists."""
        if not self.snapshots_enabled or self.block_pool.get_cached(block_hash) is None:
            return None
        return self.state_pool.put_snapshot(block_hash, SnapshotPriority.HINT)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block of a free block and its snapshots (nothing is exported)."""
        self._forgetting = True
        try:
            self.block_pool.evict_all()
        finally:
            self._forgetting = False

    # -- checks ----------------------------------------------------------------------------------------------

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError when pools, snapshots and the given (all holding) requests disagree."""
        reqs = list(requests)
        self.block_pool.check_integrity(owners=[r.block_ids for r in reqs])
        self.state_pool.check_integrity([r.state_group for r in reqs if r.state_group is not None])
        for h in self.state_pool.snapshot_order():
            assert self.block_pool.get_cached(h) is not None, "a snapshot outlived its last block"
        assert set(self._info) <= set(self.state_pool.snapshot_order()), "a snapshot's record outlived it"
        for rid, h in self._rolling.items():
            assert h in self._info and self._info[h].owner == rid, f"{rid}: its rolling turn end is not recorded"
        for r in reqs:
            assert len(r.block_ids) >= self.blocks_for(r.num_computed_tokens), \
                f"{r.request_id}: {len(r.block_ids)} blocks for {r.num_computed_tokens} computed tokens"
            assert r.state_group is not None, f"{r.request_id} holds blocks but no running slot"
            for i, block in enumerate(r.block_ids):
                h = self.block_pool.block_hash[block]
                assert h is None or (i < len(r.block_hashes) and h == r.block_hashes[i]), \
                    f"{r.request_id}: block {block} at position {i} is cached under another prefix's hash"
