"""Hybrid prefix cache end to end: block hashes, hits at snapshot boundaries, hit == miss, salts, counters.

A hit copies a KDA snapshot into the request's running slot and shares the cached MLA blocks; greedy outputs must
equal a cold run token for token. The negative control zeroes the snapshot a hit will read and expects a different
output, proving the snapshot (not a recomputation) carries the state.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.memory.hashing import BlockHasher, MediaSpan, block_hash, root_hash
from engine.memory.manager import resumable_blocks
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_block_hashes_chain_and_separate_models_tenants_and_images():
    root = root_hash(b"model-a", None)
    hasher = BlockHasher(4, root)
    hashes: list[bytes] = []
    hasher.extend(hashes, list(range(10)))
    assert len(hashes) == 2 and all(len(x) == 32 for x in hashes)
    assert hashes[0] == block_hash(root, [0, 1, 2, 3])
    assert hashes[1] == block_hash(hashes[0], [4, 5, 6, 7])
    other: list[bytes] = []
    BlockHasher(4, root).extend(other, [0, 1, 2, 3, 4, 5, 6, 99])
    assert other[0] == hashes[0] and other[1] != hashes[1]
    for different_root in (root_hash(b"model-b", None), root_hash(b"model-a", "tenant-1")):
        salted: list[bytes] = []
        BlockHasher(4, different_root).extend(salted, list(range(10)))
        assert salted[0] != hashes[0]
    assert root_hash(b"model-a", "t") == root_hash(b"model-a", b"t")
    with_image: list[bytes] = []
    BlockHasher(4, root, (MediaSpan(offset=5, length=2, hash=b"img"),)).extend(with_image, list(range(10)))
    assert with_image[0] == hashes[0] and with_image[1] != hashes[1]  # only the block holding the image changes


@pytest.fixture(scope="module")
def cold(tiny_linear_dir):
    return LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=8, enable_prefix_caching=False)


def warm_llm(model_dir, **overrides):
    args = dict(kv_cache_memory=4 << 20, max_num_seqs=8, snapshot_interval=32, num_snapshot_slots=16)
    args.update(overrides)
    return LLM(model_dir, **args)


def one(llm, prompt, params=GREEDY):
    [out] = llm.generate({"prompt_token_ids": prompt}, params, check_integrity=True)
    return out


def test_hit_at_a_periodic_snapshot_equals_a_cold_run(tiny_linear_dir, cold):
    base = random_prompts(1, 100, 101, seed=20)[0]
    llm = warm_llm(tiny_linear_dir)
    first = one(llm, base)
    assert first.num_cached_tokens == 0
    branch = base[:70] + random_prompts(1, 30, 31, seed=21)[0]  # shares 4 full blocks (64 tokens)
    warm = one(llm, branch)
    assert warm.num_cached_tokens == 64  # the interval snapshot at 64
    assert warm.outputs[0].token_ids == one(cold, branch).outputs[0].token_ids
    stats = llm.engine.stats()
    assert (stats.prefix_lookup_tokens, stats.prefix_hit_tokens) == (200, 64)


def test_hit_at_the_prompt_end_snapshot_equals_a_cold_run(tiny_linear_dir, cold):
    prompt = random_prompts(1, 100, 101, seed=22)[0]
    llm = warm_llm(tiny_linear_dir)
    one(llm, prompt)
    again = one(llm, prompt)
    assert again.num_cached_tokens == 96  # the last full block of the prompt
    assert again.outputs[0].token_ids == one(cold, prompt).outputs[0].token_ids
    extended = prompt + again.outputs[0].token_ids[:5] + [7, 8, 9, 10, 11]  # a second turn
    warm_turn = one(llm, extended)
    assert warm_turn.num_cached_tokens == 96
    assert warm_turn.outputs[0].token_ids == one(cold, extended).outputs[0].token_ids


def test_prompt_shorter_than_the_interval_hits(tiny_linear_dir, cold):
    prompt = random_prompts(1, 40, 41, seed=23)[0]  # 2 full blocks, interval 128
    llm = warm_llm(tiny_linear_dir, snapshot_interval=128)
    one(llm, prompt)
    again = one(llm, prompt)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == one(cold, prompt).outputs[0].token_ids


def test_block_multiple_prompt_resumes_one_block_early(tiny_linear_dir, cold):
    prompt = random_prompts(1, 48, 49, seed=24)[0]
    llm = warm_llm(tiny_linear_dir, snapshot_interval=256)
    one(llm, prompt)
    again = one(llm, prompt)
    assert again.num_cached_tokens == 32  # never the whole prompt: one token must produce logits
    assert again.outputs[0].token_ids == one(cold, prompt).outputs[0].token_ids


def test_auto_interval_and_k3(tiny_k3_dir):
    llm = LLM(tiny_k3_dir, kv_cache_memory=4 << 20, max_num_seqs=4)
    assert llm.engine.plan.snapshot_interval == 192  # 31488 B of state / 160 B per token ≈ 12 blocks
    prompt = random_prompts(1, 300, 301, seed=25)[0]
    cold_out = one(llm, prompt)
    llm.engine.reset_prefix_cache()
    one(llm, prompt[:250])
    warm = one(llm, prompt)
    assert warm.num_cached_tokens == 240  # the prompt-end snapshot of the 250-token prompt
    assert warm.outputs[0].token_ids == cold_out.outputs[0].token_ids


def test_tenant_salt_separates_caches(tiny_linear_dir):
    llm = warm_llm(tiny_linear_dir)
    engine = llm.engine
    prompt = random_prompts(1, 50, 51, seed=26)[0]

    def run(request_id, salt):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
            engine.check_integrity()
        return final

    assert run("a", "tenant-a").num_cached_tokens == 0
    assert run("b", "tenant-b").num_cached_tokens == 0
    assert run("c", "tenant-a").num_cached_tokens == 48


def test_snapshot_really_carries_the_state(tiny_linear_dir, cold):
    prompt = random_prompts(1, 60, 61, seed=27)[0]
    llm = warm_llm(tiny_linear_dir)
    one(llm, prompt)
    engine = llm.engine
    hashes = engine.exchange.snapshot_hashes()
    assert hashes, "the first run left snapshots"
    for h in hashes:  # poison every snapshot's recurrent state
        slot = engine.manager.state_pool.get_snapshot(h)
        for t in engine.runner.cache.recurrent.values():
            t[slot].zero_()
    poisoned = one(llm, prompt)
    assert poisoned.num_cached_tokens == 48
    assert poisoned.outputs[0].token_ids != one(cold, prompt).outputs[0].token_ids


def test_lru_eviction_under_pressure_keeps_results_exact(tiny_linear_dir, cold):
    prompts = random_prompts(6, 40, 80, seed=28)
    llm = warm_llm(tiny_linear_dir, num_kv_blocks=14, num_snapshot_slots=3, max_num_batched_tokens=64)
    expected = [one(cold, p).outputs[0].token_ids for p in prompts]
    for _ in range(2):
        for p, e in zip(prompts, expected):
            assert one(llm, p).outputs[0].token_ids == e
    stats = llm.engine.stats()
    assert llm.engine.manager.block_pool.num_evictions > 0 and stats.num_snapshots <= 3


def test_resumable_blocks_rule():
    """The one prefix hit rule, on presence lists (the prefill worker applies it to the cache service's)."""
    # 4 full blocks of 16 in a 64-token prompt: block 4 would leave nothing to compute.
    assert resumable_blocks(64, 16, [True] * 4, [True] * 4) == 3
    assert resumable_blocks(65, 16, [True] * 4, [True] * 4) == 4
    assert resumable_blocks(65, 16, [True, True, False, True], [True] * 4) == 2
    assert resumable_blocks(65, 16, [True] * 4, [False, True, False, False]) == 2  # needs a snapshot there
    assert resumable_blocks(65, 16, [True] * 4, None) == 4  # no KDA layers: any cached boundary
    assert resumable_blocks(10, 16, [], []) == 0
