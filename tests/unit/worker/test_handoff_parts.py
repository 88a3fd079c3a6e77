"""Per-part hashing of streamed handoffs (worker/handoff_parts.py, worker/hash_pool.py): the manifest carries one
sha256 per head piece, a corrupted or missing piece is caught and named, and the digests are computed on several
threads (none hashes the whole handoff). The blocks that follow the head are `kv_block/v1` objects, each with its
own sha256 (engine/transfer.py), checked one by one (`transfer.check_block`) on the same threads."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
import torch

from engine.transfer import CacheLayout, CorruptObjectError, MissingBlockError, check_block, encode_block
from worker.handoff_parts import (MAGIC, PartsError, join_head, manifest_bytes, part_key, read_manifest,
                                  split_head)
from worker.hash_pool import digests, parallel_map
from protos import common_pb2

DATA = bytes(range(256)) * 41  # 10,496 bytes


def test_each_head_piece_has_its_own_digest_and_a_corrupt_one_is_named():
    pieces = split_head(DATA, 4096)
    assert [len(p) for p in pieces] == [4096, 4096, 2304] and b"".join(pieces) == DATA
    manifest = read_manifest(manifest_bytes(pieces, blocks=7, block_parts=False))
    assert manifest.blocks == 7 and not manifest.block_parts
    assert manifest.head == tuple((len(p), hashlib.sha256(p).hexdigest()) for p in pieces)  # per piece
    assert hashlib.sha256(DATA).hexdigest() not in {d for _, d in manifest.head}  # no digest of the whole
    assert join_head(manifest, pieces) == DATA  # control: the untouched pieces join
    bad = bytearray(pieces[1])
    bad[100] ^= 1
    with pytest.raises(PartsError, match="head piece 1") as caught:
        join_head(manifest, [pieces[0], bytes(bad), pieces[2]])
    assert not caught.value.missing
    with pytest.raises(PartsError, match="missing") as caught:
        join_head(manifest, [pieces[0], None, pieces[2]])
    assert caught.value.missing
    with pytest.raises(PartsError):
        join_head(manifest, pieces[:2])


def test_manifests_parse_or_fail_closed():
    assert read_manifest(b"KDAM\x01\x00rest of a request_state object") is None
    assert read_manifest(b"KDAMPARTS1" + b'{"parts": 2}') is None  # the earlier format: not a manifest here
    for body in (b"not json", b'{"head": []}', json.dumps({"head": [[1, "x"]], "blocks": -1,
                                                           "block_parts": False}).encode()):
        with pytest.raises(PartsError):
            read_manifest(MAGIC + body)


def test_part_keys_are_distinct_and_keep_the_handoffs_namespace():
    key = common_pb2.ObjectKey(model_fingerprint=b"fp", tenant_salt=b"salt", kind=common_pb2.OBJECT_KIND_HANDOFF,
                               content_hash=b"h" * 32)
    keys = [part_key(key, i) for i in range(4)]
    assert len({k.content_hash for k in keys}) == 4 and key.content_hash not in {k.content_hash for k in keys}
    assert all((k.model_fingerprint, k.tenant_salt, k.kind) == (b"fp", b"salt", key.kind) for k in keys)


def test_hashing_runs_on_several_threads_and_equals_one_thread():
    parts = [bytes([i]) * (1 << 16) for i in range(8)]
    assert digests(parts, threads=4) == digests(parts, threads=1) == [hashlib.sha256(p).hexdigest() for p in parts]
    seen = set()

    def where(_):
        time.sleep(0.02)
        seen.add(threading.get_ident())

    parallel_map(where, range(8), threads=4)
    assert len(seen) > 1  # the caller and the pool's helpers (engine/background.py)
    seen.clear()
    parallel_map(where, range(8), threads=1)  # control: one thread is the caller's
    assert seen == {threading.get_ident()}
    with pytest.raises(ZeroDivisionError):
        parallel_map(lambda x: 1 // x, [1, 0, 2], threads=2)


def test_each_block_is_checked_on_its_own():
    layout = CacheLayout(b"fp", 4, (2, 4, 3), {}, 2 * 4 * 3 * 4)
    kv = torch.randn(2, 3, 4, 3)  # three blocks
    hashes = [bytes([i]) * 32 for i in range(3)]
    blobs = [encode_block(kv[:, i], hashes[i], b"fp") for i in range(3)]
    checked = parallel_map(lambda i: check_block(blobs[i], hashes[i], layout, i), range(3), threads=3)
    assert torch.equal(torch.stack(checked, dim=1), kv)
    bad = bytearray(blobs[1])
    bad[-5] ^= 0xFF
    with pytest.raises(CorruptObjectError, match="KV block 1"):
        parallel_map(lambda i: check_block(bytes(bad) if i == 1 else blobs[i], hashes[i], layout, i), range(3),
                     threads=3)
    with pytest.raises(MissingBlockError):
        check_block(None, hashes[0], layout, 0)
