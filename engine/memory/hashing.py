"""Content hashes of full KV blocks, chained so one hash names a whole prefix.

Contract:
- `root_hash(fingerprint, salt)` starts every chain: it binds the model fingerprint (weights and dtype) and the
  tenant's cache salt, so two models or two tenants never share a block or a snapshot.
- `block_hash(parent, tokens, extra)` = sha256(parent ‖ tokens as little-endian int32 ‖ extra), 32 bytes, where
  `extra` is the concatenated hashes of the images whose placeholder tokens overlap the block.
- `BlockHasher.extend(hashes, token_ids)` appends the hashes of the full blocks of `token_ids` not hashed yet.
The same prefix under the same fingerprint and salt hashes the same on every machine (the cache service keys on it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

HASH_DOMAIN = b"kdamesh-prefix-v1"


def root_hash(fingerprint: bytes, salt: bytes | str | None) -> bytes:
    salt_bytes = salt.encode() if isinstance(salt, str) else (salt or b"")
    h = hashlib.sha256(HASH_DOMAIN)
    for part in (fingerprint, salt_bytes):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    h.update(extra)
    return h.digest()


@dataclass(frozen=True)
class MediaSpan:
    """An image's placeholder tokens: `length` tokens from `offset`, content hash `hash`."""

    offset: int
    length: int
    hash: bytes


@dataclass(frozen=True)
class BlockHasher:
    block_size: int
    root: bytes
    media: tuple[MediaSpan, ...] = ()

    def extend(self, hashes: list[bytes], token_ids: Sequence[int]) -> None:
        """Appends to `hashes` the hash of every full block of `token_ids` beyond `len(hashes)` blocks."""
        bs = self.block_size
        for b in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else self.root
            hashes.append(block_hash(parent, token_ids[b * bs:(b + 1) * bs], self._extra(b)))

    def _extra(self, block: int) -> bytes:
        start, end = block * self.block_size, (block + 1) * self.block_size
        return b"".join(m.hash for m in self.media if m.offset < end and m.offset + m.length > start)
