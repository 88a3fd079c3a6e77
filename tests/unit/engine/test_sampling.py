"""Sampler unit tests: filters, penalties, greedy, per-row seeds, batched == alone, logprobs, min_tokens suppression."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SampleRow, Sampler, SamplingParams, apply_filters, apply_penalties

NEG = float("-inf")


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


def test_each_row_draws_only_from_its_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0)

    def draws(rows, x):
        return [r.token_id for r in Sampler().sample(x, rows)]

    alone = [draws([SampleRow(params, [], [], 7, position=n)], logits[:1])[0] for n in range(20)]
    batched = [draws([SampleRow(params, [], [], 7, position=n), SampleRow(params, [], [], 8, position=3),
                      SampleRow(SamplingParams(temperature=0), [], [], None)], logits)[0] for n in range(20)]
    swapped = [draws([SampleRow(params, [], [], 9), SampleRow(params, [], [], 7, position=n)], logits[[2, 0]])[1]
               for n in range(20)]
    assert batched == alone and swapped == alone
    other_seed = [draws([SampleRow(params, [], [], 8, position=n)], logits[:1])[0] for n in range(20)]
    assert other_seed != alone  # negative control: the seed does matter
    assert len(set(alone)) > 5  # and so does the position (the draws are not one token repeated)


def test_sampling_follows_the_distribution():
    target = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(target)[None].expand(4000, -1)  # one row per draw: 4000 seeds, one batched call
    rows = [SampleRow(SamplingParams(), [], [], seed) for seed in range(4000)]
    counts = torch.bincount(torch.tensor([r.token_id for r in Sampler().sample(logits, rows)]), minlength=4)
    assert torch.allclose(counts / 4000, target, atol=0.025)
    positions = [SampleRow(SamplingParams(), [], [], 5, position=n) for n in range(4000)]  # one seed over positions
    counts = torch.bincount(torch.tensor([r.token_id for r in Sampler().sample(logits, positions)]), minlength=4)
    assert torch.allclose(counts / 4000, target, atol=0.025)
    skewed = torch.tensor([0.25, 0.25, 0.25, 0.25])  # negative control: a wrong target fails the same tolerance
    assert not torch.allclose(counts / 4000, skewed, atol=0.025)
    top1 = SamplingParams(top_k=1)
    assert all(r.token_id == 0 for r in Sampler().sample(logits[:50], [SampleRow(top1, [], [], s) for s in range(50)]))


def test_batched_rows_equal_each_row_alone():
    """Every row's params apply to that row only: one call over mixed rows == each row sampled by itself."""
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    rows = [SampleRow(SamplingParams(temperature=0.7, top_p=0.8, seed=1), [1, 2], [], 11, position=2),
            SampleRow(SamplingParams(temperature=0), [3], [], None),
            SampleRow(SamplingParams(temperature=1.3, top_k=5, repetition_penalty=1.5), [4, 5], [6, 6], 12),
            SampleRow(SamplingParams(temperature=0.9, min_p=0.2, frequency_penalty=0.7, presence_penalty=-0.3,
                                     logprobs=3), [7], [8, 9, 8], 13, position=9),
            SampleRow(SamplingParams(temperature=0, presence_penalty=1.0, logprobs=0), [], [0, 0], None,
                      suppress_ids=(1,)),
            SampleRow(SamplingParams(temperature=1.0, min_tokens=3), [], [], 14, suppress_ids=(2, 3))]
    together = Sampler().sample(logits, rows)
    alone = [Sampler().sample(logits[i: i + 1], [row])[0] for i, row in enumerate(rows)]
    assert together == alone
    assert together != Sampler().sample(logits[[1, 0, 2, 3, 4, 5]], rows)  # negative control: rows do differ


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
