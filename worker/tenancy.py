"""A tenant's cache identity on a worker: the engine cache salt and the block hashes of a prompt.

Contract: `engine_cache_salt(tenant_salt)` is the one mapping from the gateway's tenant salt (bytes, from the
authenticated principal) to the engine's `cache_salt` (hex text; None for no tenant), and `tenant_salt_of` its
inverse (for objects the engine hands back, e.g. offloaded snapshots). Prefill and decode both use them, so a
prompt's block hashes — and the cache service keys built from them — agree between them.
`prompt_block_hashes(layout, ids, tenant_salt, media)` are the hashes of the prompt's full blocks, as the engine
computes them for its prefix cache (engine/memory/hashing.py; `media`: the prompt's image spans).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.memory.hashing import BlockHasher, MediaSpan, root_hash
from engine.transfer import CacheLayout


def engine_cache_salt(tenant_salt: bytes) -> str | None:
    return tenant_salt.hex() if tenant_salt else None


def tenant_salt_of(cache_salt: str | None) -> bytes:
    return bytes.fromhex(cache_salt) if cache_salt else b""


def prompt_block_hashes(layout: CacheLayout, ids: Sequence[int], tenant_salt: bytes,
                        media: Sequence[MediaSpan] = ()) -> list[bytes]:
    hashes: list[bytes] = []
    hasher = BlockHasher(layout.block_size, root_hash(layout.fingerprint, engine_cache_salt(tenant_salt)),
                         tuple(media))
    hasher.extend(hashes, list(ids))
    return hashes
