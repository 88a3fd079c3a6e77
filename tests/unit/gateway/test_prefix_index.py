"""The gateway's per-worker prefix index (gateway/prefix_index.py): snapshots replace it, batches apply in order,
gaps and new epochs empty it and ask for a resync, silence expires it, eviction removes, the hit rule is the
engine's (snapshot boundary, one token left), and prompts hash as the engine does."""

from __future__ import annotations

from engine.memory.hashing import BlockHasher, MediaSpan, root_hash
from gateway.prefix_index import APPLIED, RESYNC, HashSpace, PromptKey, WorkerIndex
from tests.unit.gateway.kv_feed import (BS, FINGERPRINT, REMOVED, SNAP_REMOVED, SNAP_STORED, SPACE, STORED, batch,
                                        holding, prompt, snapshot)


def test_snapshot_then_batches_in_order():
    key, index = prompt(4), WorkerIndex()
    h = key.hashes(SPACE)
    assert index.cached_tokens(key) == 0 and not index.live
    assert index.apply(holding(key, 2, sequence=10), now=0.0) == APPLIED
    assert index.live and index.next_sequence == 10 and index.cached_tokens(key) == 2 * BS
    assert index.apply(batch([(STORED, h[2]), (STORED, h[3]), (SNAP_STORED, h[3])], sequence=10), 1.0) == APPLIED
    assert index.next_sequence == 13 and index.cached_tokens(key) == 4 * BS
    assert index.apply(batch(sequence=13), 2.0) == APPLIED  # a heartbeat moves nothing but the clock
    assert index.next_sequence == 13 and index.heard_at == 2.0


def test_eviction_removes():
    key, index = prompt(4), WorkerIndex()
    h = key.hashes(SPACE)
    index.apply(holding(key, 4, snapshot_at=(2, 4)), 0.0)
    assert index.cached_tokens(key) == 4 * BS
    index.apply(batch([(REMOVED, h[3])], sequence=0), 0.0)  # the last block left: back to the 2-block snapshot
    assert index.cached_tokens(key) == 2 * BS
    index.apply(batch([(SNAP_REMOVED, h[1])], sequence=1), 0.0)  # and that snapshot: nothing resumable
    assert index.cached_tokens(key) == 0


def test_a_gap_empties_the_index_and_asks_for_a_resync():
    key, index = prompt(4), WorkerIndex()
    index.apply(holding(key, 4), 0.0)
    assert index.apply(batch([(STORED, b"x" * 32)], sequence=1), 0.0) == RESYNC  # event 0 never arrived
    assert not index.live and index.cached_tokens(key) == 0 and index.resyncs == 1
    assert index.apply(batch(sequence=1), 0.0) == RESYNC  # still nothing until a snapshot
    assert index.apply(holding(key, 4, sequence=1), 0.0) == APPLIED and index.cached_tokens(key) == 4 * BS


def test_a_new_epoch_empties_the_index():
    key, index = prompt(4), WorkerIndex()
    index.apply(holding(key, 4, epoch=1), 0.0)
    assert index.apply(batch(epoch=2, sequence=0), 0.0) == RESYNC  # the worker restarted: another cache
    assert index.cached_tokens(key) == 0
    index.apply(snapshot(epoch=2), 0.0)  # the restarted worker's (empty) cache
    assert index.live and index.epoch == 2 and index.cached_tokens(key) == 0


def test_silence_expires():
    index = WorkerIndex()
    index.apply(snapshot(), now=10.0)
    assert not index.expired(12.9, stale_after_s=3.0) and index.expired(13.1, stale_after_s=3.0)


def test_the_hit_rule_is_the_engines():
    key, index = prompt(6), WorkerIndex()
    index.apply(holding(key, 6, snapshot_at=(3,)), 0.0)  # KDA: only the 3-block snapshot is a resumable boundary
    assert index.cached_tokens(key) == 3 * BS
    index.apply(holding(key, 6, snapshot_at=(), kda=False), 0.0)  # no KDA layers: every cached block counts
    assert index.cached_tokens(key) == 6 * BS
    whole = prompt(6, extra=0)  # the prompt is exactly 6 blocks: one token must stay to compute
    index.apply(holding(whole, 6, snapshot_at=(5, 6)), 0.0)
    assert index.cached_tokens(whole) == 5 * BS


def test_tenants_models_and_images_hash_apart():
    index = WorkerIndex()
    index.apply(holding(prompt(4), 4), 0.0)
    assert index.cached_tokens(prompt(4, salt="other")) == 0  # another tenant's salt
    index.apply(holding(prompt(4), 4, fingerprint=b"\x01" * 32), 0.0)  # another model's worker
    assert index.cached_tokens(prompt(4)) == 0


def test_prompt_key_hashes_like_the_engine():
    tokens = list(range(3 * BS + 1))
    image = MediaSpan(offset=20, length=8, hash=b"\x09" * 32)
    expected: list[bytes] = []
    BlockHasher(BS, root_hash(FINGERPRINT, "ab12"), (image,)).extend(expected, tokens)
    key = PromptKey(tokens, "ab12", (image,))
    assert key.hashes(SPACE) == expected
    assert key.hashes(HashSpace(FINGERPRINT, 8)) != expected and len(key.hashes(HashSpace(FINGERPRINT, 8))) == 6
