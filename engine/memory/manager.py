"""The hybrid cache manager: MLA blocks and KDA slots per request, plus the prefix cache over both.

Contract:
- A request holds `block_ids` covering at least its `num_computed_tokens` (plus the tokens of the step being
  scheduled) and one running slot group (`state_group`) while it runs; `free(req)` returns both.
- Prefix hit rule (`resumable_blocks`, the one rule: admission, the decode worker's probe and the prefill worker's
  choice between its own cache and the cache service's all use it): a request resumes at the longest prefix `p`
  such that every block up to `p` is cached, a KDA snapshot keyed by the hash of block `p/block_size - 1` exists,
  and `p < len(token_ids)` (at least one token is computed, to produce logits). Without KDA layers any cached block
  boundary qualifies. `resumable_prefix(hashes, n)` applies it to this cache, `presence(hashes)` says which blocks
  and snapshots it holds; neither changes anything.
- Snapshot boundaries of a request: every multiple of `snapshot_interval`, and the prompt-end boundaries
  `floor(P/bs)*bs` and `floor((P-1)/bs)*bs` (the last full block of the prompt, and the last one that leaves a token
  to compute, so an identical prompt shorter than the interval still hits). The scheduler ends prefill chunks at the
  next boundary (`next_chunk_end`) so that after the step `commit` can copy the running slot into a snapshot slot.
- `commit(req)` after a step registers the newly full blocks under their hashes and returns the `(src, dst)` slot
  copies the runner must apply before the next step. `admit` returns the `StateInit` for the request's running slot
  (zero it, or copy a snapshot into it) that the runner must apply before the request's first step.
- Counters: `lookup_tokens` (prompt tokens of admitted requests), `hit_tokens` (of those, served from the cache).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.config import CachePlan
from engine.memory.block_pool import KVBlockPool
from engine.memory.state_pool import StatePool
from engine.request import Request
from engine.transfer import RequestState


def resumable_blocks(num_tokens: int, block_size: int, blocks: Iterable[bool], snapshots: Iterable[bool] | None) -> int:
    """The prefix hit rule, in blocks: all of `blocks` (presence of the full blocks, in order) up to the prefix
    present, a snapshot at its last block (when `snapshots` is given: the model has KDA layers), and at least one
    of `num_tokens` tokens left to compute. The iterables are read in step, up to the first absent block."""
    best = 0
    for i, (present, snapshot) in enumerate(zip(blocks, itertools.repeat(True) if snapshots is None else snapshots)):
        if not present or (i + 1) * block_size >= num_tokens:
            break
        if snapshot:
            best = i + 1
    return best


@dataclass(frozen=True)
class PrefixPresence:
    """Which of a prompt's full blocks (by hash, in order) a prefix cache holds, and which have a KDA snapshot."""

    blocks: list[bool]
    snapshots: list[bool]


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    snapshot_hash: bytes | None = None
    imported: bool = False  # the tokens come with the request (`Request.imported`), not from the cache


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
        self.state_pool = StatePool(plan.num_running_slots // plan.slots_per_request, plan.slots_per_request,
                                    plan.num_snapshot_slots)
        self.block_pool = KVBlockPool(plan.num_blocks, on_evict=self.state_pool.drop_snapshot)
        self._committed: dict[str, int] = {}  # request id -> blocks registered in the cache so far
        self.lookup_tokens = 0
        self.hit_tokens = 0

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
        return PrefixHit(len(hashes) * self.block_size, [self.block_pool.get_cached(h) for h in hashes],
                         hashes[-1] if self.has_kda and hashes else None)

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

    def snapshot_boundaries(self, req: Request) -> set[int]:
        p, bs = req.num_prompt_tokens, self.block_size
        return {b for b in (p // bs * bs, (p - 1) // bs * bs) if b > 0}

    def is_snapshot_boundary(self, req: Request, position: int) -> bool:
        if not self.snapshots_enabled or position <= 0 or position % self.block_size:
            return False
        return position % self.plan.snapshot_interval == 0 or position in self.snapshot_boundaries(req)

    def next_chunk_end(self, req: Request, computed: int) -> int:
        """Where the chunk starting at `computed` must end: the next boundary still lacking a snapshot, else all."""
        end = req.num_tokens
        if not self.snapshots_enabled:
            return end
        interval = self.plan.snapshot_interval
        candidates = {b for b in self.snapshot_boundaries(req) if computed < b < end}
        candidates.update(range((computed // interval + 1) * interval, end, interval))
        for b in sorted(candidates):
            if not self.state_pool.has_snapshot(req.block_hashes[b // self.block_size - 1]):
                return b
        return end

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
        """Returns the request's blocks (tail first) and its running slot group."""
        self.block_pool.free(reversed(req.block_ids))
        req.block_ids = []
        if req.state_group is not None:
            self.state_pool.free_group(req.state_group)
            req.state_group = None
        self._committed.pop(req.request_id, None)

    def running_slot(self, req: Request) -> int:
        return self.state_pool.running_slot(req.state_group)

    # -- after a step ----------------------------------------------------------------------------------------

    def commit(self, req: Request) -> list[tuple[int, int]]:
        """Registers newly computed full blocks; returns the snapshot copies (running slot -> snapshot slot)."""
        if not self.caching:
            return []
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(self._committed.get(req.request_id, 0), full):
            self.block_pool.cache(req.block_ids[i], req.block_hashes[i])
        self._committed[req.request_id] = full
        p = req.num_computed_tokens
        if not self.is_snapshot_boundary(req, p):
            return []
        slot = self.state_pool.put_snapshot(req.block_hashes[p // self.block_size - 1])
        return [] if slot is None else [(self.running_slot(req), slot)]

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
        """A snapshot slot for an imported snapshot; None when its last block is not cached or it exists."""
        if not self.snapshots_enabled or self.block_pool.get_cached(block_hash) is None:
            return None
        return self.state_pool.put_snapshot(block_hash)

    def reset_prefix_cache(self) -> None:
        self.block_pool.evict_all()

    # -- checks ----------------------------------------------------------------------------------------------

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError when pools, snapshots and the given (all holding) requests disagree."""
        reqs = list(requests)
        self.block_pool.check_integrity(owners=[r.block_ids for r in reqs])
        self.state_pool.check_integrity([r.state_group for r in reqs if r.state_group is not None])
        for h in self.state_pool.snapshot_order():
            assert self.block_pool.get_cached(h) is not None, "a snapshot outlived its last block"
        for r in reqs:
            assert len(r.block_ids) >= self.blocks_for(r.num_computed_tokens), \
                f"{r.request_id}: {len(r.block_ids)} blocks for {r.num_computed_tokens} computed tokens"
            assert r.state_group is not None, f"{r.request_id} holds blocks but no running slot"
            for i, block in enumerate(r.block_ids):
                h = self.block_pool.block_hash[block]
                assert h is None or (i < len(r.block_hashes) and h == r.block_hashes[i]), \
                    f"{r.request_id}: block {block} at position {i} is cached under another prefix's hash"
