"""The MLA KV block pool: reference counts, content hashes of cached blocks, and an LRU free queue.

Contract (vLLM v1's block pool, with one change noted):
- Blocks are ids `0 … num_blocks-1`. A block is *owned* while `ref_cnt > 0` (one count per request whose block
  table holds it) and *free* otherwise; every free block sits in the free queue exactly once.
- A free block may still be *cached*: it keeps its content hash and can be revived by a prefix hit (`touch`)
  until `allocate` takes it from the head of the free queue, which evicts its hash (and calls `on_evict(hash)`).
- `free(ids)` drops one reference per id; a block reaching zero goes to the tail of the queue when cached (callers
  pass a request's blocks in reverse order, so its tail blocks are evicted before its head blocks), and to the head
  when it holds no hash (an uncached block is reused before any cached one is evicted — the change from vLLM).
- The queue starts as `0, 1, …, num_blocks-1`, so allocation order is deterministic; tests pin exact ids.
- `cache(block, hash)` registers a full, written block; a hash already registered keeps its first block.
- `events` (engine/memory/events.py) records every hash registered and evicted, when turned on.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from engine.memory.events import CacheEventKind, CacheEventSink


class NoFreeBlocksError(RuntimeError):
    """`allocate` was asked for more blocks than are free (callers check `num_free_blocks` first)."""


class KVBlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None,
                 events: CacheEventSink | None = None):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # head first
        self._cached: dict[bytes, int] = {}
        self._on_evict = on_evict
        self.events = events if events is not None else CacheEventSink()
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_queue(self) -> list[int]:
        """Free block ids, next to be allocated first."""
        return list(self._free)

    def get_cached(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """Takes `n` blocks from the head of the free queue (evicting their hashes); each gets ref_cnt 1."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            ids.append(block)
        return ids

    def touch(self, ids: Iterable[int]) -> None:
        """Adds a reference to each block (a prefix hit); a free one leaves the free queue."""
        for block in ids:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drops one reference per id, in the order given (pass a request's blocks reversed)."""
        for block in ids:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than referenced")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Registers an owned, fully written block under its hash; False when the hash is already cached."""
        if block_hash in self._cached or self.block_hash[block] is not None:
            return False
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block
        self.events.record(CacheEventKind.BLOCK_STORED, block_hash)
        return True

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached)

    def evict_all(self) -> int:
        """Forgets every cached hash of a free block (resetting the prefix cache); returns how many."""
        victims = [b for b in self._free if self.block_hash[b] is not None]
        for block in victims:
            self._evict(block)
        return len(victims)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is None:
            return
        self.block_hash[block] = None
        del self._cached[h]
        self.num_evictions += 1
        self.events.record(CacheEventKind.BLOCK_REMOVED, h)
        if self._on_evict is not None:
            self._on_evict(h)

    def check_integrity(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Raises AssertionError on inconsistency; `owners` (one block list per request) must explain ref counts."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        for block in range(self.num_blocks):
            in_queue = block in self._free
            assert self.ref_cnt[block] >= 0, f"block {block} has ref_cnt {self.ref_cnt[block]}"
            assert in_queue == (self.ref_cnt[block] == 0), \
                f"block {block}: ref_cnt {self.ref_cnt[block]} but in free queue: {in_queue}"
        for h, block in self._cached.items():
            assert self.block_hash[block] == h, f"cached hash of block {block} does not match the index"
        assert sum(h is not None for h in self.block_hash) == len(self._cached), "a hashed block is not indexed"
        if owners is not None:
            counts = Counter(b for table in owners for b in table)
            for block in range(self.num_blocks):
                assert counts.get(block, 0) == self.ref_cnt[block], \
                    f"block {block}: ref_cnt {self.ref_cnt[block]} but {counts.get(block, 0)} owners"
