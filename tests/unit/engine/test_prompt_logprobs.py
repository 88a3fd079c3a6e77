"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal the log-softmax of the engine's own full forward over
the prompt (fp32, 1e-4): in one chunk, under chunked prefill (a prompt longer than `max_num_batched_tokens`), with
forwards cut inside a step, and for a repeated prompt (the prefix cache is skipped: `num_cached_tokens` 0)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.runner import ModelRunner, Piece
from tests.unit.engine.conftest import random_prompts

TOP = 5
TOL = 1e-4  # logprobs: chunked / cached vs one full forward


def full_forward_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position, from one forward on a fresh cache: [N, V] fp32."""
    engine = llm.engine
    runner = ModelRunner(engine.runner.model, engine.plan)
    blocks = -(-len(prompt) // engine.plan.block_size)
    req = SimpleNamespace(token_ids=prompt, block_ids=list(range(blocks)))
    if runner.kda_layers:
        runner.cache.zero_slots(torch.tensor([0], dtype=torch.long))
    batch = runner.build_batch([Piece(req, 0, len(prompt), 0, True)])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(prompt)))
    return torch.log_softmax(runner.model(batch.to(runner.device), runner.cache).float(), dim=-1)  # [N, V]


def prompt_logprobs_of(llm: LLM, prompt: list[int], k: int = TOP):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=k)
    out = llm.generate([{"prompt_token_ids": prompt}], params, check_integrity=True)[0]
    return out.prompt_logprobs, out.num_cached_tokens


def check_against(reference: torch.Tensor, prompt: list[int], got: list) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row = reference[p - 1]  # [V]: the distribution of the token at p
        entry = got[p]
        token = prompt[p]
        assert abs(entry[token].logprob - float(row[token])) < TOL, p
        # the rank as the reference counts it, up to the tokens whose logprob lies within the tolerance of this one's
        # (their order may differ by rounding between a full forward and chunks: seen on some CPUs)
        above, near = int((row > row[token] + TOL).sum()), int((row > row[token] - TOL).sum())
        assert above + 1 <= entry[token].rank <= near + 1, p
        values, ids = row.topk(TOP)
        assert {t for t, lp in entry.items() if lp.rank <= TOP} == set(ids.tolist()), p
        assert set(entry) == set(ids.tolist()) | {token}, p
        for value, top in zip(values.tolist(), ids.tolist()):
            assert abs(entry[top].logprob - value) < TOL, (p, top)


@pytest.fixture(scope="module", params=["linear", "k3"])
def model_dir(request, tiny_linear_dir, tiny_k3_dir):
    return tiny_linear_dir if request.param == "linear" else tiny_k3_dir


@pytest.fixture(scope="module")
def chunked_llm(model_dir):
    return LLM(model_dir, kv_cache_memory=8 << 20, max_num_batched_tokens=40, block_size=16, snapshot_interval=32)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts(1, 100, 101, seed=3)[0]


def test_equal_full_forward_chunked_and_cached(chunked_llm, prompt):
    reference = full_forward_logprobs(chunked_llm, prompt)
    got, cached = prompt_logprobs_of(chunked_llm, prompt)  # 100 tokens in chunks of at most 40
    check_against(reference, prompt, got)
    assert cached == 0
    again, cached = prompt_logprobs_of(chunked_llm, prompt)  # identical: the prefix cache is skipped
    check_against(reference, prompt, again)
    assert cached == 0
    plain = chunked_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # the cache itself serves others


def test_equal_with_forwards_cut_inside_a_step(model_dir, prompt):
    llm = LLM(model_dir, kv_cache_memory=8 << 20, max_num_batched_tokens=256, max_forward_tokens=24)
    got, _ = prompt_logprobs_of(llm, prompt)
    check_against(full_forward_logprobs(llm, prompt), prompt, got)


def test_negative_control(chunked_llm, prompt):
    """A prompt differing in one token does not pass against this prompt's forward (the check is sharp)."""
    other = list(prompt)
    other[10] = (other[10] + 1) % 7936
    got, _ = prompt_logprobs_of(chunked_llm, other)
    reference = full_forward_logprobs(chunked_llm, prompt)
    check_against(reference[:10], other[:11], got[:11])  # the same up to the change …
    with pytest.raises(AssertionError):
        check_against(reference, other, got)  # … and not after it


def test_only_the_token_and_invalid_values(chunked_llm, prompt):
    got, _ = prompt_logprobs_of(chunked_llm, prompt[:20], k=0)
    assert all(list(e) == [prompt[p]] for p, e in enumerate(got[1:], start=1))
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError):
            SamplingParams(prompt_logprobs=bad)
