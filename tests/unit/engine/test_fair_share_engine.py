"""Fair share through the real engine (tiny-k3 on CPU): a flooding tenant's newest requests make room for another
tenant's short request, which finishes in about the steps it takes on an idle engine; the flooding tenant's outputs
(greedy, seeded sampling, speculative decoding) equal those of a run without the other tenant, the preempted ones
resuming from their own turn-end snapshots; a lone tenant still fills the whole batch.

Every run checks pool integrity after every step.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.fair_share import TenantShare
from tests.unit.engine.conftest import random_prompts

SLOTS = 8
FLOOD_TOKENS = 40
SHORT_TOKENS = 4
ARRIVES_AT = 24  # steps into the flood: every flood request has decoded past a block boundary (16 tokens)


def _engine(tiny_k3_dir, **extra):
    return LLM(tiny_k3_dir, max_num_seqs=SLOTS, block_size=16, kv_cache_memory=16 << 20, **extra).engine


def _flood_params(i: int) -> SamplingParams:
    if i % 2:  # half greedy, half seeded sampling
        return SamplingParams(max_tokens=FLOOD_TOKENS, temperature=0.8, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=FLOOD_TOKENS, temperature=0, ignore_eos=True)


def _run(engine, flood: int, short_tenant: str | None, max_steps: int = 400):
    """Tenant "a" floods `flood` requests; after ARRIVES_AT steps one short request of `short_tenant` (None: none)
    arrives -> (outputs by id, steps the short request took, the most requests that ran at once)."""
    prompts = random_prompts(flood + 1, 18, 30, seed=7)
    for i in range(flood):
        engine.add_request(f"a{i}", {"prompt_token_ids": prompts[i]}, _flood_params(i), tenant=TenantShare("a"))
    outputs, short_steps, widest = {}, None, 0
    for step in range(max_steps):
        if step == ARRIVES_AT and short_tenant is not None:
            engine.add_request("short", {"prompt_token_ids": prompts[-1]},
                               SamplingParams(max_tokens=SHORT_TOKENS, temperature=0, ignore_eos=True),
                               tenant=TenantShare(short_tenant))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                if out.request_id == "short":
                    short_steps = step + 1 - ARRIVES_AT
        engine.check_integrity()
        widest = max(widest, len(engine.scheduler.running))
        if not engine.has_unfinished_requests():
            return outputs, short_steps, widest
    raise AssertionError("the engine did not drain")


@pytest.fixture(scope="module")
def unflooded(tiny_k3_dir):
    """The flood alone, and the short request alone on an idle engine."""
    outputs, _, widest = _run(_engine(tiny_k3_dir), 16, None)
    idle = _engine(tiny_k3_dir)
    idle.add_request("short", {"prompt_token_ids": random_prompts(17, 18, 30, seed=7)[-1]},
                     SamplingParams(max_tokens=SHORT_TOKENS, temperature=0, ignore_eos=True))
    steps = 0
    while idle.has_unfinished_requests():
        idle.step()
        steps += 1
    return outputs, steps, widest


def test_a_lone_tenant_fills_the_whole_batch(unflooded):
    _, _, widest = unflooded
    assert widest == SLOTS


def test_a_short_request_of_another_tenant_is_not_held_behind_the_flood(tiny_k3_dir, unflooded):
    alone, idle_steps, _ = unflooded
    engine = _engine(tiny_k3_dir)
    outputs, short_steps, _ = _run(engine, 16, "b")
    assert short_steps <= idle_steps + 1, (short_steps, idle_steps)
    stats = engine.stats()
    assert stats.num_fair_preemptions >= 1 and stats.num_preemptions == stats.num_fair_preemptions
    assert {k: v for k, v in outputs.items() if k != "short"} == alone  # greedy and seeded: unchanged


def test_the_same_request_from_the_flooding_tenant_waits_for_a_slot(tiny_k3_dir, unflooded):  # negative control
    _, idle_steps, _ = unflooded
    engine = _engine(tiny_k3_dir)
    _, short_steps, _ = _run(engine, 16, "a")
    assert short_steps > 3 * idle_steps and engine.stats().num_preemptions == 0


def test_preempted_requests_resume_from_their_turn_end_snapshots(tiny_k3_dir, unflooded):
    alone, _, _ = unflooded
    engine = _engine(tiny_k3_dir)
    hits_before = engine.stats().prefix_hit_tokens
    outputs, _, _ = _run(engine, SLOTS, "b")  # only the preempted requests are admitted twice
    assert engine.stats().num_fair_preemptions == 1
    assert engine.stats().prefix_hit_tokens - hits_before >= 16  # its recompute started at a snapshot
    solo, _, _ = _run(_engine(tiny_k3_dir), SLOTS, None)
    assert {k: v for k, v in outputs.items() if k != "short"} == solo


def test_speculative_requests_are_preempted_and_continue_unchanged(tiny_k3_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    solo, _, _ = _run(_engine(tiny_k3_dir, speculative_config=spec), 12, None)
    engine = _engine(tiny_k3_dir, speculative_config=spec)
    outputs, _, _ = _run(engine, 12, "b")
    assert engine.stats().num_fair_preemptions >= 1 and engine.stats().spec_num_drafts > 0
    assert {k: v for k, v in outputs.items() if k != "short"} == solo


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), True])
def test_a_bad_weight_is_refused(weight):
    with pytest.raises(InvalidRequestError, match="tenant weight"):
        TenantShare("a", weight)
