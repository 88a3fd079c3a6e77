"""Sampler unit tests: filters, penalties, greedy, per-row generators, logprobs, min_tokens suppression."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SampleRow, Sampler, SamplingParams, apply_filters, apply_penalties

NEG = float("-inf")


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isinf(apply_filters(logits, 2, 1.0, 0.0)).tolist() == [False, False, True, True, True]
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too
    assert torch.isinf(apply_filters(logits, 0, 0.8, 0.0)).tolist() == [False, False, False, True, True]
    assert torch.isinf(apply_filters(logits, 0, 0.7, 0.0)).tolist() == [False, False, True, True, True]
    assert torch.isinf(apply_filters(logits, 0, 0.1, 0.0)).tolist() == [False, True, True, True, True]
    # min_p 0.25: keep p >= 0.125
    assert torch.isinf(apply_filters(logits, 0, 1.0, 0.25)).tolist() == [False, False, False, True, True]
    shuffled = logits[[3, 0, 4, 2, 1]]
    assert torch.isinf(apply_filters(shuffled, 0, 0.8, 0.0)).tolist() == [True, False, True, False, False]


def test_penalties_follow_vllm():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), p, prompt_ids=[0], output_ids=[1])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), p, prompt_ids=[3], output_ids=[0, 0, 2])
    assert out.tolist() == [2.0 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0]


def test_greedy_and_fast_path():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=0), [0], [], None)] * 2
    assert [r.token_id for r in Sampler().sample(logits, rows)] == [1, 0]
    rows = [SampleRow(SamplingParams(temperature=0, repetition_penalty=10.0), [1], [], None),
            SampleRow(SamplingParams(temperature=0), [0], [], None, suppress_ids=(0,))]
    assert [r.token_id for r in Sampler().sample(logits, rows)] == [2, 2]


def test_each_row_draws_only_from_its_generator():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0)
    alone = Sampler().sample(logits[:1], [SampleRow(params, [], [], gen(7))])[0].token_id
    rows = [SampleRow(params, [], [], gen(7)), SampleRow(params, [], [], gen(8)), SampleRow(params, [], [], gen(9))]
    assert Sampler().sample(logits, rows)[0].token_id == alone
    swapped = [SampleRow(params, [], [], gen(9)), SampleRow(params, [], [], gen(7))]
    assert Sampler().sample(logits[[2, 0]], swapped)[1].token_id == alone


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = gen(0)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[Sampler().sample(logits, [SampleRow(SamplingParams(), [], [], g)])[0].token_id] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    top1 = SamplingParams(top_k=1)
    assert all(Sampler().sample(logits, [SampleRow(top1, [], [], g)])[0].token_id == 0 for _ in range(50))


def test_logprobs_are_raw():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0, logprobs=2, repetition_penalty=5.0)
    [r] = Sampler().sample(logits, [SampleRow(p, [1], [], None)])
    raw = torch.log_softmax(logits[0], -1)
    assert r.token_id == 2 and r.rank == 2 and r.logprob == pytest.approx(float(raw[2]))
    assert [t for t, _ in r.top] == [1, 2]


def test_params_normalise_stop():
    p = SamplingParams(stop="END", stop_token_ids=None)
    assert p.stop == ["END"] and p.stop_token_ids == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
