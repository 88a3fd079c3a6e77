"""Checksums computed on several threads (issue 30): engine/background.py's `parallel_map` and engine/transfer.py's
version-2 objects, whose digest is sha256(header ‖ sha256(chunk_0) ‖ sha256(chunk_1) ‖ ...) over
`CHECKSUM_CHUNK_BYTES` chunks of the payload.

Claims, each with its control: a large object is written as version 2 and reads back (a small one stays version 1);
the digest equals the rule computed on one thread with plain hashlib, and the bytes do not depend on the thread
count; a byte flipped in a middle chunk (or the last, or the header), a truncated or lengthened object and a
changed version fail closed (the untouched object reads); a version-1 object as older builds wrote it, large or
small, still reads. `parallel_map` keeps the order, works on several threads with the caller among them, runs a map
inside a map in the calling thread, and raises the lowest-indexed failure without starting more items.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time

import pytest
import torch

from engine.background import parallel_map
from engine.transfer import (CHECKSUM_CHUNK_BYTES, VERSION_CHUNK_DIGESTS, VERSION_WHOLE_DIGEST, CorruptObjectError,
                             VersionMismatchError, pack, unpack)

PREFIX = struct.Struct("<4sHI")
PAYLOAD = struct.Struct("<Q32s")


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"recurrent": torch.randn(2, 3, 512, 512, generator=gen),  # 6 MiB of fp32
            "conv": torch.randn(3, 700, 513, generator=gen).to(torch.bfloat16)}  # ~2.1 MB: 3 chunks in all


@pytest.fixture(scope="module")
def large(tensors) -> bytes:
    return pack(tensors, "kda_state/v1", {"hash": "ab"})


def parts(data: bytes) -> tuple[int, bytes, bytes, bytes]:
    """-> (version, header, digest, payload) of a serialised object."""
    _, version, header_len = PREFIX.unpack_from(data, 0)
    start = PREFIX.size + header_len
    _, digest = PAYLOAD.unpack_from(data, start)
    return version, data[PREFIX.size:start], digest, data[start + PAYLOAD.size:]


def as_version_1(data: bytes) -> bytes:
    """The same object as builds that knew only version 1 wrote it: sha256(header ‖ payload) over any size."""
    _, header, _, payload = parts(data)
    return b"".join([PREFIX.pack(b"KDAM", VERSION_WHOLE_DIGEST, len(header)), header,
                     PAYLOAD.pack(len(payload), hashlib.sha256(header + payload).digest()), payload])


def test_a_large_object_has_chunk_digests_equal_to_the_rule_on_one_thread(tensors, large):
    version, header, digest, payload = parts(large)
    chunks = [payload[a:a + CHECKSUM_CHUNK_BYTES] for a in range(0, len(payload), CHECKSUM_CHUNK_BYTES)]
    assert version == VERSION_CHUNK_DIGESTS and len(chunks) == 3
    expected = hashlib.sha256(header + b"".join(hashlib.sha256(c).digest() for c in chunks)).digest()
    assert digest == expected
    assert digest != hashlib.sha256(header + payload).digest()  # not version 1's rule
    assert pack(tensors, "kda_state/v1", {"hash": "ab"}, threads=1) == large  # the thread count changes nothing
    for threads in (1, 2, 4):
        out, layout, meta = unpack(large, "kda_state/v1", threads=threads)
        assert layout == "kda_state/v1" and meta == {"hash": "ab"}
        assert all(out[k].dtype == t.dtype and torch.equal(out[k], t) for k, t in tensors.items())


def test_version_1_objects_still_read_and_small_objects_stay_version_1(tensors, large):
    old = as_version_1(large)
    out, _, _ = unpack(old)
    assert all(torch.equal(out[k], t) for k, t in tensors.items())
    kv = torch.randn(2, 16, 8)
    small = pack({"kv": kv}, "kv_block/v1")
    assert parts(small)[0] == VERSION_WHOLE_DIGEST and torch.equal(unpack(small)[0]["kv"], kv)
    exactly_one_chunk = pack({"x": torch.zeros(CHECKSUM_CHUNK_BYTES, dtype=torch.uint8)}, "t/v1")
    assert parts(exactly_one_chunk)[0] == VERSION_WHOLE_DIGEST


@pytest.mark.parametrize("damage", ["middle chunk", "last chunk", "header", "truncate", "truncate a chunk",
                                    "extend", "version 1", "version 3"])
def test_damage_to_a_chunked_object_fails_closed(large, damage):
    data = bytearray(large)
    payload_start = len(large) - len(parts(large)[3])
    if damage == "middle chunk":
        data[payload_start + CHECKSUM_CHUNK_BYTES + 12345] ^= 0x04
    elif damage == "last chunk":
        data[-1] ^= 0x80
    elif damage == "header":
        data[PREFIX.size + 3] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "truncate a chunk":  # a whole chunk gone and the length field made to agree
        data = data[:-CHECKSUM_CHUNK_BYTES]
        struct.pack_into("<Q", data, payload_start - PAYLOAD.size, len(data) - payload_start)
    elif damage == "extend":
        data += b"\x00"
    else:
        struct.pack_into("<H", data, 4, VERSION_WHOLE_DIGEST if damage == "version 1" else VERSION_CHUNK_DIGESTS + 1)
    error = VersionMismatchError if damage == "version 3" else CorruptObjectError
    for threads in (1, 4):
        with pytest.raises(error):
            unpack(bytes(data), threads=threads)
    unpack(large)  # control: the untouched object reads


def test_parallel_map_keeps_order_and_shares_the_work_with_the_caller():
    seen: list[int] = []

    def where(x: int) -> int:
        time.sleep(0.01)
        seen.append(threading.get_ident())
        return x * x

    assert parallel_map(where, range(12), threads=3) == [x * x for x in range(12)]
    assert 1 < len(set(seen)) <= 3
    seen.clear()
    assert parallel_map(where, range(4), threads=1) == [0, 1, 4, 9]  # control: one thread is the caller's
    assert set(seen) == {threading.get_ident()}


def test_a_map_inside_a_map_runs_in_its_calling_thread():
    def inner(_) -> tuple[int, set[int]]:
        time.sleep(0.01)
        seen: set[int] = set()
        parallel_map(lambda _: (time.sleep(0.002), seen.add(threading.get_ident())), range(8), threads=3)
        return threading.get_ident(), seen

    on_helper = [(outer, seen) for outer, seen in parallel_map(inner, range(6), threads=2)
                 if outer != threading.get_ident()]
    assert on_helper and all(seen == {outer} for outer, seen in on_helper)  # the helper ran its inner maps itself


def test_parallel_map_raises_the_lowest_failure_and_starts_no_more_items():
    started: list[int] = []

    def fail_at_3_and_5(x: int) -> int:
        started.append(x)
        time.sleep(0.005)
        if x in (3, 5):
            raise ValueError(x)
        return x

    with pytest.raises(ValueError, match="^3$"):
        parallel_map(fail_at_3_and_5, range(40), threads=2)
    assert max(started) < 10  # the items after the failure were not started
    with pytest.raises(ValueError):
        parallel_map(lambda x: x, range(3), threads=0)
