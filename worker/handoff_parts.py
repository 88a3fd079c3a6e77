"""A handoff larger than one cache object travels as parts: a small manifest under the handoff's own key and parts
of at most `part_bytes` under keys derived from it.

Contract:
- `split_handoff(key, data, part_bytes, ttl_s) -> list[PutObject]`: `[PutObject(key, data, ttl_s)]` when `data`
  fits in one part, else a manifest (`MAGIC` + JSON `{"parts", "bytes", "sha256"}`) under `key` and part i under
  `part_key(key, i)` (same fingerprint, tenant salt, kind and TTL; content hash sha256(key's hash ‖ i)), in order.
  No object is larger than `part_bytes` (the prefill worker's `--handoff-part-bytes`, below the cache service's
  `--max-object-bytes`).
- `read_manifest(data) -> Manifest | None`: None for a whole handoff (a request_state object never starts with
  MAGIC); a manifest that does not parse raises `PartsError`.
- `join_parts(manifest, parts)` -> the handoff bytes; a missing part, a wrong total size or a checksum mismatch
  raises `PartsError` (the decode worker treats it as an unusable handoff and recomputes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from cache_service.client import PutObject
from cache_service.objects import object_key
from protos import common_pb2

MAGIC = b"KDAMPARTS1"


class PartsError(ValueError):
    """A parted handoff that cannot be put back together."""


@dataclass(frozen=True)
class Manifest:
    parts: int
    nbytes: int
    sha256: str


def part_key(key: common_pb2.ObjectKey, index: int) -> common_pb2.ObjectKey:
    content = hashlib.sha256(key.content_hash + index.to_bytes(4, "little")).digest()
    return object_key(key.model_fingerprint, key.tenant_salt, key.kind, content)


def part_keys(key: common_pb2.ObjectKey, manifest: Manifest) -> list[common_pb2.ObjectKey]:
    return [part_key(key, i) for i in range(manifest.parts)]


def split_handoff(key: common_pb2.ObjectKey, data: bytes, part_bytes: int,
                  ttl_s: float | None) -> list[PutObject]:
    if len(data) <= part_bytes:
        return [PutObject(key, data, ttl_s)]
    view = memoryview(data)
    parts = [bytes(view[a:a + part_bytes]) for a in range(0, len(data), part_bytes)]
    body = json.dumps({"parts": len(parts), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = PutObject(key, MAGIC + body.encode(), ttl_s)
    return [manifest] + [PutObject(part_key(key, i), p, ttl_s) for i, p in enumerate(parts)]


def read_manifest(data: bytes) -> Manifest | None:
    if not data.startswith(MAGIC):
        return None
    try:
        fields = json.loads(data[len(MAGIC):])
        manifest = Manifest(int(fields["parts"]), int(fields["bytes"]), str(fields["sha256"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise PartsError(f"a handoff manifest that does not parse: {exc}") from None
    if manifest.parts < 1 or manifest.nbytes < 0:
        raise PartsError(f"a handoff manifest with {manifest.parts} parts of {manifest.nbytes} bytes")
    return manifest


def join_parts(manifest: Manifest, parts: list[bytes | None]) -> bytes:
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing or len(parts) != manifest.parts:
        raise PartsError(f"handoff parts missing: {missing or 'count'} of {manifest.parts}")
    data = b"".join(parts)
    if len(data) != manifest.nbytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise PartsError("the handoff's parts do not add up to what the manifest names (size or sha256)")
    return data
