"""Statuses mirror the proto enum; checksums and key encoding."""

import pytest

from cache_service.objects import Checksum, ChecksumAlgorithm, Status, encode_key, encode_object_key, object_key
from protos import cache_pb2, common_pb2

KV = common_pb2.OBJECT_KIND_KV_BLOCK


def test_status_values_mirror_proto():
    for status in Status:
        assert cache_pb2.KeyStatus.Value(f"KEY_STATUS_{status.name}") == status.value
    named = {name.removeprefix("KEY_STATUS_") for name in cache_pb2.KeyStatus.keys()} - {"UNSPECIFIED"}
    assert named == {s.name for s in Status}


def test_checksums():
    crc = Checksum.of(b"123456789")
    assert crc.algorithm == ChecksumAlgorithm.CRC32 and crc.value == bytes.fromhex("cbf43926")
    sha = Checksum.of(b"abc", ChecksumAlgorithm.SHA256)
    assert sha.value.hex().startswith("ba7816bf")
    assert crc.matches(b"123456789") and not crc.matches(b"123456780")
    assert Checksum.from_proto(crc.to_proto()) == crc


def test_xxh3_checksums_are_8_bytes_big_endian_and_take_any_buffer():
    assert Checksum.of(b"", ChecksumAlgorithm.XXH3_64).value == bytes.fromhex("2d06800538d394c2")  # XXH3_64(seed 0)
    xxh = Checksum.of(b"123456789", ChecksumAlgorithm.XXH3_64)
    assert xxh.value == bytes.fromhex("72dcb18b67a17dff") and len(xxh.value) == 8
    assert xxh.matches(memoryview(bytearray(b"0123456789"))[1:]) and not xxh.matches(b"123456788")
    assert Checksum.from_proto(xxh.to_proto()) == xxh
    assert xxh.to_proto().algorithm == cache_pb2.CHECKSUM_ALGORITHM_XXH3_64


@pytest.mark.parametrize("proto", [cache_pb2.Checksum(), cache_pb2.Checksum(algorithm=1, value=b"12345"),
                                   cache_pb2.Checksum(algorithm=3, value=b"1234"),
                                   cache_pb2.Checksum(algorithm=7, value=b"1234")])
def test_bad_checksum_protos_are_rejected(proto):
    with pytest.raises(ValueError):
        Checksum.from_proto(proto)


def test_keys_separate_fingerprints_salts_kinds_and_hashes():
    keys = {encode_key(b"fp", b"salt", KV, b"h"), encode_key(b"fp", b"salt2", KV, b"h"),
            encode_key(b"fp2", b"salt", KV, b"h"), encode_key(b"fp", b"salt", common_pb2.OBJECT_KIND_HANDOFF, b"h"),
            encode_key(b"fp", b"salt", KV, b"h2"), encode_key(b"fps", b"alt", KV, b"h"),
            encode_key(b"fp", b"", KV, b"salth")}
    assert len(keys) == 7
    assert encode_object_key(object_key(b"fp", b"salt", KV, b"h")) == encode_key(b"fp", b"salt", KV, b"h")


@pytest.mark.parametrize("kind, content_hash", [(common_pb2.OBJECT_KIND_UNSPECIFIED, b"h"), (99, b"h"),
                                                (KV, b""), (KV, b"x" * 65)])
def test_unusable_keys_raise(kind, content_hash):
    with pytest.raises(ValueError):
        encode_key(b"fp", b"salt", kind, content_hash)
