"""Speculative decoding under tensor parallelism: `LLM(..., tensor_parallel_size=2, speculative_config=ngram)` on
CPU gloo gives the greedy tokens of TP=1 without speculation, token for token.

The batch mixes requests whose n-gram drafts are accepted (greedy with frequency_penalty -2: the untrained model's
output falls into loops that prompt lookup predicts) and plain greedy ones, with a second round that hits the first
round's prefix and snapshots. Each rank keeps its heads' slice of every KDA slot, so a verification's per-position
states and the rollback (the running slot moving to the kept position) must hold on both ranks; a second run swaps
in tests/spec_drafters.py's `RejectAtDrafter` (drafting happens on rank 0's host), which rejects at every position
0..k in turn. Negative control: a rollback off by one position (the running state one token behind the kept one)
must make the TP=2 tokens differ.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.memory.manager import CacheManager
from engine.model.checkpoint import make_checkpoint
from engine.sampling import SamplingParams
from tests.spec_drafters import RejectAtDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PREFIX = [(31 * i + 7) % 7900 for i in range(40)]
PROMPTS = [PREFIX + [(13 * i + 2) % 7900 for i in range(5 + k)] for k in range(3)]
LOOPING = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0)
PLAIN = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ARGS = dict(kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=128, block_size=8, snapshot_interval=16,
            collective_timeout_s=20.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tp-spec") / "tiny-k3", seed=5))


def _rounds(llm: LLM) -> list[list[int]]:
    first = llm.generate(PROMPTS[:1], LOOPING)
    second = llm.generate(PROMPTS, [LOOPING, PLAIN, LOOPING])  # the shared prefix now comes from the cache
    return [list(o.outputs[0].token_ids) for o in first + second]


@pytest.fixture(scope="module")
def reference(model_dir):
    return _rounds(LLM(model_dir, **ARGS))


def _tp2_speculative(model_dir, refs: list[list[int]] | None = None) -> tuple[list[list[int]], object]:
    """TP=2 with n-gram speculation (`refs`: with a `RejectAtDrafter` of those references instead)."""
    llm = LLM(model_dir, tensor_parallel_size=2, speculative_config=NGRAM, **ARGS)
    try:
        if refs is not None:
            llm.engine.spec.drafter = RejectAtDrafter(refs, NGRAM["num_speculative_tokens"],
                                                      llm.engine.config.vocab_size)
        return _rounds(llm), llm.engine.stats()
    finally:
        llm.close()


def _refs(reference: list[list[int]]) -> list[list[int]]:
    prompts = PROMPTS[:1] + PROMPTS
    return [p + out for p, out in zip(prompts, reference)]


def test_tp2_with_ngram_speculation_equals_tp1_plain(model_dir, reference):
    tokens, stats = _tp2_speculative(model_dir)
    assert tokens == reference
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepted and rejected drafts


def test_tp2_with_a_rejection_at_every_position_equals_tp1_plain(model_dir, reference):
    tokens, stats = _tp2_speculative(model_dir, _refs(reference))
    assert tokens == reference
    k = NGRAM["num_speculative_tokens"]
    assert all(n > 0 for n in stats.spec_accepted_per_pos) and stats.spec_accepted_per_pos[k - 1] < stats.spec_num_drafts


def test_a_rollback_off_by_one_position_differs(model_dir, reference, monkeypatch):
    settle = CacheManager.settle_verification

    def one_short(self, req, start, kept):
        states = settle(self, req, start, kept)
        req.slot_offset = (req.slot_offset - 1) % self.state_pool.slots_per_request
        return states

    monkeypatch.setattr(CacheManager, "settle_verification", one_short)
    tokens, _ = _tp2_speculative(model_dir, _refs(reference))
    assert tokens != reference
