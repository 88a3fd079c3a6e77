"""The hybrid cache manager: a coordinator over the block manager (MLA KV blocks, engine/memory/block_manager.py)
and the state manager (KDA slots, snapshots and their exports, engine/memory/state_manager.py), and the one place
where decisions that need both are made.

Contract:
- A request holds `block_ids` covering at least its `num_computed_tokens` (plus the tokens of the step being
  scheduled) and one running slot group (`state_group`) while it runs; `free(req)` returns both.
- Prefix hit rule (`resumable_blocks`, engine/memory/hit_rule.py, the one rule: admission, the decode worker's probe
  and the prefill worker's choice between its own cache and the cache service's all use it): a request resumes at
  the longest prefix `p` such that every block up to `p` is cached, a KDA snapshot keyed by the hash of block
  `p/block_size - 1` exists, and `p < len(token_ids)` (at least one token is computed, to produce logits). Without
  KDA layers any cached block boundary qualifies. `resumable_prefix(hashes, n)` applies it to this cache,
  `presence(hashes)` says which blocks and snapshots it holds; neither changes anything.
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
  Every operation that can queue one (`allocate`, `commit`, `reserve_blocks`, `reserve_snapshot`,
  `record_turn_end`) ends by handing them to the export reader (`set_export_reader`, the exchange), so they are read
  before anything can write their blocks or slots; without a reader they wait for `take_exports()`. A victim whose
  slot still awaits its copy is not exported.
- Imports: `reserve_blocks(hashes)` / `release_blocks(ids)` and `reserve_snapshot(hash)` give imported objects room.
  An imported request (`Request.imported`) resumes at its state's tokens; a lean state's full blocks must be cached
  here by then (`lookup` hits them), else it is looked up like any request and its state dropped at admission.
- Events: `events` (engine/memory/events.py) records the blocks and snapshots stored and removed once
  `start_events()` turned it on; that call also returns the `CacheListing` they start from.
- Counters: `lookup_tokens` (prompt tokens of admitted requests), `hit_tokens` (of those, served from the cache),
  `num_junctions`, `num_exports`, `num_snapshots_taken` (state copies into snapshot slots after steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.config import CachePlan
from engine.memory.block_manager import BlockManager
from engine.memory.block_pool import KVBlockPool
from engine.memory.events import CacheEventSink
from engine.memory.hit_rule import resumable_blocks
from engine.memory.policy import Junction, SnapshotPolicy, plan_junction
from engine.memory.state_manager import ExportReader, PendingExport, StateManager
from engine.memory.state_pool import SnapshotPriority, StatePool
from engine.request import Request
from engine.transfer import RequestState

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


class CacheManager:
    def __init__(self, plan: CachePlan, has_kda: bool):
        self.plan = plan
        self.block_size = plan.block_size
        self.has_kda = has_kda
        self.caching = plan.snapshot_interval > 0
        self.policy = SnapshotPolicy(plan.block_size, plan.snapshot_interval, plan.snapshot_policy)
        self.events = CacheEventSink()  # off until `start_events`
        self.states = StateManager(plan.num_running_slots // plan.slots_per_request, plan.slots_per_request,
                                   plan.num_snapshot_slots, plan.block_size, lambda h: self.blocks.get_cached(h),
                                   self.events, sent_memory=4 * plan.num_blocks)
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, self.caching, self.events,
                                   on_evict=self.states.block_evicted)
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.num_junctions = 0

    # -- the parts and their counters ------------------------------------------------------------------------

    @property
    def block_pool(self) -> KVBlockPool:
        return self.blocks.pool

    @property
    def state_pool(self) -> StatePool:
        return self.states.pool

    @property
    def num_exports(self) -> int:
        return self.states.num_exports

    @property
    def num_snapshots_taken(self) -> int:
        return self.states.num_snapshots_taken

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks.blocks_for(num_tokens)

    @property
    def snapshots_enabled(self) -> bool:
        return self.caching and self.has_kda and self.state_pool.num_snapshot_slots > 0

    # -- prefix cache ----------------------------------------------------------------------------------------

    def lookup(self, req: Request) -> PrefixHit:
        """The longest resumable cached prefix of `req.token_ids` (no side effects); an imported request's own."""
        if req.imported is not None:
            blocks = self._imported_blocks(req)
            if blocks is not None:
                return PrefixHit(req.imported.num_computed_tokens, blocks, imported=True)
        if req.params.prompt_logprobs is not None:  # the cached part would have no logits: compute everything
            return PrefixHit()
        hashes = req.block_hashes[: self.resumable_prefix(req.block_hashes, req.num_tokens)]
        return PrefixHit(len(hashes) * self.block_size, [self.blocks.get_cached(h) for h in hashes],
                         hashes[-1] if self.has_kda and hashes else None,
                         cached_blocks=self.blocks.cached_prefix(req.block_hashes))

    def _imported_blocks(self, req: Request) -> list[int] | None:
        """The cached blocks an imported request starts with: none for a whole state; a lean one (its KV after the
        last full block only) takes its full blocks from this cache, where its importer put them -> None when one
        has left (evicted): the request is then looked up and computed like any other, from its tokens."""
        state = req.imported
        full = self.blocks_for(state.num_computed_tokens) - state.kv.shape[1]
        blocks = [self.blocks.get_cached(h) for h in req.block_hashes[:full]]
        return None if None in blocks else blocks

    def resumable_prefix(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Blocks of the longest prefix this cache serves to `num_tokens` tokens whose full blocks hash to
        `hashes` (the prefix hit rule; 0 with prefix caching off)."""
        if not self.caching:
            return 0
        return resumable_blocks(num_tokens, self.block_size, (self.blocks.get_cached(h) is not None for h in hashes),
                                (self.states.has_snapshot(h) for h in hashes) if self.has_kda else None)

    def presence(self, hashes: Sequence[bytes]) -> PrefixPresence:
        return PrefixPresence([self.blocks.get_cached(h) is not None for h in hashes],
                              [self.states.has_snapshot(h) for h in hashes])

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
            if i >= len(req.block_hashes) or not self.states.has_snapshot(req.block_hashes[i]):
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
        return self.state_pool.num_free_groups > 0 and \
            self.blocks.can_admit(hit.block_ids, hit.num_tokens + num_new_tokens)

    def admission_shortfall(self, hit: PrefixHit, num_new_tokens: int) -> tuple[int, int]:
        """-> (running slot groups, KV blocks) that must be freed before `can_admit(hit, num_new_tokens)` holds."""
        return (0 if self.state_pool.num_free_groups > 0 else 1,
                self.blocks.shortfall(hit.block_ids, hit.num_tokens + num_new_tokens))

    def admit(self, req: Request, hit: PrefixHit) -> StateInit:
        """Gives `req` the hit's blocks and a running slot group; sets `num_computed_tokens` to the hit length."""
        self.blocks.admit(req, hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        slot = self.states.assign(req)
        if hit.imported:
            return StateInit(dst=slot)  # the scheduler attaches the data once the blocks are allocated
        self.lookup_tokens += req.num_tokens
        self.hit_tokens += hit.num_tokens
        if hit.snapshot_hash is None:
            return StateInit(dst=slot)
        return StateInit(dst=slot, src=self.states.get_snapshot(hit.snapshot_hash))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Adds blocks so `req` covers `num_computed_tokens + num_new_tokens`; False (nothing changed) if short.
        Blocks it takes may end snapshots, which leave with them (exported before it returns)."""
        allocated = self.blocks.allocate(req, num_new_tokens)
        self.states.drain_exports()
        return allocated

    def free(self, req: Request) -> None:
        """Returns the request's blocks (tail first) and its running slot group; its rolling turn-end snapshot
        stays, as an ordinary turn-end snapshot."""
        self.blocks.free(req)
        self.states.release(req)

    def running_slot(self, req: Request) -> int:
        """The slot of the request's group that holds its running state (`req.slot_offset`)."""
        return self.states.running_slot(req)

    # -- speculative verification ----------------------------------------------------------------------------

    def verify_slots(self, req: Request, num_tokens: int) -> tuple[int, ...]:
        """Out-slots of a verification of `num_tokens` positions (`StateManager.verify_slots`)."""
        return self.states.verify_slots(req, num_tokens)

    def settle_verification(self, req: Request, start: int, kept: int) -> dict[int, int]:
        """After a verification from `start` whose first `kept` positions are committed: the running slot becomes
        the out-slot of the last kept position (an index change, no copy), the blocks past the committed tokens
        go back to the pool (rejected positions' KV is dropped; they were never in the prefix cache) ->
        {computed tokens p: slot holding the state after p} for the kept positions (for `commit`). Called with
        `req.num_computed_tokens` already `start + kept` (`EngineCore.update_from_output` sets it, the one place)."""
        if req.num_computed_tokens != start + kept:
            raise AssertionError(f"settle_verification: {req.request_id} has {req.num_computed_tokens} computed "
                                 f"tokens, expected {start + kept} (update_from_output sets them first)")
        slots = self.states.settle(req, kept)
        self.blocks.truncate(req)
        return {start + 1 + i: slot for i, slot in enumerate(slots)}

    # -- after a step ----------------------------------------------------------------------------------------

    def commit(self, req: Request, states: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """Registers newly computed full blocks; returns the snapshot copies (running slot -> snapshot slot).
        `states` (a verification, `settle_verification`): slots holding the state after earlier token counts of
        this step, so a rolling turn end crossed inside the verified positions is snapshotted from its slot."""
        if not self.caching:
            return []
        self.blocks.commit(req)
        p, src = req.num_computed_tokens, self.running_slot(req)
        point = self.policy.point(req, p) if self.snapshots_enabled else None
        for b in sorted(states or (), reverse=True):
            if point is not None:
                break
            p, src, point = b, states[b], self.policy.point(req, b)
        if point is None:
            return []
        priority, rolling = point
        return self.states.take_snapshot(req, p, src, priority, rolling)

    def copies_applied(self) -> None:
        """The runner applied the copies `commit` returned: those slots now hold their snapshots."""
        self.states.copies_applied()

    # -- exports ---------------------------------------------------------------------------------------------

    @property
    def exporting(self) -> bool:
        return self.states.exporting

    @exporting.setter
    def exporting(self, on: bool) -> None:
        self.states.exporting = on

    def set_export_reader(self, reader: ExportReader | None) -> None:
        self.states.set_export_reader(reader)

    def take_exports(self) -> list[PendingExport]:
        return self.states.take_exports()

    def record_turn_end(self, req: Request) -> None:
        self.states.record_turn_end(req)

    def note_sent(self, hashes: Iterable[bytes]) -> None:
        self.states.note_sent(hashes)

    # -- imports (transfer) ----------------------------------------------------------------------------------

    def reserve_blocks(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Blocks to receive imported cached blocks (hashes not cached yet, as many as are free), owned by the
        caller until `release_blocks`; each is registered under its hash (evicted snapshots exported first)."""
        reserved = self.blocks.reserve(hashes)
        self.states.drain_exports()
        return reserved

    def release_blocks(self, blocks: Iterable[int]) -> None:
        self.blocks.release(blocks)

    def reserve_snapshot(self, block_hash: bytes) -> int | None:
        """A snapshot slot for an imported snapshot (the top priority: a request is about to resume from it; never
        exported again, it came from the cache service); None when its last block is not cached or it exists."""
        if not self.snapshots_enabled or self.blocks.get_cached(block_hash) is None:
            return None
        return self.states.reserve_snapshot(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block of a free block and its snapshots (nothing is exported)."""
        with self.states.not_exporting():
            self.blocks.evict_all()

    # -- checks ----------------------------------------------------------------------------------------------

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError when pools, snapshots and the given (all holding) requests disagree."""
        reqs = list(requests)
        self.blocks.check_integrity(reqs)
        self.states.check_integrity(reqs)
