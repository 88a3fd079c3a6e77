"""Speculative decoding in the engine: greedy output equals the plain engine's token for token (single requests,
a batch mixing greedy, sampled and grammar-constrained requests, prefix-cache hits, preemption and resume,
export/import), acceptance counts of an oracle (k) and an always-wrong drafter (0), and the KDA state after a
rejection at every draft position equals a plain run's at the same position, with the pools intact."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.spec.drafter import Draft
from engine.structured import StructuredOutputParams
from tests.spec_drafters import OracleDrafter, RejectAtDrafter, WrongDrafter
from tests.unit.engine.conftest import random_prompts

K = 3
ENGINE = dict(max_num_seqs=4, kv_cache_memory="32MiB", max_num_batched_tokens=128, snapshot_interval=32)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny_linear_dir", "tiny_k3_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, **ENGINE)


def _spec(model_dir, drafter_cls=None, refs=None, **extra) -> LLM:
    llm = LLM(model_dir, **{**ENGINE, **extra}, speculative_config=NGRAM)
    if drafter_cls is not None:
        vocab = llm.engine.config.vocab_size
        llm.engine.spec.drafter = drafter_cls(refs, K, vocab) if drafter_cls is RejectAtDrafter else \
            drafter_cls(refs, vocab)
    return llm


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _refs(plain, prompts, params=GREEDY) -> list[list[int]]:
    return [p + out for p, out in zip(prompts, _ids(plain.generate(prompts, params)))]


def test_ngram_greedy_equals_plain(model_dir, plain):
    first = random_prompts(1, 10, 11, seed=1)[0]
    again = first + _ids(plain.generate([first], GREEDY))[0] + first  # the lookup finds the first turn's output
    prompts = [again, *random_prompts(3, 5, 40, seed=1)]
    spec = _spec(model_dir)
    assert _ids(spec.generate(prompts, GREEDY)) == _ids(plain.generate(prompts, GREEDY))
    assert spec.engine.stats().spec_num_drafts > 0
    spec.engine.check_integrity()


def test_oracle_accepts_k_and_wrong_accepts_nothing(model_dir, plain):
    prompts = random_prompts(2, 5, 30, seed=2)
    refs = _refs(plain, prompts)
    for cls, accepted in ((OracleDrafter, "all"), (WrongDrafter, "none")):
        spec = _spec(model_dir, cls, refs)
        assert _ids(spec.generate(prompts, GREEDY)) == [r[len(p):] for r, p in zip(refs, prompts)]
        s = spec.engine.stats()
        assert s.spec_num_drafts > 0
        if accepted == "all":
            assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
            assert s.spec_accepted_per_pos[0] == s.spec_num_drafts
            assert spec.engine.num_steps < plain.engine.num_steps  # fewer steps than tokens: it did speculate
        else:
            assert s.spec_num_accepted_tokens == 0 and s.spec_accepted_per_pos == (0,) * K
        spec.engine.check_integrity()


def test_mixed_batch_greedy_sampled_and_grammar(model_dir, plain):
    prompts = random_prompts(4, 5, 30, seed=3)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutputParams("json_schema",
                                                                                          json_schema=schema)),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3, min_tokens=5)]
    refs = _refs(plain, prompts, params)
    spec = _spec(model_dir, RejectAtDrafter, refs)
    got = _ids(spec.generate(prompts, params))
    want = [r[len(p):] for r, p in zip(refs, prompts)]
    assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]]  # greedy ones: token for token
    again = _spec(model_dir, RejectAtDrafter, refs)
    assert _ids(again.generate(prompts, params))[1] == got[1]  # seeded sampling reproduces with speculation
    assert spec.engine.stats().spec_num_accepted_tokens > 0
    spec.engine.check_integrity()


def test_prefix_hit_preemption_and_export_resume(model_dir, plain):
    base = random_prompts(1, 40, 41, seed=4)[0]
    prompts = [base + [11, 12], base + [13], *random_prompts(4, 20, 30, seed=5)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    refs = _refs(plain, prompts, params)
    tight = _spec(model_dir, RejectAtDrafter, refs, num_kv_blocks=14)  # 6 requests of ~4 blocks: preemption
    out = tight.generate(prompts, params)
    assert _ids(out) == [r[len(p):] for r, p in zip(refs, prompts)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in out)  # prefix-cache hits
    tight.engine.check_integrity()
    # export after 10 tokens, resume in another speculating engine: the rest equals the plain run
    short = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    exported = _spec(model_dir, RejectAtDrafter, refs).generate(prompts[:2], short, export=True)
    resumed = _spec(model_dir, RejectAtDrafter, refs).resume([o.exported for o in exported], params)
    assert _ids(resumed) == [r[len(p):] for r, p in zip(refs[:2], prompts[:2])]


def test_rollback_at_every_position_equals_plain_state(model_dir, plain):
    prompt = random_prompts(1, 20, 21, seed=6)[0]
    refs = _refs(plain, [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    spec = _spec(model_dir, RejectAtDrafter, refs).engine
    ref = LLM(model_dir, **ENGINE).engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    spec.add_request("r", prompt, params)
    ref.add_request("r", prompt, params)
    seen_rejects = set()
    while spec.has_unfinished_requests():
        drafter = spec.spec.drafter
        before = drafter.proposals
        spec.step()
        spec.check_integrity()
        req = spec._requests.get("r")
        if req is None:
            break
        while ref._requests["r"].num_computed_tokens < req.num_computed_tokens:
            ref.step()
        if drafter.proposals > before:
            seen_rejects.add((drafter.proposals - 1) % (K + 1))
        mine = spec.runner.read_state(spec.manager.running_slot(req))
        theirs = ref.runner.read_state(ref.manager.running_slot(ref._requests["r"]))
        for name in ("conv", "recurrent"):
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-5)
    assert seen_rejects >= set(range(K + 1))  # a rejection at every position 0..k-1, and a full acceptance


def test_a_draft_that_does_not_fit_the_budget_is_cut(model_dir):
    spec = _spec(model_dir, max_num_batched_tokens=2)  # room for the last token and one draft
    spec.engine.spec.drafter = _Constant(5)
    spec.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    s = spec.engine.stats()
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens == s.spec_num_drafts  # one draft each
    spec.engine.check_integrity()


class _Constant(OracleDrafter):
    def __init__(self, token: int):
        super().__init__([])
        self.token = token

    def propose(self, queries):
        return [Draft((self.token,) * q.num_tokens) for q in queries]


def test_batch_size_schedule_sets_the_drafts_per_step(model_dir, plain):
    """vLLM's `num_speculative_tokens_per_batch_size`: a batch of two takes its range's k (0: plain decoding,
    2: two drafts a step), a single request the first range's 3; the output is plain's in every case."""
    prompts = random_prompts(2, 5, 30, seed=3)
    refs = _refs(plain, prompts)
    want = [r[len(p):] for r, p in zip(refs, prompts)]
    for schedule, batch, k in (([[1, 1, 3], [2, 4, 0]], 2, 0), ([[1, 1, 0], [2, 4, 2]], 2, 2),
                               ([[1, 1, 3], [2, 4, 0]], 1, 3), (None, 2, K)):
        config = {**NGRAM, "num_speculative_tokens_per_batch_size": schedule} if schedule else NGRAM
        llm = LLM(model_dir, **ENGINE, speculative_config=config)
        llm.engine.spec.drafter = OracleDrafter(refs, llm.engine.config.vocab_size)
        assert _ids(llm.generate(prompts[:batch], GREEDY)) == want[:batch]
        s = llm.engine.stats()
        if k == 0:
            assert s.spec_num_drafts == 0
        else:  # the oracle is always right: every step verifies k drafts (fewer only at each max_tokens' edge)
            assert s.spec_num_drafts > 0 and s.spec_accepted_per_pos[k - 1] >= s.spec_num_drafts - batch
            assert k == K or s.spec_accepted_per_pos[k] == 0
        llm.engine.check_integrity()
