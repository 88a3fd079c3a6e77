"""Target-side capture: `forward_with_taps` returns exactly the streams it claims, and taps change nothing else."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.layers import ResidualStream, attn_res_mix
from engine.model.loader import load_model
from engine.spec.capture import TapError, forward_with_taps
from engine.spec.drafter import FINAL_TAP
from tests.unit.spec.conftest import one_sequence, tokens


def _streams_by_hand(model, ids):
    """Each layer's handed-on stream and the pre-norm final hidden, layer by layer on a fresh cache."""
    batch, cache = one_sequence(model, ids)
    inner = model.model
    stream = ResidualStream(inner.embed_tokens(batch.input_ids))
    after = []
    with torch.inference_mode():
        for layer in inner.layers:
            layer(stream, batch, cache)
            after.append(stream.hidden.clone())
        final = stream.hidden
        if model.config.attn_res_block_size:
            final = attn_res_mix(stream.blocks, final, inner.output_attn_res_norm.weight,
                                 inner.output_attn_res_proj.weight, model.config.rms_norm_eps)
    return after, final


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    return load_model(make_checkpoint("tiny-linear", tmp_path_factory.mktemp("tl"), seed=2))


@pytest.mark.parametrize("which", ["k3", "linear"])
def test_taps_are_the_claimed_streams(which, k3, linear):
    model = k3 if which == "k3" else linear
    ids = tokens(21, seed=1)
    taps = (0, 1, 3, FINAL_TAP)
    batch, cache = one_sequence(model, ids)
    logits, hidden = forward_with_taps(model, batch, cache, taps)
    after, final = _streams_by_hand(model, ids)
    d = model.config.hidden_size
    assert hidden.shape == (len(ids), len(taps) * d)
    for j, tap in enumerate(taps):
        want = final if tap == FINAL_TAP else after[tap]
        torch.testing.assert_close(hidden[:, j * d:(j + 1) * d], want, rtol=0, atol=0)
    # the final tap is what the LM head reads after model.norm: an independent check of FINAL_TAP
    torch.testing.assert_close(model.lm_head(model.model.norm(hidden[:, -d:])).float(), logits, rtol=1e-6, atol=1e-6)
    if which == "k3":  # negative control: with attention residuals the last layer's stream is not the output mix
        assert not torch.allclose(hidden[:, 2 * d:3 * d], hidden[:, 3 * d:])
    else:  # plain residuals: the last layer hands on exactly the final hidden
        torch.testing.assert_close(hidden[:, 2 * d:3 * d], hidden[:, 3 * d:], rtol=0, atol=0)


def test_taps_leave_logits_and_cache_unchanged(k3):
    ids = tokens(19, seed=2)
    batch, cache = one_sequence(k3, ids)
    plain = k3(batch, cache)
    batch2, cache2 = one_sequence(k3, ids)
    logits, _ = forward_with_taps(k3, batch2, cache2, (2, FINAL_TAP))
    assert torch.equal(plain, logits)
    for store in ("kv", "conv", "recurrent"):
        for layer, t in getattr(cache, store).items():
            assert torch.equal(t, getattr(cache2, store)[layer])


@pytest.mark.parametrize("taps", [(4,), (-2,), (1, 1)])
def test_bad_taps_are_refused(k3, taps):
    batch, cache = one_sequence(k3, tokens(3))
    with pytest.raises(TapError):
        forward_with_taps(k3, batch, cache, taps)


def test_no_taps_is_the_plain_forward(k3):
    batch, cache = one_sequence(k3, tokens(7))
    logits, hidden = forward_with_taps(k3, batch, cache, ())
    batch2, cache2 = one_sequence(k3, tokens(7))
    assert hidden is None and torch.equal(logits, k3(batch2, cache2))
