"""Decode-context parallelism through the engine API: `LLM(..., tensor_parallel_size=2,
decode_context_parallel_size=2)` on CPU gloo against the replicated cache at TP=1 — greedy tokens, logprobs within
1e-4 (fp32 tiny-k3), prefix hits, handoffs across DCP sizes both ways (whole, and streamed block by block into the
rank group with a lean state), FP8 cache, per-rank MLA bytes exactly half.
The kernels' oracle tests and negative controls (no LSE correction, a rank reading another's token share) are in
tests/unit/kernels/test_context_parallel.py."""

from __future__ import annotations

import pytest

from engine.config import EngineArgs, EngineConfigError, plan_cache
from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.model.config import load_model_config
from engine.sampling import SamplingParams
from tests.unit.parallel.engine_prompts import stream_in

PREFIX = [(31 * i + 7) % 7900 for i in range(40)]
PROMPTS = [PREFIX + [(13 * i + 2) % 7900 for i in range(5 + k)] for k in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
ARGS = dict(num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=128, block_size=8, snapshot_interval=16,
            collective_timeout_s=30.0, enforce_eager=True)

# fp32 latents: 1e-4. FP8 latents: TP=2's all-reduced hidden states differ from TP=1's in the last fp32 bits, and
# a latent that lands on the other side of an e4m3 rounding boundary moves by up to 1/16 of its value, so the same
# bit-level noise shows up larger: max 1.2e-4 measured on an AVX-512 machine (below 1e-4 on an AVX2 one).
LOGPROB_TOLERANCE = {"auto": 1e-4, "fp8": 5e-4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("dcp") / "tiny-k3", seed=5))


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _logprobs(outputs) -> list[float]:
    return [lp.logprob for o in outputs for pos in o.outputs[0].logprobs for lp in pos.values()]


def _rounds(llm: LLM):
    first = llm.generate(PROMPTS[:1], GREEDY)
    second = llm.generate(PROMPTS, GREEDY)  # the shared prefix now comes from the cache
    outs = first + second
    return _tokens(outs), _logprobs(outs), sum(o.num_cached_tokens for o in second)


def _export(llm: LLM):
    return llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), export=True)[0]


def _kv_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in llm.engine.executor.cache.kv.values())


@pytest.fixture(scope="module", params=["auto", "fp8"])
def reference(model_dir, request):
    llm = LLM(model_dir, kv_cache_dtype=request.param, **ARGS)
    tokens, logprobs, cached = _rounds(llm)
    exported = _export(llm).exported
    resumed = _tokens(llm.resume([exported], GREEDY))
    return request.param, tokens, logprobs, cached, exported, resumed, _kv_bytes(llm)


def test_dcp2_equals_dcp1_with_prefix_hits_and_handoffs_both_ways(model_dir, reference):
    kv_dtype, tokens, logprobs, cached, exported, resumed, kv_bytes = reference
    assert cached > 0
    llm = LLM(model_dir, kv_cache_dtype=kv_dtype, tensor_parallel_size=2, decode_context_parallel_size=2, **ARGS)
    try:
        assert _kv_bytes(llm) * 2 == kv_bytes  # the same 96 (+1 scratch) blocks, half the rows on each rank
        got, got_logprobs, got_cached = _rounds(llm)
        assert got == tokens and got_cached == cached
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) < LOGPROB_TOLERANCE[kv_dtype]
        assert _tokens(llm.resume([exported], GREEDY)) == resumed  # a DCP=1 export continues at DCP=2
        streamed = stream_in(llm, exported, GREEDY)  # block by block into the rank group, then the lean state
        assert _tokens(streamed) == resumed
        zeroed = stream_in(llm, exported, GREEDY, zero_blocks=True)  # control: the streamed blocks are what it reads
        assert max(abs(a - b) for a, b in zip(_logprobs(zeroed), _logprobs(streamed))) > 1e-3
        back = _export(llm).exported
    finally:
        llm.close()
    one = LLM(model_dir, kv_cache_dtype=kv_dtype, **ARGS)
    assert _tokens(one.resume([back], GREEDY)) == resumed  # a DCP=2 export continues at DCP=1


def test_the_same_budget_holds_twice_the_blocks(model_dir):
    config = load_model_config(model_dir)
    base = dict(kv_cache_memory=8 << 20, block_size=8, tensor_parallel_size=2)
    one = plan_cache(EngineArgs(model=model_dir, **base), config, 4)
    two = plan_cache(EngineArgs(model=model_dir, decode_context_parallel_size=2, **base), config, 4)
    assert two.rank_block_size == 4 and two.num_blocks >= 2 * one.num_blocks - 1
    assert two.kv_bytes <= one.kv_bytes + one.block_size * one.bytes_per_token


@pytest.mark.parametrize("bad, words", [
    (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "--decode-context-parallel-size"),
    (dict(tensor_parallel_size=4, decode_context_parallel_size=3), "--decode-context-parallel-size"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=7), "--block-size"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, compilation_config={"level": 3}),
     "--compilation-config"),
])
def test_refusals_name_the_option(bad, words):
    with pytest.raises(EngineConfigError, match=words):
        EngineArgs(model="m", **bad)


def test_dcp_groups_within_a_larger_tp_group():
    """TP=4 with DCP=2: two DCP groups (ranks 0-1, 2-3) made with `new_group`; each rank's heads over a prompt, a
    chunk over cached context and a decode equal the naive attention over the replicated cache, and ranks with the
    same DCP rank hold the same token share (the layout of kernels/attention/context_parallel.py)."""
    import torch

    from engine.parallel.launch import run_ranks
    from kernels.attention.context_parallel import scatter_blocks
    from kernels.attention.naive import mla_paged_attention_naive
    from tests.unit.parallel import dcp_ranks as d

    ranks = run_ranks(d.run_dcp, 4, (4, 2), timeout_s=240)
    p = d.problem()
    full = p["lat"].view(d.NUM_BLOCKS, d.BS, d.DK).clone()
    written = torch.zeros(d.NUM_BLOCKS * d.BS, dtype=torch.bool)
    for step, ((new, lens), q) in enumerate(zip(p["steps"], p["qs"])):
        batch = d._batch(p, new, lens)
        written[batch.slot_mapping] = True
        want = mla_paged_attention_naive(q, full, p["tables"], batch.cu_seqlens, batch.seq_lens, 0.3, d.V)
        got = torch.cat([r[step] for r in ranks], dim=1)  # the ranks' heads in order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for r, result in enumerate(ranks):
        share = scatter_blocks(torch.where(written.view(d.NUM_BLOCKS, d.BS, 1), full, 0.0), r % 2, 2)
        assert torch.equal(result[-1], share)


def test_speculative_verification_under_dcp_equals_dcp1(model_dir):
    """ngram drafts are verified as multi-query pieces: the per-sequence DCP path with its causal limit."""
    prompt = [(31 * i + 7) % 7900 for i in range(20)] * 3  # repeats: the ngram drafter proposes
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec = dict(ARGS, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = {}
    for tp, dcp in ((1, 1), (2, 2)):
        llm = LLM(model_dir, tensor_parallel_size=tp, decode_context_parallel_size=dcp, **spec)
        try:
            got[dcp] = _tokens(llm.generate([prompt], params))
        finally:
            llm.close()
    assert got[1] == got[2]


def test_dcp_groups_per_pipeline_stage():
    """Two stages of TP=4 (global rank = stage * 4 + TP rank), DCP=2: each stage's TP ranks pair up on their own."""
    from engine.parallel.launch import run_ranks
    from tests.unit.parallel import dcp_ranks as d

    members = run_ranks(d.dcp_members, 8, (4, 2, 2), timeout_s=240)
    assert members == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
