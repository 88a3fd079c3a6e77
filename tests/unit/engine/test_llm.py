"""The offline `LLM` API end to end on tiny generated checkpoints.

- continuous batching + chunked prefill == each prompt alone (greedy, token for token), also under a token budget
  that forces chunking and a KV pool that forces preemption;
- greedy generation == the references (transformers `generate` for kimi_linear, the official K3 code for kimi_k3);
- stop strings / stop tokens / EOS, n > 1, seeded sampling independent of batch composition, logprobs;
- bad requests raise `InvalidRequestError` and the engine keeps serving.
Every engine run checks pool integrity after every step (`check_integrity=True`).
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.unit.engine.conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def ids(prompt):
    return {"prompt_token_ids": prompt}


def run(llm, prompts, params):
    outs = llm.generate([ids(p) for p in prompts], params, check_integrity=True)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def linear_llm(tiny_linear_dir):
    return LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=16, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone_outputs(linear_llm):
    prompts = random_prompts(16, 3, 90, seed=1)
    params = SamplingParams(max_tokens=12, **GREEDY)
    return prompts, [run(linear_llm, [p], params)[0] for p in prompts]


def test_batch_equals_each_prompt_alone(linear_llm, alone_outputs):
    prompts, alone = alone_outputs
    steps = linear_llm.engine.num_steps
    batched = run(linear_llm, prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert batched == alone
    assert linear_llm.engine.num_steps - steps < 16 * 12 / 2  # it really ran them together


def test_batch_equals_alone_with_chunking_and_preemption(tiny_linear_dir, alone_outputs):
    prompts, alone = alone_outputs
    llm = LLM(tiny_linear_dir, max_num_seqs=16, max_num_batched_tokens=24, num_kv_blocks=12, block_size=16,
              num_snapshot_slots=8, snapshot_interval=32)
    assert run(llm, prompts, SamplingParams(max_tokens=12, **GREEDY)) == alone
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 12 and stats.num_running == 0


def test_split_forwards_equal_one_forward_per_step(tiny_linear_dir, alone_outputs):
    """A step larger than `max_forward_tokens` runs as several forwards (chunks cut into pieces)."""
    prompts, alone = alone_outputs
    llm = LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=16, max_num_batched_tokens=512,
              max_forward_tokens=37, enable_prefix_caching=False)
    steps = llm.engine.num_steps
    assert run(llm, prompts, SamplingParams(max_tokens=12, **GREEDY)) == alone
    assert llm.engine.num_steps - steps <= 12 + 2  # the prompts were scheduled in few steps, split into forwards


def test_split_forwards_cuts_pieces_in_order():
    from engine.runner import Piece, split_forwards

    a, b = object(), object()
    pieces = [Piece(a, 0, 5, 0, True), Piece(b, 10, 12, 1, True), Piece(a, 5, 1, 0, False)]
    groups = split_forwards(pieces, 8)
    assert [[(p.req is a, p.start, p.num_tokens, p.needs_logits) for p in g] for g in groups] == [
        [(True, 0, 5, True), (False, 10, 3, False)],
        [(False, 13, 8, False)],
        [(False, 21, 1, True), (True, 5, 1, False)],
    ]
    assert split_forwards(pieces, 100) == [pieces]


def test_k3_batch_equals_alone_with_chunking(tiny_k3_dir):
    prompts = random_prompts(6, 3, 70, seed=2)
    params = SamplingParams(max_tokens=8, **GREEDY)
    llm = LLM(tiny_k3_dir, max_num_seqs=8, max_num_batched_tokens=20, kv_cache_memory=4 << 20)
    alone = [run(llm, [p], params)[0] for p in prompts]
    llm.engine.reset_prefix_cache()
    assert run(llm, prompts, params) == alone


def test_greedy_matches_transformers_generate(tiny_linear_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # transformers' pure-torch KDA
    from transformers import KimiLinearForCausalLM

    ref = KimiLinearForCausalLM.from_pretrained(tiny_linear_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, 40, 41, seed=3)[0]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, eos_token_id=None,
                           pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    llm = LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=16)
    assert run(llm, [prompt], SamplingParams(max_tokens=64, **GREEDY)) == [expected]


def test_greedy_matches_official_k3(tiny_k3_dir):
    from tests.reference.k3_reference import load_reference_k3, reference_generate

    ref = load_reference_k3(tiny_k3_dir)
    prompt = random_prompts(1, 40, 41, seed=4)[0]
    expected = reference_generate(ref, prompt, 64)
    llm = LLM(tiny_k3_dir, kv_cache_memory=4 << 20, max_num_seqs=4)
    assert run(llm, [prompt], SamplingParams(max_tokens=64, **GREEDY)) == [expected]


def test_text_prompt_and_outputs(linear_llm):
    [out] = linear_llm.generate("The quick brown fox", SamplingParams(max_tokens=5, **GREEDY))
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == linear_llm.tokenizer.encode("The quick brown fox")
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == linear_llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_stop_string_is_matched_on_text_and_not_emitted(linear_llm):
    prompt = ids(random_prompts(1, 20, 21, seed=5)[0])
    [full] = linear_llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY))
    text = full.outputs[0].text
    stop = text[7:10]
    cut = text.find(stop)
    [out] = linear_llm.generate(prompt, SamplingParams(max_tokens=20, stop=[stop, "\x00never"], **GREEDY))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:cut]
    assert c.token_ids == full.outputs[0].token_ids[: len(c.token_ids)] and len(c.token_ids) < 20
    [kept] = linear_llm.generate(prompt, SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True,
                                                        **GREEDY))
    assert kept.outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids_and_eos(linear_llm):
    prompt = ids(random_prompts(1, 20, 21, seed=6)[0])
    [full] = linear_llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))
    tokens = full.outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    [out] = linear_llm.generate(prompt, SamplingParams(max_tokens=16, stop_token_ids=[stop_id], **GREEDY))
    c = out.outputs[0]
    assert c.token_ids == tokens[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    assert full.outputs[0].text.startswith(c.text)
    assert len(c.text) < len(linear_llm.tokenizer.decode(tokens[: first + 1], skip_special_tokens=True)) or \
        linear_llm.tokenizer.decode([stop_id]) == ""
    # the model's EOS ends a request unless ignore_eos
    engine = linear_llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (stop_id,)
    try:
        [eos] = linear_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))
        [ignored] = linear_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        [min_tok] = linear_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, min_tokens=first + 2))
    finally:
        engine.eos_token_ids = saved
    assert eos.outputs[0].token_ids == tokens[: first + 1] and eos.outputs[0].stop_reason is None
    assert ignored.outputs[0].token_ids == tokens
    assert stop_id not in min_tok.outputs[0].token_ids[: first + 2]


def test_n_completions(linear_llm):
    prompt = ids(random_prompts(1, 12, 13, seed=7)[0])
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    [out] = linear_llm.generate(prompt, params, check_integrity=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3 and all(len(s) == 8 for s in seqs)
    [again] = linear_llm.generate(prompt, params)
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    [greedy] = linear_llm.generate(prompt, SamplingParams(n=2, max_tokens=8, **GREEDY))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_seeded_sampling_is_independent_of_the_batch(linear_llm):
    prompts = random_prompts(5, 5, 60, seed=8)
    target = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=1234,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, ignore_eos=True)
    [alone] = run(linear_llm, [prompts[0]], target)
    others = [SamplingParams(max_tokens=7, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    outs = linear_llm.generate([ids(p) for p in prompts], [target] + others, check_integrity=True)
    assert outs[0].outputs[0].token_ids == alone
    reordered = linear_llm.generate([ids(p) for p in prompts[::-1]], others[::-1] + [target])
    assert reordered[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True)
    a, b = run(linear_llm, [prompts[0], prompts[0]], unseeded)
    assert a != b  # different per-request seeds


def test_logprobs(linear_llm):
    prompt = ids(random_prompts(1, 10, 11, seed=9)[0])
    [out] = linear_llm.generate(prompt, SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, position in zip(c.token_ids, c.logprobs):
        assert position[token].rank == 1 and len(position) == 3
        assert position[token].logprob == max(lp.logprob for lp in position.values()) <= 0
        assert position[token].decoded_token == linear_llm.tokenizer.decode([token])
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"), (dict(temperature=-0.1), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(stop=[""]), "stop"),
    (dict(logprobs=99), "logprobs"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_params_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(tiny_linear_dir):
    llm = LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=4, max_model_len=64)
    good = ids(random_prompts(1, 10, 11, seed=10)[0])
    params = SamplingParams(max_tokens=4, **GREEDY)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([good, ids(list(range(70)))], params)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate(good, SamplingParams(max_tokens=60, **GREEDY))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(ids([]), params)
    with pytest.raises(InvalidRequestError):
        llm.generate(ids([10 ** 9]), params)
    with pytest.raises(InvalidRequestError):
        llm.generate(good, SamplingParams(stop_token_ids=[10 ** 9]))
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
    [out] = llm.generate(good, params, check_integrity=True)
    assert len(out.outputs[0].token_ids) == 4
    [default_len] = llm.generate(good, SamplingParams(max_tokens=None, **GREEDY))
    assert len(default_len.outputs[0].token_ids) == 64 - 10  # up to max_model_len
    small_pool = LLM(tiny_linear_dir, num_kv_blocks=2, block_size=16, max_num_seqs=2, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        small_pool.generate(good, SamplingParams(max_tokens=40, **GREEDY))


def test_no_read_of_unwritten_cache_memory(tiny_linear_dir, alone_outputs):
    """NaN-poisoned pools: any read of a block or slot the engine did not write would turn the logits into NaN."""
    prompts, alone = alone_outputs
    llm = LLM(tiny_linear_dir, max_num_seqs=16, max_num_batched_tokens=24, num_kv_blocks=12, block_size=16,
              num_snapshot_slots=8, snapshot_interval=32)
    cache = llm.engine.runner.cache
    for t in [*cache.kv.values(), *cache.conv.values(), *cache.recurrent.values()]:
        t.fill_(float("nan"))
    assert run(llm, prompts, SamplingParams(max_tokens=12, **GREEDY)) == alone
    assert run(llm, prompts[:4], SamplingParams(max_tokens=12, **GREEDY)) == alone[:4]  # with prefix hits
    assert llm.engine.stats().prefix_hit_tokens > 0


def test_abort_running_and_waiting_requests(linear_llm):
    engine = linear_llm.engine
    params = SamplingParams(max_tokens=50, **GREEDY)
    prompts = random_prompts(3, 10, 20, seed=12)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", ids(p), params, priority=i)
    engine.scheduler.max_num_seqs = 2  # abort-2 has to wait
    try:
        engine.step()
        assert [r.request_id for r in engine.scheduler.waiting] == ["abort-2"]
        assert engine.abort("abort-0") and engine.abort("abort-2") and not engine.abort("nope")
        outs = {o.request_id: o for o in engine.step()}
        engine.check_integrity()
        assert outs["abort-0"].finished and outs["abort-0"].outputs[0].finish_reason == "abort"
        assert outs["abort-2"].finished and outs["abort-2"].outputs[0].token_ids == []
        assert not outs["abort-1"].finished
        assert not engine.abort("abort-0")  # already finished
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
    finally:
        engine.scheduler.max_num_seqs = 16


def test_detokenize_off_streams_ids_only(tiny_linear_dir, linear_llm):
    """`detokenize=False`: the same ids, no text, stop strings left to the caller (stop ids still apply)."""
    prompt = ids(random_prompts(1, 20, 21, seed=5)[0])
    [full] = linear_llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY))
    stop = full.outputs[0].text[7:10]
    ids_only = LLM(tiny_linear_dir, kv_cache_memory=4 << 20, max_num_seqs=4, enable_prefix_caching=False,
                   detokenize=False)
    [out] = ids_only.generate(prompt, SamplingParams(max_tokens=20, stop=[stop], logprobs=1, **GREEDY))
    c = out.outputs[0]
    assert c.token_ids == full.outputs[0].token_ids and c.text == "" and c.finish_reason == "length"
    assert all(lp.decoded_token is None for pos in c.logprobs for lp in pos.values())
    assert full.outputs[0].text != ""  # negative control: with detokenisation on there is text to lose
    [stopped] = ids_only.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=[c.token_ids[4]], **GREEDY))
    assert stopped.outputs[0].token_ids == c.token_ids[:5] and stopped.outputs[0].finish_reason == "stop"
