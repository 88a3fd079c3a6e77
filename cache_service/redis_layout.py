"""How the Redis store lays objects out in Redis: key names and the manifest's byte form (no Redis calls here).

Layout under `key_prefix` (default `kdamesh:`), for an object with store key K:
- manifest `{prefix}o:{K}` = header (`HEADER`: magic `KDC1`, format version, checksum algorithm, checksum length,
  payload size, number of chunks) + checksum + the payload itself when it is at most `inline_bytes` (16 KiB by
  default, `DEFAULT_INLINE_BYTES`; `num_chunks == 0`).
- chunks `{prefix}c:{algorithm}{checksum}{i:u32}{K}` of at most `chunk_bytes` each for larger payloads. Chunk values
  are the caller's bytes sent as they are (no join with a header: a 1 MiB payload is never copied to be stored).
  Chunk keys are named by the checksum, so two writers of the same content write the same keys and a writer of other
  content never overwrites chunks a reader is using. Readers follow `num_chunks`, whatever chunk size wrote them.
- leases: `{prefix}p:{K}` is a sorted set of lease ids scored by deadline (Unix ms; pinned while any score is in the
  future); `{prefix}l:{lease_id}` is the set of keys a lease pins (expires with the lease).
- counters: the hash `{prefix}stats` (fields `COUNTED`; HINCRBY), shared by every store on the prefix: the service's
  and those of clients on the direct Redis data plane.

Cluster layout (`RedisKeys(prefix, tagged=True)`, the `redis+cluster://` backend): the same names with a hash tag
`{T}` right after the kind, `T` = 16 hex digits of BLAKE2b(K): `{prefix}o:{T}K`, `{prefix}c:{T}...K`,
`{prefix}p:{T}K`. Redis Cluster hashes only `T`, so an object's manifest, chunks and pin set share one slot (its MSET
and multi-key DEL are legal: no CROSSSLOT); the lease sets and the counter hash are single keys anywhere. The prefix
must then hold no `{` or `}` (they would move the tag). A single Redis keeps the untagged names, so data and
direct-plane clients of a single Redis are unchanged; a store never mixes the two (the backend URL decides).

`decode_manifest` raises `CorruptManifest` for anything that is not a manifest of this version.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cache_service.objects import CHECKSUM_BYTES, Checksum, ChecksumAlgorithm

MAGIC = b"KDC1"
VERSION = 1
HEADER = struct.Struct(">4sBBBxQI")  # magic, version, checksum algorithm, checksum length, pad, size, num_chunks
MAX_HEADER_BYTES = HEADER.size + max(CHECKSUM_BYTES.values())
COUNTED = ("hits", "misses", "corrupt_reads", "puts", "removes", "errors")  # the fields of {prefix}stats
DEFAULT_INLINE_BYTES = 16 << 10


@dataclass(frozen=True)
class Manifest:
    size: int
    num_chunks: int  # 0: the payload is inline
    checksum: Checksum
    inline: bytes  # the payload when num_chunks == 0


class CorruptManifest(ValueError):
    pass


def encode_manifest(checksum: Checksum, size: int, num_chunks: int, inline: bytes) -> bytes:
    header = HEADER.pack(MAGIC, VERSION, int(checksum.algorithm), len(checksum.value), size, num_chunks)
    return b"".join([header, checksum.value, inline])


def decode_manifest(raw: bytes, header_only: bool = False) -> Manifest:
    if len(raw) < HEADER.size:
        raise CorruptManifest("manifest shorter than its header")
    magic, version, algorithm, checksum_len, size, num_chunks = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptManifest(f"bad manifest magic/version {magic!r}/{version}")
    if algorithm not in CHECKSUM_BYTES or CHECKSUM_BYTES[ChecksumAlgorithm(algorithm)] != checksum_len:
        raise CorruptManifest(f"bad checksum algorithm {algorithm} / length {checksum_len}")
    start = HEADER.size + checksum_len
    if len(raw) < start:
        raise CorruptManifest("manifest truncated in its checksum")
    checksum = Checksum(ChecksumAlgorithm(algorithm), bytes(raw[HEADER.size:start]))
    inline = b"" if header_only or num_chunks else raw[start:]
    return Manifest(size, num_chunks, checksum, inline)


def stored_size(header: bytes) -> int | None:
    """The payload size in a manifest's first `HEADER.size` bytes, or None when they are not a whole header."""
    return HEADER.unpack(header)[4] if len(header) == HEADER.size else None


TAG_BYTES = 2 + 16  # "{" + 16 hex digits + "}"


def hash_tag(key: bytes) -> bytes:
    """`{T}`: the cluster hash tag of store key K (T = 16 hex digits of BLAKE2b(K), never a brace)."""
    return b"{" + hashlib.blake2b(key, digest_size=8).hexdigest().encode() + b"}"


@dataclass(frozen=True)
class RedisKeys:
    """The Redis key names of one prefix; `tagged`: with the cluster hash tag (see the module docstring)."""

    prefix: bytes
    tagged: bool = False

    def __post_init__(self):
        if self.tagged and (b"{" in self.prefix or b"}" in self.prefix):
            raise ValueError(f"a Redis Cluster key prefix may not contain '{{' or '}}', got {self.prefix!r}")

    def _name(self, kind: bytes, key: bytes, *middle: bytes) -> bytes:
        tag = hash_tag(key) if self.tagged else b""
        return b"".join([self.prefix, kind, tag, *middle, key])

    def manifest(self, key: bytes) -> bytes:
        return self._name(b"o:", key)

    def chunk(self, key: bytes, checksum: Checksum, index: int) -> bytes:
        return self._name(b"c:", key, bytes([checksum.algorithm]), checksum.value, struct.pack(">I", index))

    def chunks(self, key: bytes, manifest: Manifest) -> list[bytes]:
        return [self.chunk(key, manifest.checksum, i) for i in range(manifest.num_chunks)]

    def pins(self, key: bytes) -> bytes:
        return self._name(b"p:", key)

    def lease(self, lease_id: str) -> bytes:
        return self.prefix + b"l:" + lease_id.encode()

    @property
    def stats(self) -> bytes:
        return self.prefix + b"stats"

    def pattern(self, kind: bytes) -> bytes:
        """A SCAN pattern matching every key of a kind (b"o:", b"p:", b"l:") under the prefix."""
        return _glob(self.prefix + kind) + b"*"

    def store_key_of_pins(self, name: bytes) -> bytes:
        """The store key K of a pins key `{prefix}p:{K}`."""
        return name[len(self.prefix) + 2 + (TAG_BYTES if self.tagged else 0):]


def _glob(literal: bytes) -> bytes:
    """Escapes Redis glob metacharacters in a literal prefix."""
    out = bytearray()
    for b in literal:
        if b in b"*?[]\\":
            out.append(ord("\\"))
        out.append(b)
    return bytes(out)
