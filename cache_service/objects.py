"""Vocabulary shared by the stores, the servicer and the client: per-key statuses, checksums and key encoding.

- `Status` mirrors `kdamesh.v1.KeyStatus` value for value, so a status crosses the wire as `int(status)`.
- `Checksum.of(data, algorithm)` computes a payload checksum (CRC-32 unless asked: XXH3-64, the client's default, or
  SHA-256); `matches(data)` verifies it. Both accept any bytes-like object (bytes, memoryview of a shared-memory
  arena). Checksums always cover the payload bytes exactly as stored.
- `encode_key(fingerprint, salt, kind, content_hash)` is the one byte form of an `ObjectKey` the stores use:
  `0x01 | kind (1 byte) | len(fingerprint) (u16 BE) | fingerprint | len(salt) (u16 BE) | salt | content_hash`.
  Every variable part but the last is length-prefixed, so distinct keys never encode to the same bytes.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from protos import cache_pb2, common_pb2

KEY_FORMAT_VERSION = 1
MAX_NAMESPACE_PART_BYTES = 0xFFFF
MAX_CONTENT_HASH_BYTES = 64


class Status(enum.IntEnum):
    """Outcome for one key (see `kdamesh.v1.KeyStatus`)."""

    FOUND = cache_pb2.KEY_STATUS_FOUND
    STORED = cache_pb2.KEY_STATUS_STORED
    REMOVED = cache_pb2.KEY_STATUS_REMOVED
    MISSING = cache_pb2.KEY_STATUS_MISSING
    CORRUPT = cache_pb2.KEY_STATUS_CORRUPT
    ERROR = cache_pb2.KEY_STATUS_ERROR
    LEASED = cache_pb2.KEY_STATUS_LEASED
    TOO_LARGE = cache_pb2.KEY_STATUS_TOO_LARGE
    INVALID = cache_pb2.KEY_STATUS_INVALID
    RESERVED = cache_pb2.KEY_STATUS_RESERVED


class ChecksumAlgorithm(enum.IntEnum):
    """See `kdamesh.v1.ChecksumAlgorithm`."""

    CRC32 = cache_pb2.CHECKSUM_ALGORITHM_CRC32
    SHA256 = cache_pb2.CHECKSUM_ALGORITHM_SHA256
    XXH3_64 = cache_pb2.CHECKSUM_ALGORITHM_XXH3_64


CHECKSUM_BYTES = {ChecksumAlgorithm.CRC32: 4, ChecksumAlgorithm.SHA256: 32, ChecksumAlgorithm.XXH3_64: 8}


def _digest(algorithm: ChecksumAlgorithm, data) -> bytes:
    """The checksum value of `data` (any bytes-like object)."""
    if algorithm == ChecksumAlgorithm.XXH3_64:
        return xxhash.xxh3_64_digest(data)  # 8 bytes, big-endian canonical form; releases the GIL
    if algorithm == ChecksumAlgorithm.CRC32:
        return struct.pack(">I", zlib.crc32(data))
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class Checksum:
    algorithm: ChecksumAlgorithm
    value: bytes

    @classmethod
    def of(cls, data, algorithm: ChecksumAlgorithm = ChecksumAlgorithm.CRC32) -> Checksum:
        return cls(algorithm, _digest(algorithm, data))

    def matches(self, data) -> bool:
        return _digest(self.algorithm, data) == self.value

    @classmethod
    def from_proto(cls, msg: cache_pb2.Checksum) -> Checksum:
        """Raises ValueError for an unknown algorithm or a value of the wrong length."""
        if msg.algorithm not in CHECKSUM_BYTES:
            raise ValueError(f"unknown checksum algorithm {msg.algorithm}")
        algorithm = ChecksumAlgorithm(msg.algorithm)
        if len(msg.value) != CHECKSUM_BYTES[algorithm]:
            raise ValueError(f"{algorithm.name} checksum must be {CHECKSUM_BYTES[algorithm]} bytes")
        return cls(algorithm, bytes(msg.value))

    def to_proto(self) -> cache_pb2.Checksum:
        return cache_pb2.Checksum(algorithm=int(self.algorithm), value=self.value)


def encode_key(fingerprint: bytes, salt: bytes, kind: int, content_hash: bytes) -> bytes:
    """The store key of an object. Raises ValueError for an unusable key (unknown kind, empty or oversize hash)."""
    if kind not in common_pb2.ObjectKind.values() or kind == common_pb2.OBJECT_KIND_UNSPECIFIED:
        raise ValueError(f"object kind {kind} is not a known kind")
    if not 0 < len(content_hash) <= MAX_CONTENT_HASH_BYTES:
        raise ValueError(f"content hash must be 1..{MAX_CONTENT_HASH_BYTES} bytes, got {len(content_hash)}")
    if len(fingerprint) > MAX_NAMESPACE_PART_BYTES or len(salt) > MAX_NAMESPACE_PART_BYTES:
        raise ValueError("model fingerprint and tenant salt must be shorter than 64 KiB")
    return b"".join([bytes([KEY_FORMAT_VERSION, kind]), struct.pack(">H", len(fingerprint)), fingerprint,
                     struct.pack(">H", len(salt)), salt, content_hash])


class Refused(ValueError):
    """An object the service does not take, with the status it answers (INVALID, TOO_LARGE)."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def handoff_default_ttl(handoff_ttl_s: float) -> Callable[[int], float | None]:
    """The default TTL by object kind: `handoff_ttl_s` for HANDOFF objects, no expiry for the others."""
    return lambda kind: handoff_ttl_s if kind == common_pb2.OBJECT_KIND_HANDOFF else None


def admit_object(key: common_pb2.ObjectKey, size_bytes: int, ttl_ms: int | None, max_object_bytes: int,
                 default_ttl_s: Callable[[int], float | None]) -> tuple[bytes, float | None]:
    """The rule every put follows, over gRPC or a direct plane -> (store key, TTL in seconds or None: no expiry).
    `ttl_ms` None: the kind's default; 0: no expiry. Raises Refused (INVALID key, TOO_LARGE)."""
    try:
        store_key = encode_object_key(key)
    except ValueError as exc:
        raise Refused(Status.INVALID, str(exc)) from None
    if size_bytes > max_object_bytes:
        raise Refused(Status.TOO_LARGE, f"object of {size_bytes} bytes exceeds the limit of {max_object_bytes}")
    if ttl_ms is None:
        return store_key, default_ttl_s(key.kind)
    return store_key, ttl_ms / 1000 if ttl_ms else None


def encode_object_key(key: common_pb2.ObjectKey) -> bytes:
    return encode_key(key.model_fingerprint, key.tenant_salt, key.kind, key.content_hash)


def object_key(fingerprint: bytes, salt: bytes, kind: int, content_hash: bytes) -> common_pb2.ObjectKey:
    """Convenience constructor of the proto key."""
    return common_pb2.ObjectKey(model_fingerprint=fingerprint, tenant_salt=salt, kind=kind, content_hash=content_hash)
