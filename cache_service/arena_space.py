"""The memory store's payload space inside a shared-memory arena: extents of an `ExtentAllocator` over the arena's
backed area, grown on demand, with copies in and out at extent offsets.

Contract:
- `allocate(size, evictable_bytes, evict_one)` answers an extent's offset for `size` bytes, or None. When no free
  extent fits it grows the arena's backed area (`SharedArena.grow`); when the arena cannot grow (all of it backed,
  or the tmpfs full: logged once), it calls `evict_one()` (the store drops its least recently used unpinned object
  and answers whether there was one) until an extent fits. It evicts nothing when `evictable_bytes()` plus the
  free and unbacked bytes could not hold `size` (contiguity aside).
- Offsets are extent offsets in the data area; `file_offset` turns one into the file offset clients map.
- Not thread-safe: the store calls `allocate` and `free` under its lock; `write`, `read` and `view` touch only
  extents the caller owns (reserved, or pinned by a reader).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_service.shm_arena import ExtentAllocator, SharedArena

log = logging.getLogger(__name__)


class ArenaSpace:
    def __init__(self, arena: SharedArena):
        self.arena = arena
        self._allocator = ExtentAllocator(arena.backed)  # grows with the arena's backed area
        self._full_logged = False

    def extent_bytes(self, size: int) -> int:
        return self._allocator.extent_bytes(size)

    def allocate(self, size: int, evictable_bytes: Callable[[], int], evict_one: Callable[[], bool]) -> int | None:
        offset = self._allocator.allocate(size)
        if offset is None and not self._could_fit(size, evictable_bytes()):
            return None
        while offset is None:
            if self._grow(size):
                offset = self._allocator.allocate(size)
                continue
            if not evict_one():
                return None
            offset = self._allocator.allocate(size)
        return offset

    def free(self, offset: int, size: int) -> None:
        self._allocator.free(offset, size)

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of the free extents of the backed area, in offset order."""
        return self._allocator.free_extents()

    def file_offset(self, offset: int) -> int:
        return self.arena.data_offset + offset

    def write(self, offset: int, data) -> None:
        self.arena.write(self.file_offset(offset), data)

    def read(self, offset: int, size: int) -> bytes:
        return self.arena.read(self.file_offset(offset), size)

    def view(self, offset: int, size: int) -> memoryview:
        return self.arena.view(self.file_offset(offset), size)

    def _could_fit(self, size: int, evictable: int) -> bool:
        """Whether free, unbacked and `evictable` bytes add up to `size` bytes (contiguity aside)."""
        allocator = self._allocator
        unbacked = self.arena.capacity - allocator.capacity
        return allocator.free_bytes + unbacked + evictable >= allocator.extent_bytes(size)

    def _grow(self, size: int) -> bool:
        """Backs more of the arena, enough for `size` more bytes at its end -> whether it grew."""
        allocator = self._allocator
        if allocator.capacity >= self.arena.capacity:
            return False
        backed = self.arena.grow(allocator.capacity + allocator.extent_bytes(size))
        if backed <= allocator.capacity:
            if not self._full_logged:
                log.warning("shared-memory arena %s stops at %d of %d bytes (tmpfs full): evicting instead",
                            self.arena.path, backed, self.arena.capacity)
                self._full_logged = True
            return False
        allocator.extend(backed)
        return True
