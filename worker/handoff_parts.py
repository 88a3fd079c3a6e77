"""A streamed handoff: a small manifest under the handoff's own key, then parts, each hashed on its own.

Layout (every key derived from the handoff's key `key`: same fingerprint, tenant salt, kind and TTL; part i's
content hash is sha256(key's content hash ‖ i), `part_key`):
- `key`: the manifest, `MAGIC` + JSON `{"head": [[bytes, sha256 hex], ...], "blocks": n, "block_parts": bool}`.
- parts 0 .. h-1: the head — the lean handoff (an `engine.transfer.RequestState`: sampler state, KDA state and
  the KV after the last full block) cut into pieces of at most `part_bytes`, each piece's sha256 in the manifest.
- the prompt's n full KV blocks, in order, as `kv_block/v1` objects (each with its own sha256 inside): the
  content-addressed KV_BLOCK objects the prefix cache shares, or with `block_parts` (`--handoff-full-kv`) parts
  h .. h+n-1 under the handoff (`block_part_keys`).

The head's bytes are one `request_state/v1` object with its own checksum (engine/transfer.py: for a head over one
4 MiB chunk, a digest over its chunks' digests, hashed in parallel); the pieces' digests name the piece that is
corrupt or missing before the head is joined and parsed. No object is larger than `part_bytes` (the prefill
worker's `--handoff-part-bytes`, at or below the cache service's `--max-object-bytes`) unless one block is.

Contract:
- `split_head(data, part_bytes)` -> the pieces; `manifest_bytes(pieces, blocks, block_parts)` hashes each piece
  (worker/hash_pool.py: on a few threads) and writes the manifest.
- `read_manifest(data) -> Manifest | None`: None for a whole handoff (a `request_state/v1` object never starts
  with MAGIC; neither does this format's predecessor, `KDAMPARTS1`, whose objects read as corrupt handoffs); a
  manifest that does not parse raises `PartsError`.
- `join_head(manifest, pieces)` -> the head's bytes after checking each piece's size and sha256 (in parallel); a
  missing piece, a wrong size or a digest mismatch raises `PartsError` naming the piece (`missing` says which kind).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

from cache_service.objects import object_key
from protos import common_pb2
from worker.hash_pool import digests

MAGIC = b"KDAMPARTS2"


class PartsError(ValueError):
    """A streamed handoff whose manifest or head cannot be used."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Manifest:
    head: tuple[tuple[int, str], ...]  # (bytes, sha256 hex) of each head piece, in order
    blocks: int  # the prompt's full blocks, which follow the head
    block_parts: bool  # the blocks are parts of the handoff (else the content-addressed KV_BLOCK objects)


def part_key(key: common_pb2.ObjectKey, index: int) -> common_pb2.ObjectKey:
    content = hashlib.sha256(key.content_hash + index.to_bytes(4, "little")).digest()
    return object_key(key.model_fingerprint, key.tenant_salt, key.kind, content)


def head_keys(key: common_pb2.ObjectKey, manifest: Manifest) -> list[common_pb2.ObjectKey]:
    return [part_key(key, i) for i in range(len(manifest.head))]


def block_part_keys(key: common_pb2.ObjectKey, head_pieces: int,
                    blocks: Iterable[int]) -> list[common_pb2.ObjectKey]:
    """The keys of the full blocks `blocks` (indices) stored as parts after `head_pieces` head pieces."""
    return [part_key(key, head_pieces + i) for i in blocks]


def split_head(data: bytes, part_bytes: int) -> list[bytes]:
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    view = memoryview(data)
    return [bytes(view[a:a + part_bytes]) for a in range(0, max(len(data), 1), part_bytes)]


def manifest_bytes(pieces: list[bytes], blocks: int, block_parts: bool, threads: int | None = None) -> bytes:
    head = [[len(p), d] for p, d in zip(pieces, digests(pieces, threads))]
    return MAGIC + json.dumps({"head": head, "blocks": blocks, "block_parts": block_parts}).encode()


def read_manifest(data: bytes) -> Manifest | None:
    if not data.startswith(MAGIC):
        return None
    try:
        fields = json.loads(data[len(MAGIC):])
        head = tuple((int(n), str(d)) for n, d in fields["head"])
        manifest = Manifest(head, int(fields["blocks"]), bool(fields["block_parts"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise PartsError(f"a handoff manifest that does not parse: {exc}") from None
    if not manifest.head or manifest.blocks < 0 or any(n < 0 for n, _ in manifest.head):
        raise PartsError(f"a handoff manifest with {len(manifest.head)} head pieces and {manifest.blocks} blocks")
    return manifest


def join_head(manifest: Manifest, pieces: list[bytes | None], threads: int | None = None) -> bytes:
    missing = [i for i, p in enumerate(pieces) if p is None]
    if missing or len(pieces) != len(manifest.head):
        raise PartsError(f"head pieces missing: {missing or 'count'} of {len(manifest.head)}", missing=True)
    got = digests(pieces, threads)
    for i, (piece, digest, (nbytes, expected)) in enumerate(zip(pieces, got, manifest.head)):
        if len(piece) != nbytes or digest != expected:
            raise PartsError(f"head piece {i} is not what the manifest names (size or sha256)")
    return b"".join(pieces)
