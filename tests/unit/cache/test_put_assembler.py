"""BatchPut framing: chunks become whole objects; broken framing is refused without storing partial objects."""

import pytest

from cache_service.objects import Checksum, Status, object_key
from cache_service.put_assembler import ProtocolError, PutAssembler
from protos import cache_pb2, common_pb2

KV, HANDOFF = common_pb2.OBJECT_KIND_KV_BLOCK, common_pb2.OBJECT_KIND_HANDOFF


def header(name: bytes, data: bytes, kind: int = KV, ttl_ms: int | None = None) -> cache_pb2.ObjectHeader:
    h = cache_pb2.ObjectHeader(key=object_key(b"fp", b"salt", kind, name), size_bytes=len(data),
                               checksum=Checksum.of(data).to_proto())
    if ttl_ms is not None:
        h.ttl_ms = ttl_ms
    return h


def chunks(name: bytes, data: bytes, step: int, **kw) -> list[cache_pb2.PutChunk]:
    out = [cache_pb2.PutChunk(header=header(name, data, **kw), data=data[:step])]
    return out + [cache_pb2.PutChunk(data=data[o:o + step]) for o in range(step, len(data), step)]


def assembler(max_object_bytes: int = 1 << 20) -> PutAssembler:
    return PutAssembler(max_object_bytes, lambda kind: 30.0 if kind == HANDOFF else None)


def feed_all(asm: PutAssembler, stream: list[cache_pb2.PutChunk]) -> list:
    done = [d for chunk in stream for d in asm.feed(chunk)]
    return done + asm.finish()


def test_objects_complete_when_their_bytes_arrive():
    a, b = bytes(range(256)) * 10, b""
    done = feed_all(assembler(), chunks(b"a", a, 1000) + chunks(b"b", b, 1000) + chunks(b"c", b"xyz", 2))
    assert [d.key.content_hash for d in done] == [b"a", b"b", b"c"]
    assert [d.item.data for d in done] == [a, b, b"xyz"] and all(d.outcome is None for d in done)
    assert done[0].item.checksum == Checksum.of(a) and done[0].item.ttl_s is None


def test_ttl_defaults_and_overrides():
    done = feed_all(assembler(), chunks(b"h", b"x", 4, kind=HANDOFF) + chunks(b"h0", b"x", 4, kind=HANDOFF, ttl_ms=0)
                    + chunks(b"k", b"x", 4, ttl_ms=1500))
    assert [d.item.ttl_s for d in done] == [30.0, None, 1.5]


def test_a_new_header_abandons_the_unfinished_object():
    stream = chunks(b"a", b"0123456789", 4)[:2] + chunks(b"b", b"ok", 4)
    done = feed_all(assembler(), stream)
    assert done[0].outcome.status == Status.INVALID and "8 of 10 bytes" in done[0].outcome.message
    assert done[1].item.data == b"ok"


def test_a_stream_ending_mid_object_stores_nothing_of_it():
    done = feed_all(assembler(), chunks(b"a", b"0123456789", 4)[:2])
    assert len(done) == 1 and done[0].outcome.status == Status.INVALID and done[0].item is None


def test_oversize_objects_are_drained_and_refused():
    big = b"z" * 100
    done = feed_all(assembler(max_object_bytes=50), chunks(b"big", big, 30) + chunks(b"small", b"s", 30))
    assert done[0].outcome.status == Status.TOO_LARGE and done[1].item.data == b"s"


@pytest.mark.parametrize("mutate", [lambda h: h.key.ClearField("content_hash"), lambda h: setattr(h.key, "kind", 0),
                                    lambda h: h.ClearField("checksum")])
def test_invalid_headers_are_refused(mutate):
    stream = chunks(b"a", b"data", 4)
    mutate(stream[0].header)
    done = feed_all(assembler(), stream)
    assert done[0].outcome.status == Status.INVALID


def test_data_outside_an_object_breaks_framing():
    with pytest.raises(ProtocolError):
        assembler().feed(cache_pb2.PutChunk(data=b"stray"))


def test_more_data_than_announced_breaks_framing():
    asm = assembler()
    asm.feed(cache_pb2.PutChunk(header=header(b"a", b"1234"), data=b"12"))
    with pytest.raises(ProtocolError):
        asm.feed(cache_pb2.PutChunk(data=b"3456"))
