"""The scheduler: one rule for prefill, decode and chunked prefill alike.

Contract:
- Every request's `num_computed_tokens` catches up with `len(token_ids)`. A step is a token budget
  (`max_num_batched_tokens`) split across requests: running requests first — decodes (one token left) before
  prefill chunks, each in admission order — then waiting requests in `admission_order()` (lower priority value
  first; within a priority, the tenant — `Request.tenant` — of the least usage of the running slots and KV pool
  first (engine/fair_share.py: dominant share over weight, counting the requests ahead of it in the order); at
  equal usage tenants take turns, so one tenant's queued work delays another tenant's next request by at most one
  admission per other tenant; FCFS within a tenant), while fewer than `max_num_seqs` run. A waiting request that
  does not fit blocks those behind it (no overtaking), except one that waits for a junction: a running request is
  about to compute the next blocks of its prompt (`CacheManager.junction`), so it is given a snapshot point where
  the two prompts part — its chunk in this step is cut there if it would cross it — and the waiting request is
  passed over until that snapshot exists (or the producer leaves), then resumes from it.
- Fair share: a waiting request that does not fit (no running slot free, or the pools cannot take it) makes room
  by preempting the running requests `FairShare.fair_victim` names one after another — another tenant's, over the
  waiting tenant's usage after admission (strictly: the hysteresis that keeps a move from being undone) — when
  their slots and blocks make it fit (planned first: nothing is preempted for a request that still would not fit),
  and is admitted in the same step; otherwise it blocks as above. A tenant alone is never preempted for
  fairness, so a lone tenant still fills every slot.
- Fair moves run in steps of their own: the requests of a fair move — the one admitted by fair preemption and its
  victims — are *moved*. A step in which a running moved request has prompt tokens left (a victim's: its
  recompute), or the first waiting request in `admission_order()` is a fair move (only fair preemption can admit
  it, or it is a moved request that fits again), is a *solo step*: only the moved requests' prefill chunks and the
  admissions run, the other running requests' decodes and chunks wait. Solo steps in a row compute at most
  `max_num_batched_tokens` tokens together; then a normal step runs, after which the running moved requests are
  ordinary ones (a longer prompt's rest is chunked with the decodes as usual). So the others wait at most one full
  step's budget of prefill per move. Why: on the CPU path a step that mixes a short prefill with N decodes costs
  about four N-row decode steps (every row takes the prefill kernels), a short prefill alone less than one, so the
  newcomer's first token comes one cheap step after it arrives, and the other rows lose less than the mixed step
  would cost them (docs/benchmarks.md, "Fair share of the running slots").
- A chunk never crosses the request's next pending snapshot point (`CacheManager.next_chunk_end`), so the state
  after it can be snapshotted; a chunk that reaches the end of the known tokens needs logits.
- When a running request needs a block and none is free, a running request is preempted in the victim order of
  engine/fair_share.py (lowest priority, then the tenant of the largest usage, then the latest arrival; with one
  tenant: the lowest-priority, latest-arriving one).
- Preemption is by recompute, whatever the cause: the victim's blocks and slot are freed (its full blocks stay in
  the prefix cache, its rolling turn-end snapshot stays, so its recompute resumes from there when they are still
  cached), `num_computed_tokens` resets to 0 (its outputs are kept; greedy and seeded sampling continue exactly,
  engine/sampling.py's noise being keyed by the output position) and it goes back to the waiting queue at its
  `(priority, arrival)` position. A step whose running requests preempted under pool pressure admits no waiting
  request.
- Speculative decoding: a running request with one token left and a `draft` (set by engine/spec/ before the step)
  is a verification: its drafts are tokens whose `num_computed_tokens` catches up too, so the chunk is the last
  token plus as many drafts as the budget and the next pending snapshot point leave room for (the rest of the
  draft is dropped; with none left it is a plain decode). The chunk carries the drafts and the out-slots of the
  KDA state after each position (`CacheManager.verify_slots`); blocks are allocated for every position. A
  preempted verification loses its draft (the engine rolls the drafter back).
- `schedule()` changes pool holdings (admission, growth, preemption) but not `num_computed_tokens` of scheduled
  chunks; the engine applies the step's results (`EngineCore.step`). `abort` and `finish` release everything.
- An imported request is admitted with its carried state (written by the runner before its first step); a lean
  import whose full blocks left the prefix cache drops its state and computes from its tokens
  (`num_import_recomputes`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from engine.fair_share import FairShare, TenantLoad, tenant_loads
from engine.memory.manager import CacheManager, PrefixHit, StateInit
from engine.request import Request, RequestStatus


class SchedulerInvariantError(RuntimeError):
    """The pools broke a promise the scheduler relies on (a bug, never a load condition)."""


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # num_computed_tokens before the step
    num_tokens: int
    draft: tuple[int, ...] = ()  # verification: the draft tokens after the known ones (the chunk's last positions)
    out_slots: tuple[int, ...] = ()  # verification: KDA slot receiving the state after each position

    @property
    def needs_logits(self) -> bool:
        return self.start + self.num_tokens - len(self.draft) == self.req.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    state_inits: list[StateInit] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    deferred: list[Request] = field(default_factory=list)  # waiting for a junction another request computes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, manager: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # admission order
        self._turns: dict[str | None, int] = {}  # tenant with work -> its next turn (admission_order)
        self.fair = FairShare(max_num_seqs, manager.block_pool.num_blocks)
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, to give a waiting tenant its share
        self.num_import_recomputes = 0  # lean imports whose full blocks were evicted before admission
        self._moved: dict[Request, None] = {}  # requests of fair moves, until their solo prefill is done (ordered)
        self._solo_tokens = 0  # tokens of the solo steps since the last normal step

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self._turns.setdefault(req.tenant, self._turn(req.tenant))  # a joining tenant starts level
        self.fair.note(req)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_left(keys, req.sort_key), req)

    # -- one step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self._solo_step(self.max_num_batched_tokens - self._solo_tokens)
        if out is not None:
            self._solo_tokens += out.num_tokens
            return out
        self._solo_tokens = 0
        self._moved = {r: None for r in self._moved if r.status is not RequestStatus.RUNNING}  # solo once only
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            budget -= self._schedule_running(req, budget, out)
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        start = req.num_computed_tokens
        known = req.num_tokens - start
        want = known + (len(req.draft.tokens) if req.draft is not None and known == 1 else 0)
        n = min(want, budget, self.manager.next_chunk_end(req, start, start + want) - start)
        while not self.manager.allocate(req, n):
            victim = self.fair.pressure_victim(self.running)
            self._preempt(victim, out)
            if victim is req:
                return 0
        draft = req.draft.tokens[: n - known] if n > known else ()
        out.chunks.append(ScheduledChunk(req, start, n, draft, self.manager.verify_slots(req, n) if draft else ()))
        return n

    # -- fair moves in steps of their own (see the contract) -------------------------------------------------

    def _solo_step(self, budget: int) -> SchedulerOutput | None:
        """The moved requests' prefill chunks and the admissions alone -> that step, or None: a normal step is due
        (no move pending, the solo budget spent, or nothing could be scheduled alone)."""
        self._moved = {r: None for r in self._moved if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                       or (r.status is RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens > 1)}
        prefilling = [r for r in self.running if r in self._moved] if self._moved else []
        if budget <= 0 or not (prefilling or self._move_due()):
            return None
        out = SchedulerOutput()
        for req in prefilling:
            if budget > 0 and req.status is RequestStatus.RUNNING:
                budget -= self._schedule_running(req, budget, out)
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out if out.chunks or out.preempted else None

    def _move_due(self) -> bool:
        """Whether the first waiting request in admission order is a fair move: a victim that fits again, or one
        that only fair preemption can admit."""
        if not self.waiting or not self.running:
            return False
        if not self._moved and not self.fair.could_move({r.tenant for r in self.waiting}, self.running):
            return False  # (the common case, decided without ordering the queue)
        head = self.admission_order()[0]
        hit = self.manager.lookup(head)
        if self._fits(hit, min(head.num_tokens - hit.num_tokens, self.max_num_batched_tokens)):
            return head in self._moved
        return self.fair.fair_victim(head, self.running, 0) is not None

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempts `victim` by recompute -> the tokens of its chunk in this step, taken back."""
        freed = 0
        for i, chunk in enumerate(out.chunks):
            if chunk.req is victim:  # scheduled earlier in this step: take it back
                freed = chunk.num_tokens
                del out.chunks[i]
                break
        self.running.remove(victim)
        self.manager.free(victim)
        victim.num_computed_tokens = 0
        victim.draft = None
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self._enqueue(victim)
        return freed

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        self._forget_idle_tenants()
        for req in self.admission_order():
            if budget <= 0 or (len(self.running) >= self.max_num_seqs
                               and self.fair.fair_victim(req, self.running, 0) is None):
                break  # no slot, and none to take: nothing is looked up (no junction planned) for it
            hit = self.manager.lookup(req)
            junction = self.manager.junction(req, hit, self.running)
            if junction is not None and junction.producer is not None:
                budget += self._cut(out, junction.producer, junction.position)
                out.deferred.append(req)
                continue
            start = hit.num_tokens
            n = min(req.num_tokens - start, budget, self.manager.next_chunk_end(req, start) - start)
            fits, freed = self._make_room(req, hit, n, out)
            budget += freed
            if not fits:
                break
            self.waiting.remove(req)
            self._admit(req, hit, n, out)
            self._turns[req.tenant] = self._turn(req.tenant) + 1
            budget -= n

    def _fits(self, hit: PrefixHit, n: int) -> bool:
        return len(self.running) < self.max_num_seqs and self.manager.can_admit(hit, n)

    def _make_room(self, req: Request, hit: PrefixHit, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Preempts the fair victims that let `req` (admitted with `hit` and an `n`-token chunk) fit, when they can
        -> (whether it fits, the tokens of this step's chunks taken back from the victims)."""
        victims = self._room_plan(req, hit, n)
        freed = 0
        for victim in victims or ():
            freed += self._preempt(victim, out)
            self.num_fair_preemptions += 1
            self._moved[req] = self._moved[victim] = None
        return victims is not None and self._fits(hit, n), freed

    def _room_plan(self, req: Request, hit: PrefixHit, n: int) -> list[Request] | None:
        """The `FairShare.fair_victim`s, in order, whose slots and blocks make room for `req`: [] when it fits now,
        None when fair share cannot make room (nothing is preempted then: no victim for a request that still would
        not fit)."""
        running = list(self.running)
        groups_short, blocks_short = self.manager.admission_shortfall(hit, n)
        blocks = self.manager.blocks_for(hit.num_tokens + n)
        victims: list[Request] = []
        while len(running) >= self.max_num_seqs or groups_short > 0 or blocks_short > 0:
            victim = self.fair.fair_victim(req, running, blocks)
            if victim is None:
                return None
            running.remove(victim)
            victims.append(victim)
            groups_short, blocks_short = groups_short - 1, blocks_short - len(victim.block_ids)
        return victims

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order they are admitted: by priority, then by the usage their tenant —
        `Request.tenant` — would have once they run (engine/fair_share.py; its k-th waiting request counts the k
        ahead of it), then by tenant turn (a tenant takes one turn per admission; its k-th waiting request comes at
        its turn + k), then FCFS. So the least served tenant goes first, tenants at equal usage alternate, and a
        tenant's queue delays another tenant's next request by at most one admission per other tenant; with one
        tenant this is `(priority, arrival)` order."""
        rank = self.fair.admission_rank(self.running)
        ahead: dict[str | None, int] = {}
        keyed = []
        for req in self.waiting:  # (priority, arrival) order
            k = ahead.get(req.tenant, 0)
            keyed.append(((req.priority, rank(req.tenant, k + 1), self._turn(req.tenant) + k, req.arrival), req))
            ahead[req.tenant] = k + 1
        return [req for _, req in sorted(keyed, key=lambda item: item[0])]

    def _turn(self, tenant: str | None) -> int:
        """A tenant's next turn; one that (re)joins (`add`) starts at the lowest turn of the tenants with work."""
        return self._turns.get(tenant, min(self._turns.values(), default=0))

    def _forget_idle_tenants(self) -> None:
        active = {r.tenant for r in self.waiting} | {r.tenant for r in self.running}
        self._turns = {t: n for t, n in self._turns.items() if t in active}
        self.fair.forget(active)

    def tenant_loads(self) -> tuple[TenantLoad, ...]:
        """Each tenant's running and waiting requests now (the per-tenant gauges)."""
        return tenant_loads(self.running, self.waiting, self.fair.weights)

    def _admit(self, req: Request, hit: PrefixHit, n: int, out: SchedulerOutput) -> None:
        init = self.manager.admit(req, hit)
        if not self.manager.allocate(req, n):  # can_admit said it would fit: the pools disagree with it
            raise SchedulerInvariantError(f"request {req.request_id}: admitted but {n} tokens do not fit")
        if hit.imported:  # write the carried KV and state; a later preemption recomputes from tokens
            num_blocks = self.manager.blocks_for(hit.num_tokens)  # a lean state's full blocks came from the cache
            init = replace(init, load=req.imported, load_blocks=tuple(req.block_ids[len(hit.block_ids):num_blocks]))
            req.imported = None
        elif req.imported is not None:  # a lean import whose full blocks left the cache: computed from its tokens
            req.imported = None
            self.num_import_recomputes += 1
        out.state_inits.append(init)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
        req.status = RequestStatus.RUNNING
        req.mark_scheduled()
        self.running.append(req)
        out.chunks.append(ScheduledChunk(req, hit.num_tokens, n))

    @staticmethod
    def _cut(out: SchedulerOutput, producer: Request, position: int) -> int:
        """Ends the producer's chunk of this step at `position` when it would cross it -> the tokens given back."""
        for chunk in out.chunks:
            if chunk.req is producer and chunk.start < position < chunk.start + chunk.num_tokens:
                freed = chunk.start + chunk.num_tokens - position
                chunk.num_tokens -= freed
                return freed
        return 0

    # -- leaving ---------------------------------------------------------------------------------------------

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Removes a request from the queues and frees what it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.manager.free(req)
        req.status = status

    def holding(self) -> list[Request]:
        """Requests that hold blocks or a slot (for integrity checks)."""
        return list(self.running)
