"""A shared-memory arena (one file under /dev/shm) and the extent allocator the memory store carves it with.

File layout (integers big-endian):
- bytes [0, HEADER_BYTES): the header: magic `KDMARENA` (8 bytes), format version (u32), header size (u32), data
  capacity (u64, bytes), then the token (16 random bytes) at TOKEN_OFFSET; the rest of the page is zero.
- bytes [HEADER_BYTES, HEADER_BYTES + capacity): the data area. Offsets given to clients count from the file's first
  byte (`data_offset + extent offset`), so a client indexes its own mapping with them directly.

Contract:
- `SharedArena.create(capacity, directory)` makes a new sparse file (O_EXCL, mode 0600: only processes of this user
  can map it), maps it shared and writes the header with a fresh random token. The data area is backed by memory
  lazily: `grow(end)` reserves the pages of [0, end) (and then some: at least `grow_step_bytes` more) with
  posix_fallocate, and prefaults them in this process with `populate`; it answers how far the backed area reaches,
  which stops short when the tmpfs is full. Nobody touches data bytes beyond `backed`: a full tmpfs is a refused
  allocation, never a SIGBUS on a write. `close()` unmaps and unlinks; the memory returns to the system once every
  client unmapped too. A service killed without `close()` leaves its file behind (`kdamesh-cache-<pid>-*`):
  `create` first removes such files of this user in `directory` whose pid no longer runs
  (`remove_stale_arenas`, also callable alone; a live pid's file is never touched, whoever owns that pid now).
- `SharedArena.attach(path, size, token, token_offset)` maps an existing arena read-write. It raises ArenaMismatch
  unless the file has exactly that size and holds that token at that offset: proof that the client mapped the very
  arena the service described, on the same host.
- `write`, `read` (a copy) and `view` (a memoryview to release after use) take file offsets. The arena knows nothing
  of objects: the store decides who may touch which bytes, and when.
- `ExtentAllocator` hands out `alignment`-aligned extents of [0, capacity) first-fit (lowest offset where one fits)
  and coalesces a freed extent with free neighbours; `extend(capacity)` adds space at the end (the store extends it
  as the arena's backed area grows, so it never hands out unbacked bytes; offsets are the same as an allocator
  created at full size would give). Zero-byte objects take no space (offset 0). Not thread-safe: the store's lock
  guards it.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
import struct
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"KDMARENA"
ARENA_PREFIX = "kdamesh-cache-"  # file names: ARENA_PREFIX + "<creator pid>-<12 hex digits>"
VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct(">8sIIQ")  # magic, version, header bytes, data capacity (bytes)
TOKEN_OFFSET = 64
TOKEN_BYTES = 16
DEFAULT_ALIGNMENT = 4096
DEFAULT_GROW_STEP_BYTES = 64 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them


class ArenaMismatch(OSError):
    """The file is not the arena the service described (another host, a restarted service, or no such file)."""


def round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class SharedArena:
    def __init__(self, path: Path, fd_size: int, capacity: int, token: bytes, mapping: mmap.mmap,
                 fd: int | None = None, populate: bool = False, grow_step_bytes: int = DEFAULT_GROW_STEP_BYTES):
        self.path = path
        self.size = fd_size  # file bytes: header + data area
        self.capacity = capacity  # data area bytes
        self.data_offset = HEADER_BYTES
        self.token = token
        self.token_offset = TOKEN_OFFSET
        self.backed = 0  # data area bytes [0, backed) have memory reserved (creator only)
        self._mmap = mapping
        self._view = memoryview(mapping)
        self._fd = fd  # the creator keeps the file open to grow it; attached arenas hold no fd
        self._populate = populate
        self._grow_step_bytes = grow_step_bytes

    @classmethod
    def create(cls, capacity: int, directory: str | Path = "/dev/shm", populate: bool = True,
               grow_step_bytes: int = DEFAULT_GROW_STEP_BYTES) -> SharedArena:
        """A new arena with a data area of `capacity` bytes (rounded up to the alignment), none of it backed yet.
        Raises OSError (no such directory, no permission)."""
        capacity = round_up(max(capacity, DEFAULT_ALIGNMENT), DEFAULT_ALIGNMENT)
        remove_stale_arenas(directory)
        token = secrets.token_bytes(TOKEN_BYTES)
        path = Path(directory) / f"{ARENA_PREFIX}{os.getpid()}-{token[:6].hex()}"
        size = HEADER_BYTES + capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, HEADER_BYTES)
            mapping = _map(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        mapping[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, capacity)
        mapping[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES] = token
        return cls(path, size, capacity, token, mapping, fd, populate, round_up(grow_step_bytes, DEFAULT_ALIGNMENT))

    def grow(self, end: int) -> int:
        """Backs data bytes [0, end) with memory (creator only) -> `backed`, which stays below `end` when the tmpfs is
        full (nothing beyond it may be touched)."""
        if end <= self.backed or self._fd is None:
            return self.backed
        new = min(self.capacity, round_up(max(end, self.backed + self._grow_step_bytes), DEFAULT_ALIGNMENT))
        start = HEADER_BYTES + self.backed
        try:
            os.posix_fallocate(self._fd, start, new - self.backed)
        except OSError:
            return self.backed
        if self._populate:
            try:
                self._mmap.madvise(_MADV_POPULATE_WRITE, start, new - self.backed)
            except (OSError, ValueError):  # older kernels: pages fault in on first touch instead
                self._populate = False
        self.backed = new
        return self.backed

    @classmethod
    def attach(cls, path: str | Path, size: int, token: bytes, token_offset: int = TOKEN_OFFSET) -> SharedArena:
        """Maps the arena at `path`; raises ArenaMismatch unless it is `size` bytes and holds `token`."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ArenaMismatch(f"cannot open arena {path}: {exc}") from exc
        try:
            if os.fstat(fd).st_size != size or size < HEADER_BYTES:
                raise ArenaMismatch(f"arena {path} is not {size} bytes")
            mapping = _map(fd, size)
        finally:
            os.close(fd)
        magic, version, header_bytes, capacity = _HEADER.unpack_from(mapping)
        found = mapping[token_offset:token_offset + len(token)]
        if (magic, version, header_bytes) != (MAGIC, VERSION, HEADER_BYTES) or found != token or not token:
            mapping.close()
            raise ArenaMismatch(f"{path} holds another arena (token mismatch): not the service's, or another host")
        return cls(Path(path), size, capacity, token, mapping)

    def write(self, offset: int, data) -> None:
        """Copies `data` (bytes-like) to file offset `offset`."""
        self._view[offset:offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        """A copy of `size` bytes at file offset `offset`."""
        return self._view[offset:offset + size].tobytes()

    def view(self, offset: int, size: int) -> memoryview:
        """The bytes at `offset`, uncopied; release it (`with arena.view(...) as v:`) before `close`."""
        return self._view[offset:offset + size]

    def close(self) -> None:
        """Unmaps (when no view is left) and, for the creator, unlinks the file. Idempotent."""
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:  # a view is still in use (a copy cut short by shutdown): the GC unmaps it later
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_arenas(directory: str | Path = "/dev/shm") -> list[Path]:
    """Unlinks the arena files (`kdamesh-cache-<pid>-<hex>`) of this user in `directory` whose creating process is
    gone -> the paths removed. Clients still mapping one keep their mapping; the memory returns when they unmap."""
    removed = []
    try:
        entries = list(Path(directory).glob(f"{ARENA_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        pid = path.name[len(ARENA_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or _pid_alive(int(pid)) or path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        log.warning("removed the shared-memory arena %s left by process %s, which is gone", path, pid)
        removed.append(path)
    return removed


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class ExtentAllocator:
    """First-fit extents of [0, capacity), `alignment`-aligned, coalescing on free (see the module docstring)."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or capacity < 0 or capacity % alignment:
            raise ValueError(f"capacity {capacity} must be a multiple of alignment {alignment} > 0")
        self.capacity = capacity
        self.alignment = alignment
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (offset, bytes), by offset
        self.free_bytes = capacity

    def extend(self, capacity: int) -> None:
        """Adds [self.capacity, capacity) as free space (merged with a free extent ending at the old end)."""
        if capacity % self.alignment or capacity < self.capacity:
            raise ValueError(f"cannot extend {self.capacity} bytes to {capacity}")
        added, start = capacity - self.capacity, self.capacity
        if not added:
            return
        if self._free and sum(self._free[-1]) == start:
            start = self._free.pop()[0]
        self._free.append((start, capacity - start))
        self.capacity = capacity
        self.free_bytes += added

    def extent_bytes(self, size: int) -> int:
        """Bytes an object of `size` bytes occupies."""
        return round_up(size, self.alignment)

    def allocate(self, size: int) -> int | None:
        """Offset of a new extent for `size` bytes (lowest fit), or None when no free extent is large enough."""
        need = self.extent_bytes(size)
        if need == 0:
            return 0
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self.free_bytes -= need
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        """Returns the extent `allocate(size)` gave at `offset`. Raises ValueError for a double or foreign free."""
        length = self.extent_bytes(size)
        if length == 0:
            return
        i = bisect.bisect_left(self._free, (offset, 0))
        prev_end = self._free[i - 1][0] + self._free[i - 1][1] if i else 0
        next_start = self._free[i][0] if i < len(self._free) else self.capacity
        if offset % self.alignment or offset < prev_end or offset + length > next_start:
            raise ValueError(f"extent [{offset}, {offset + length}) is not allocated")
        start, end = offset, offset + length
        if i < len(self._free) and next_start == end:  # merge with the next free extent
            end += self._free.pop(i)[1]
        if i and prev_end == start:  # merge with the previous one
            i -= 1
            start = self._free.pop(i)[0]
        self._free.insert(i, (start, end - start))
        self.free_bytes += length

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every free extent, by offset."""
        return list(self._free)
