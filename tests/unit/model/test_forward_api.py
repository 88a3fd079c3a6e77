"""The forward API: packed variable-length batches on top of cached blocks and state equal sequential runs."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model
from tests.model_driver import SequenceDriver


@pytest.fixture(scope="module", params=["tiny-linear", "tiny-k3"])
def model(request, tmp_path_factory):
    return load_model(make_checkpoint(request.param, tmp_path_factory.mktemp("m") / request.param, seed=11))


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 7900, (n,), generator=gen).tolist() for n in lengths]


def test_packed_prefill_equals_each_alone(model):
    prompts = _prompts([1, 17, 40, 5])
    alone = [SequenceDriver(model, max_seqs=1).prefill(0, p, all_logits=False)[0] for p in prompts]
    packed = SequenceDriver(model, max_seqs=4).step({i: p for i, p in enumerate(prompts)})
    for i, ref in enumerate(alone):
        torch.testing.assert_close(packed[i], ref, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_after_cached_blocks_mixed_with_decodes(model):
    prompts = _prompts([50, 33, 20], seed=1)
    full = [SequenceDriver(model, max_seqs=1).prefill(0, p)[-1] for p in prompts]
    driver = SequenceDriver(model, max_seqs=3)
    driver.step({0: prompts[0][:32], 1: prompts[1][:32], 2: prompts[2][:19]})  # cached prefix (2 blocks)
    logits = driver.step({0: prompts[0][32:], 1: prompts[1][32:], 2: prompts[2][19:]})  # chunk + decode-like rows
    for i in range(3):
        torch.testing.assert_close(logits[i], full[i], rtol=1e-5, atol=1e-5)


def test_pure_decode_batch_equals_single_decodes(model):
    prompts = _prompts([9, 30], seed=2)
    singles = []
    for p in prompts:
        d = SequenceDriver(model, max_seqs=1)
        d.prefill(0, p[:-1])
        singles.append(d.decode(0, p[-1]))
    driver = SequenceDriver(model, max_seqs=2)
    driver.step({0: prompts[0][:-1], 1: prompts[1][:-1]})
    batched = driver.step({0: [prompts[0][-1]], 1: [prompts[1][-1]]})
    for i in range(2):
        torch.testing.assert_close(batched[i], singles[i], rtol=1e-5, atol=1e-5)


def test_zeroed_state_changes_output(model):
    """Negative control: the KDA state carries information between steps."""
    prompt = _prompts([40], seed=3)[0]
    driver = SequenceDriver(model, max_seqs=1)
    driver.prefill(0, prompt[:-1])
    good = driver.decode(0, prompt[-1])
    driver2 = SequenceDriver(model, max_seqs=1)
    driver2.prefill(0, prompt[:-1])
    for t in driver2.cache.recurrent.values():
        t.zero_()
    bad = driver2.decode(0, prompt[-1])
    assert (good - bad).abs().max() > 1e-3
