"""The model drafters through the engine: with `mtp` (tiny-k3's MTP layer) and with `dspark` (a tiny-k3-dspark
drafter folder), greedy output equals the plain engine's token for token — a batch mixing greedy, seeded sampled and
grammar-constrained requests, prefix-cache hits and preemption by recompute — the drafter did propose, seeded
sampling reproduces, and the pools end intact. Random weights draft badly; exactness is what is asserted. The
negative control: the same run with the acceptance rule broken (accepting every draft) diverges from plain."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.sampling import SamplingParams
from engine import step_sampling
from engine.structured import StructuredOutputParams
from tests.unit.engine.conftest import CHECKPOINT_SEED, random_prompts

K = 3
ENGINE = dict(max_num_seqs=4, kv_cache_memory="32MiB", max_num_batched_tokens=128, snapshot_interval=32)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3-dspark", tmp_path_factory.mktemp("tiny-k3-dspark"), seed=CHECKPOINT_SEED)


@pytest.fixture(scope="module", params=["mtp", "dspark"])
def spec_config(request, dspark_dir):
    if request.param == "mtp":
        return {"method": "mtp", "num_speculative_tokens": K}
    return {"method": "dspark", "num_speculative_tokens": K, "model": str(dspark_dir)}


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutputParams("json_schema",
                                                                                        json_schema=SCHEMA)),
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3)]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_drafter_greedy_equals_plain_in_a_mixed_batch(tiny_k3_dir, spec_config):
    prompts = random_prompts(4, 5, 30, seed=3)
    want = _ids(LLM(tiny_k3_dir, **ENGINE).generate(prompts, _params()))
    spec = LLM(tiny_k3_dir, **ENGINE, speculative_config=spec_config)
    got = _ids(spec.generate(prompts, _params()))
    assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]]
    again = LLM(tiny_k3_dir, **ENGINE, speculative_config=spec_config)
    assert _ids(again.generate(prompts, _params()))[1] == got[1]  # seeded sampling reproduces with speculation
    assert spec.engine.stats().spec_num_drafts > 0
    spec.engine.check_integrity()


def test_drafter_with_prefix_hits_and_preemption(tiny_k3_dir, spec_config):
    base = random_prompts(1, 40, 41, seed=4)[0]
    prompts = [base + [11, 12], base + [13], *random_prompts(4, 20, 30, seed=5)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _ids(LLM(tiny_k3_dir, **ENGINE).generate(prompts, params))
    tight = LLM(tiny_k3_dir, **ENGINE, num_kv_blocks=14, speculative_config=spec_config)
    out = tight.generate(prompts, params)
    assert _ids(out) == want
    assert tight.engine.scheduler.num_preemptions > 0 and any(o.num_cached_tokens > 0 for o in out)
    tight.engine.check_integrity()


def test_negative_control_accepting_every_draft_diverges(tiny_k3_dir, monkeypatch):
    prompts = random_prompts(2, 5, 30, seed=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _ids(LLM(tiny_k3_dir, **ENGINE).generate(prompts, params))
    monkeypatch.setattr(step_sampling, "accept_greedy_rows", _accept_all)
    spec = LLM(tiny_k3_dir, **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    assert _ids(spec.generate(prompts, params)) != want


def _accept_all(choice, draft, num_drafts):
    """A broken rule: every draft token is kept whatever the target chose (the bonus token is the target's)."""
    return num_drafts, choice.gather(1, num_drafts[:, None])[:, 0]
