"""MLA KV blocks per request and the prefix cache of blocks: the block half of the cache manager.

Contract:
- A request holds `block_ids` covering at least its `num_computed_tokens` (plus the tokens of the step being
  scheduled) while it runs. `admit(req, hit_blocks)` gives it a prefix hit's cached blocks (one reference each),
  `allocate(req, n)` grows it to cover `num_computed_tokens + n` (False and nothing changed when too few blocks are
  free), `truncate(req)` returns the blocks past `num_computed_tokens` (a verification's rejected positions, never
  registered), `free(req)` returns all of them, tail first (so its tail is evicted before its head).
- `commit(req)` registers the request's newly full, computed blocks under their hashes (`req.block_hashes`), each
  once: the blocks a request holds from its hit count as registered.
- Lookups change nothing: `get_cached(hash)` -> the block holding it or None; `cached_prefix(hashes)` -> how many
  leading hashes are cached (0 with prefix caching off).
- Reservations for imports: `reserve(hashes)` takes a free block for each hash not cached yet (as many as are free)
  and registers it; the caller writes them, then `release`s them (free and cached).
- Allocation and reservation evict the hashes of free cached blocks, head of the free queue first (the rules are
  engine/memory/block_pool.py's); `on_evict(hash)` (the state manager's `block_evicted`) hears of each one while
  the block still holds its contents. `evict_all()` forgets every free block's hash (a prefix cache reset).
- Block ids are exact and deterministic; nothing here touches device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.memory.block_pool import KVBlockPool
from engine.memory.events import CacheEventSink
from engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool, events: CacheEventSink,
                 on_evict: Callable[[bytes], None] | None = None):
        self.block_size = block_size
        self.caching = caching
        self.pool = KVBlockPool(num_blocks, on_evict=on_evict, events=events)
        self._committed: dict[str, int] = {}  # request id -> leading blocks registered in the cache so far

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the prefix cache of blocks --------------------------------------------------------------------------

    def get_cached(self, block_hash: bytes) -> int | None:
        return self.pool.get_cached(block_hash)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading `hashes` cached here (0 with prefix caching off)."""
        if not self.caching:
            return 0
        return next((i for i, h in enumerate(hashes) if self.pool.get_cached(h) is None), len(hashes))

    def commit(self, req: Request) -> None:
        """Registers the request's full, computed blocks not registered yet."""
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(self._committed.get(req.request_id, 0), full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        self._committed[req.request_id] = full

    # -- blocks per request ----------------------------------------------------------------------------------

    def can_admit(self, hit_blocks: Sequence[int], num_tokens: int) -> bool:
        """Whether `admit(req, hit_blocks)` + growth to `num_tokens` tokens would succeed now (a hit's free blocks
        leave the free queue when revived)."""
        return self.shortfall(hit_blocks, num_tokens) == 0

    def shortfall(self, hit_blocks: Sequence[int], num_tokens: int) -> int:
        """How many more free blocks `can_admit(hit_blocks, num_tokens)` needs (0: it fits now)."""
        need = self.blocks_for(num_tokens) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.pool.ref_cnt[b] == 0)
        return max(0, need - (self.pool.num_free_blocks - revived))

    def admit(self, req: Request, hit_blocks: Sequence[int]) -> None:
        """Gives `req` (holding no blocks) the hit's cached blocks; they count as registered."""
        assert not req.block_ids, f"{req.request_id} already holds blocks"
        self.pool.touch(hit_blocks)
        req.block_ids = list(hit_blocks)
        self._committed[req.request_id] = len(hit_blocks)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Adds blocks so `req` covers `num_computed_tokens + num_new_tokens`; False (nothing changed) if short."""
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def truncate(self, req: Request) -> None:
        """Returns the blocks past the request's computed tokens (tail first)."""
        keep = self.blocks_for(req.num_computed_tokens)
        tail, req.block_ids = req.block_ids[keep:], req.block_ids[:keep]
        self.pool.free(reversed(tail))

    def free(self, req: Request) -> None:
        """Returns all the request's blocks, tail first."""
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        self._committed.pop(req.request_id, None)

    # -- reservations for imports ----------------------------------------------------------------------------

    def reserve(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Blocks to receive imported blocks: one per hash not cached yet, as many as are free, each registered
        under its hash and owned by the caller until `release`."""
        todo = [h for h in dict.fromkeys(hashes) if self.pool.get_cached(h) is None]
        todo = todo[: self.pool.num_free_blocks]
        blocks = self.pool.allocate(len(todo))
        for h, b in zip(todo, blocks):
            self.pool.cache(b, h)
        return list(zip(todo, blocks))

    def release(self, blocks: Iterable[int]) -> None:
        self.pool.free(list(blocks)[::-1])

    def evict_all(self) -> None:
        self.pool.evict_all()

    # -- checks ----------------------------------------------------------------------------------------------

    def check_integrity(self, reqs: Sequence[Request]) -> None:
        """Raises AssertionError when the pool and the (all holding) requests' block tables disagree."""
        self.pool.check_integrity(owners=[r.block_ids for r in reqs])
        for r in reqs:
            assert len(r.block_ids) >= self.blocks_for(r.num_computed_tokens), \
                f"{r.request_id}: {len(r.block_ids)} blocks for {r.num_computed_tokens} computed tokens"
            for i, block in enumerate(r.block_ids):
                h = self.pool.block_hash[block]
                assert h is None or (i < len(r.block_hashes) and h == r.block_hashes[i]), \
                    f"{r.request_id}: block {block} at position {i} is cached under another prefix's hash"
