"""BatchPut framing, pure: a stream of `PutChunk`s becomes whole objects to store, or per-object refusals.

Contract:
- A chunk with a header starts an object (`admit`: its store key, checksum and TTL, or an INVALID / TOO_LARGE
  refusal); data chunks follow until the announced size arrived, when the object is `Completed`. A refused object's
  data is drained and dropped. An object the next header or the stream's end cuts short is INVALID, nothing stored.
- `ProtocolError` (the servicer answers INVALID_ARGUMENT) for data outside an object or more data than announced.
- `admit` is also the rule Reserve follows for the shared-memory data plane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cache_service.objects import Checksum, Refused, Status, admit_object
from cache_service.store import KeyOutcome, PutItem
from protos import cache_pb2, common_pb2


class ProtocolError(ValueError):
    """A BatchPut stream whose framing cannot be followed."""


@dataclass(frozen=True)
class Admitted:
    """What the store needs of an object a client announced."""

    item_key: bytes
    checksum: Checksum | None  # None for a ReserveObject (its checksum comes with Commit)
    ttl_s: float | None


def admit(header: cache_pb2.ObjectHeader | cache_pb2.ReserveObject, max_object_bytes: int,
          default_ttl_s: Callable[[int], float | None]) -> Admitted | KeyOutcome:
    """An announced object's store key, checksum and TTL, or its refusal (INVALID key or checksum, TOO_LARGE)."""
    try:
        checksum = Checksum.from_proto(header.checksum) if isinstance(header, cache_pb2.ObjectHeader) else None
        item_key, ttl_s = admit_object(header.key, header.size_bytes,
                                       header.ttl_ms if header.HasField("ttl_ms") else None, max_object_bytes,
                                       default_ttl_s)
    except Refused as exc:
        return KeyOutcome(exc.status, exc.message)
    except ValueError as exc:  # an unusable checksum
        return KeyOutcome(Status.INVALID, str(exc))
    return Admitted(item_key, checksum, ttl_s)


@dataclass(frozen=True)
class Completed:
    """An object whose chunks all arrived: an item to store, or an outcome decided without the store."""

    key: common_pb2.ObjectKey
    item: PutItem | None = None
    outcome: KeyOutcome | None = None


@dataclass
class _Incoming:
    key: common_pb2.ObjectKey
    size: int
    item_key: bytes = b""
    checksum: Checksum | None = None
    ttl_s: float | None = None
    refusal: KeyOutcome | None = None  # set: the object is refused; its data is drained and dropped
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


class PutAssembler:
    """Turns a BatchPut chunk stream into whole objects. `feed` each chunk, then `finish` at the end."""

    def __init__(self, max_object_bytes: int, default_ttl_s: Callable[[int], float | None]):
        self._max_object_bytes = max_object_bytes
        self._default_ttl_s = default_ttl_s
        self._current: _Incoming | None = None
        self.bytes_received = 0

    def feed(self, chunk: cache_pb2.PutChunk) -> list[Completed]:
        done = []
        if chunk.HasField("header"):
            if self._current is not None:
                done.append(self._abandon("the next object started"))
            self._current = self._start(chunk.header)
        elif self._current is None:
            raise ProtocolError("a data chunk arrived outside an object (no header before it)")
        current, data = self._current, chunk.data  # each read of chunk.data copies: read it once
        if data:
            if current.received + len(data) > current.size:
                raise ProtocolError(f"object announced {current.size} bytes and sent more")
            current.received += len(data)
            self.bytes_received += len(data)
            if current.refusal is None:
                current.parts.append(data)
        if current.received == current.size:
            done.append(self._complete(current))
            self._current = None
        return done

    def finish(self) -> list[Completed]:
        return [self._abandon("the stream ended")] if self._current is not None else []

    def _start(self, header: cache_pb2.ObjectHeader) -> _Incoming:
        incoming = _Incoming(header.key, header.size_bytes)
        admitted = admit(header, self._max_object_bytes, self._default_ttl_s)
        if isinstance(admitted, KeyOutcome):
            incoming.refusal = admitted
        else:
            incoming.item_key, incoming.checksum, incoming.ttl_s = admitted.item_key, admitted.checksum, admitted.ttl_s
        return incoming

    def _complete(self, incoming: _Incoming) -> Completed:
        if incoming.refusal is not None:
            return Completed(incoming.key, outcome=incoming.refusal)
        data = incoming.parts[0] if len(incoming.parts) == 1 else b"".join(incoming.parts)
        return Completed(incoming.key, PutItem(incoming.item_key, data, incoming.checksum, incoming.ttl_s))

    def _abandon(self, why: str) -> Completed:
        current, self._current = self._current, None
        return Completed(current.key, outcome=KeyOutcome(
            Status.INVALID, f"{why} after {current.received} of {current.size} bytes; nothing stored"))
