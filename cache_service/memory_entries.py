"""The memory store's index entries (cache_service/memory_store.py): a visible object, and one with its space
reserved but not yet visible. Mutated only under the store's lock."""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.objects import Checksum


@dataclass(eq=False)
class Entry:
    size: int  # payload bytes
    checksum: Checksum
    expires_at: float | None  # clock() seconds; None: never
    data: bytes | None = None  # the payload (heap store)
    offset: int = 0  # the payload's extent in the arena's data area (arena store)
    readers: int = 0  # reads in progress + locate pins: while > 0 the extent is not freed
    dropped: bool = False  # out of the index: the extent is freed when readers reaches 0


@dataclass(eq=False)
class Pending:
    """An object with its space reserved, not yet visible."""

    key: bytes
    size: int
    checksum: Checksum | None  # None until commit, for reservations
    ttl_s: float | None
    data: bytes | None = None  # heap store: the payload
    offset: int = 0  # arena store: the reserved extent in the data area
