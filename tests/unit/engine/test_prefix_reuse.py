"""Hybrid prefix reuse on the engine: structure hints, junctions, turn ends; each hit equals a cold run token for token.

Every warm engine runs with a snapshot interval far beyond the prompts (as the released models' auto interval is), so
periodic snapshots never help and each hit below comes from the new kind of snapshot point it tests; the same
workload under `snapshot_policy="periodic"` (the behaviour before) misses. `cached_tokens` must equal exactly the
tokens resumed. Negative controls: a deliberately wrong snapshot changes the tokens (so hit == miss means something),
and another tenant's salt never reuses any of these snapshots.
"""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.memory.policy import MAX_SNAPSHOT_HINTS, hint_points
from engine.memory.state_pool import SnapshotPriority
from gateway.chat.k3 import K3Renderer
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BS = 16


def warm(model_dir, **overrides) -> LLM:
    args = dict(kv_cache_memory=8 << 20, max_num_seqs=8, snapshot_interval=4096, num_snapshot_slots=24)
    args.update(overrides)
    return LLM(model_dir, **args)


@pytest.fixture(scope="module")
def cold(tiny_k3_dir):
    return LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=8, enable_prefix_caching=False)


def run(llm: LLM, prompts, hints=None, params=GREEDY, salt=None):
    """Greedy outputs (token ids) and cached tokens of `prompts`, queued together; integrity after every step."""
    if salt is None:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, check_integrity=True,
                            snapshot_hints=hints)
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]
    engine, finals = llm.engine, {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{salt}-{i}", {"prompt_token_ids": p}, params, cache_salt=salt,
                           snapshot_hints=hints[i] if hints else ())
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        engine.check_integrity()
    outs = [finals[f"{salt}-{i}"] for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def cold_ids(cold: LLM, prompts) -> list[list[int]]:
    return run(cold, prompts)[0]


def one_by_one(llm: LLM, prompts, hints=None, salt=None):
    ids, cached = [], []
    for i, p in enumerate(prompts):
        got = run(llm, [p], [hints[i]] if hints else None, salt=salt)
        ids += got[0]
        cached += got[1]
    return ids, cached


def test_hint_second_request_with_the_same_system_prompt_hits_at_the_hint(tiny_k3_dir, cold):
    system = random_prompts(1, 600, 601, seed=40)[0]  # a 600-token system block, hinted where it ends
    prompts = [system + u for u in random_prompts(3, 30, 60, seed=41)]
    hints = [[600]] * 3
    ids, cached = one_by_one(warm(tiny_k3_dir), prompts, hints)
    assert cached == [0, 592, 592]  # the hint, rounded down to its block; not 0 and not more
    assert ids == cold_ids(cold, prompts)
    _, before = one_by_one(warm(tiny_k3_dir, snapshot_policy="periodic"), prompts, hints)
    assert before == [0, 0, 0]  # today's policy: no snapshot where the prompts share their prefix


def test_hint_from_the_k3_renderer(tiny_k3_dir, cold):
    llm = warm(tiny_k3_dir)
    renderer = K3Renderer(llm.tokenizer)
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    users = ["What is the capital of France?", "Write a haiku about block hashes, please."]
    head = renderer.render([system], add_generation_prompt=False).token_ids
    prompts = [renderer.render([system, {"role": "user", "content": u}]).token_ids for u in users]
    assert all(p[: len(head)] == head for p in prompts) and len(head) % BS  # the hint lands inside a block
    ids, cached = one_by_one(llm, prompts, [[len(head)]] * 2)
    assert cached == [0, len(head) // BS * BS]
    assert ids == cold_ids(cold, prompts)


def test_junction_third_request_on_a_branching_prefix_hits(tiny_k3_dir, cold):
    shared = random_prompts(1, 300, 301, seed=42)[0]  # 18 full blocks (288 tokens) + 12
    prompts = [shared + s for s in random_prompts(4, 40, 41, seed=43)]
    llm = warm(tiny_k3_dir)
    ids, cached = one_by_one(llm, prompts)
    assert cached == [0, 0, 288, 288]  # the second computes the shared part and is snapshotted where it branches
    assert ids == cold_ids(cold, prompts)
    assert llm.engine.stats().num_junctions == 1
    _, before = one_by_one(warm(tiny_k3_dir, snapshot_policy="periodic"), prompts)
    assert before == [0, 0, 0, 0]


def test_in_flight_junction_the_second_of_two_concurrent_requests_waits_and_hits(tiny_k3_dir, cold):
    shared = random_prompts(1, 300, 301, seed=44)[0]
    prompts = [shared + s for s in random_prompts(3, 40, 41, seed=45)]
    llm = warm(tiny_k3_dir)
    ids, cached = run(llm, prompts)  # queued together: no block of the shared prefix is cached yet
    assert cached == [0, 288, 288]
    assert ids == cold_ids(cold, prompts)
    _, before = run(warm(tiny_k3_dir, snapshot_policy="periodic"), prompts)
    assert before == [0, 0, 0]


def test_turn_end_next_turn_hits_the_whole_previous_turn(tiny_k3_dir, cold):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm = warm(tiny_k3_dir)
    turn = random_prompts(1, 100, 101, seed=46)[0]
    expected_cached = []
    for n, message in enumerate(random_prompts(3, 20, 30, seed=47)):
        [out] = llm.generate({"prompt_token_ids": turn}, params, check_integrity=True)
        assert out.outputs[0].token_ids == cold.generate({"prompt_token_ids": turn}, params)[0].outputs[0].token_ids
        if n:
            assert out.num_cached_tokens == expected_cached[-1]
        previous = len(turn) + len(out.outputs[0].token_ids)
        expected_cached.append((previous - 1) // BS * BS)  # the last full block of prompt + output computed
        turn = turn + out.outputs[0].token_ids + message  # turn N+1 = turn N + its response + a new message
    periodic = warm(tiny_k3_dir, snapshot_policy="periodic")
    first = random_prompts(1, 100, 101, seed=46)[0]
    [out] = periodic.generate({"prompt_token_ids": first}, params)
    [again] = periodic.generate({"prompt_token_ids": first + out.outputs[0].token_ids + [5] * 20}, params)
    assert again.num_cached_tokens == 96  # before: only the previous prompt's end


def test_a_wrong_snapshot_changes_the_tokens(tiny_k3_dir, cold):
    """The control for every hit == miss comparison here: poisoning the hinted snapshot a hit resumes from must
    change the output (zeroed KDA state still gives fluent tokens, so only an exact comparison catches it)."""
    system = random_prompts(1, 200, 201, seed=48)[0]
    prompts = [system + u for u in random_prompts(2, 30, 31, seed=49)]
    llm = warm(tiny_k3_dir)
    run(llm, prompts[:1], [[200]])
    states = llm.engine.manager.state_pool
    [h] = [h for h in states.snapshot_order() if states.snapshot_priority(h) == SnapshotPriority.HINT]
    slot = states.get_snapshot(h)
    for t in llm.engine.runner.cache.recurrent.values():
        t[slot].zero_()
    ids, cached = run(llm, prompts[1:], [[200]])
    assert cached == [192]
    assert ids != cold_ids(cold, prompts[1:])


def test_another_tenant_never_reuses_hints_junctions_or_turn_ends(tiny_k3_dir):
    shared = random_prompts(1, 300, 301, seed=50)[0]
    prompts = [shared + s for s in random_prompts(3, 40, 41, seed=51)]
    llm = warm(tiny_k3_dir)
    ids_a, cached_a = one_by_one(llm, prompts, [[300]] * 3, salt="tenant-a")
    assert cached_a == [0, 288, 288]
    # b's first would hit a's hint, its second a's junction: b starts cold and makes its own junction
    assert one_by_one(llm, prompts, salt="tenant-b")[1] == [0, 0, 288]
    longer = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    [reply], _ = run(llm, [prompts[2]], params=longer, salt="tenant-a")
    next_turn = prompts[2] + reply + [7] * 20
    assert one_by_one(llm, [next_turn], salt="tenant-c")[1] == [0]  # a's turn end is a's alone
    assert one_by_one(llm, [next_turn], salt="tenant-a")[1] == [(340 + 30 - 1) // BS * BS]


def test_snapshots_stay_in_the_budget_under_a_long_mixed_workload(tiny_k3_dir, cold):
    llm = warm(tiny_k3_dir, num_snapshot_slots=5, num_kv_blocks=120, max_num_batched_tokens=128)
    engine, budget = llm.engine, llm.engine.plan.snapshot_budget_bytes
    assert budget == 5 * engine.plan.bytes_per_state
    systems = random_prompts(3, 100, 180, seed=52)
    prompts = [systems[i % 3] + tail for i, tail in enumerate(random_prompts(12, 10, 60, seed=53))]
    hints = [[len(systems[i % 3])] for i in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, (p, h) in enumerate(zip(prompts, hints)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, snapshot_hints=h)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        engine.check_integrity()
        stats = engine.stats()
        assert stats.snapshot_bytes <= budget and stats.num_snapshots <= 5
    expected = run(cold, prompts, params=params)[0]
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(12)] == expected
    assert sum(finals[f"r{i}"].num_cached_tokens for i in range(12)) > 0
    assert engine.manager.state_pool.num_snapshot_evictions > 0


def test_hints_are_checked_rounded_and_capped():
    assert hint_points([0, 15, 16, 600, 600], 630, 16) == {16: 2, 592: 2}
    for bad in ([-1], [631], [True], ["5"]):
        with pytest.raises(InvalidRequestError):
            hint_points(bad, 630, 16)
    many = hint_points(range(16, 16 * 40, 16), 16 * 40, 16)
    assert len(many) == MAX_SNAPSHOT_HINTS and min(many) == 16 and max(many) == 16 * 39  # the first and the last


def test_llm_rejects_bad_hints_before_queueing_anything(tiny_k3_dir):
    llm = warm(tiny_k3_dir)
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, snapshot_hints=[[4]])
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, snapshot_hints=[[1], [2]])
    assert not llm.engine.has_unfinished_requests()
