"""The K3 MTP drafter: its math against a plain-torch oracle, its cache under rollback, the contract, loading."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import CheckpointError, load_model
from engine.spec.capture import forward_with_taps
from engine.spec.drafter import FINAL_TAP, DraftQuery
from engine.spec.mtp import MTPDrafter, build_mtp_drafter
from engine.spec.mtp_model import MTPError, load_mtp_layers
from tests.unit.engine.spec.drafters.conftest import SEED, one_sequence, tokens
from tests.unit.engine.spec.drafters.naive import naive_mtp_logits


def _spec(k=3, method="greedy"):
    return SimpleNamespace(num_speculative_tokens=k, model=None, draft_sample_method=method)


@pytest.fixture(scope="module")
def drafter(k3, k3_dir):
    return build_mtp_drafter(k3, k3_dir, _spec())


@pytest.fixture(scope="module")
def seq(k3):
    ids = tokens(24, seed=3)
    batch, cache = one_sequence(k3, ids)
    _, hidden = forward_with_taps(k3, batch, cache, (FINAL_TAP,))
    return ids, hidden


def test_forward_train_matches_naive_oracle(drafter, seq):
    ids, hidden = seq
    layer = drafter.layer
    ours = layer.forward_train(hidden, torch.tensor(ids))
    torch.testing.assert_close(ours, naive_mtp_logits(layer, hidden, torch.tensor(ids)), rtol=1e-4, atol=1e-4)
    assert ours.shape == (len(ids) - 1, layer.config.vocab_size)
    # negative control: the same oracle without the causal mask disagrees
    assert not torch.allclose(ours, naive_mtp_logits(layer, hidden, torch.tensor(ids), causal=False), atol=1e-3)


def test_first_draft_is_the_training_forward_argmax(drafter, seq):
    ids, hidden = seq
    p = 15
    drafter.observe("r", 0, ids[:10], hidden[:10])
    drafter.observe("r", 10, ids[10:p], hidden[10:p])
    draft = drafter.propose([DraftQuery("r", ids[: p + 1], 3)])[0]
    logits = drafter.layer.forward_train(hidden[: p + 1], torch.tensor(ids[: p + 1]))  # rows 0..p-1
    assert draft.tokens[0] == int(logits[-1].argmax())
    assert len(draft.tokens) == 3 and draft.probs is None
    assert drafter.propose([DraftQuery("r", ids[: p + 1], 3)])[0] == draft  # deterministic
    assert len(drafter.propose([DraftQuery("r", ids[: p + 1], 2)])[0].tokens) == 2
    assert drafter.propose([DraftQuery("r", ids[: p + 2], 3)])[0].tokens == ()  # p not observed up to p - 1
    drafter.release("r")
    assert "r" not in drafter.requests


def assert_same_rows(got, want):
    """Rows computed in calls of other sizes (chunks vs one call): MKL's fp32 products round a row differently with
    the call's row count on an Intel AVX-512 CPU (up to ~1e-6 here), so equal within 1e-5, not bitwise; a wrong
    or stale row differs by orders more."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cut", [12, 11, 10])
def test_rollback_equals_a_fresh_run(k3, k3_dir, seq, cut):
    ids, hidden = seq
    a, b = (build_mtp_drafter(k3, k3_dir, _spec()) for _ in range(2))
    a.observe("r", 0, ids[:9], hidden[:9])
    a.observe("r", 9, ids[9:13], hidden[9:13])
    a.rollback("r", cut)
    b.observe("r", 0, ids[:cut], hidden[:cut])
    sa, sb = a.requests["r"], b.requests["r"]
    assert (sa.base, sa.end) == (sb.base, sb.end)
    assert_same_rows(a.cached_rows("r"), b.cached_rows("r"))
    kept = a.held_hidden("r")
    torch.testing.assert_close(kept, b.held_hidden("r")[-kept.shape[0]:], rtol=0, atol=0)
    q = [DraftQuery("r", ids[: cut + 1], 3)]
    assert a.propose(q) == b.propose(q)
    a.observe("r", cut, ids[cut:20], hidden[cut:20])
    b.observe("r", cut, ids[cut:20], hidden[cut:20])
    assert_same_rows(a.cached_rows("r"), b.cached_rows("r"))
    a.rollback("r", 0)
    assert "r" not in a.requests


def test_rollback_past_the_kept_hidden_forgets(k3, k3_dir, seq):
    ids, hidden = seq
    d = build_mtp_drafter(k3, k3_dir, _spec(k=3))  # keeps the hidden of the last 4 observed positions
    d.observe("r", 0, ids[:13], hidden[:13])
    d.rollback("r", 9)  # needs h_8: gone
    assert "r" not in d.requests and d.propose([DraftQuery("r", ids[:10], 3)])[0].tokens == ()
    d.observe("r", 9, ids[9:14], hidden[9:14])  # drafts again from what it observes next
    assert len(d.propose([DraftQuery("r", ids[:15], 3)])[0].tokens) == 3


def test_probabilistic_drafts_carry_their_distribution(k3, k3_dir, seq):
    ids, hidden = seq
    runs = []
    for _ in range(2):
        d = build_mtp_drafter(k3, k3_dir, _spec(4, "probabilistic"))
        d.observe("r", 0, ids[:12], hidden[:12])
        runs.append(d.propose([DraftQuery("r", ids[:13], 4)])[0])
    assert runs[0].tokens == runs[1].tokens  # seeded by (request, position)
    probs = runs[0].probs
    assert probs.shape == (4, k3.config.vocab_size) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert all(probs[i, t] > 0 for i, t in enumerate(runs[0].tokens))


def test_text_only_folder_loads_and_refuses_mtp(tmp_path):
    folder = make_checkpoint("tiny-k3", tmp_path / "plain", seed=SEED, text_overrides={"num_nextn_predict_layers": 0})
    model = load_model(folder)
    with pytest.raises(MTPError, match="num_nextn_predict_layers"):
        build_mtp_drafter(model, folder, _spec())


def test_mtp_weights_do_not_change_the_target(tmp_path, k3_dir):
    plain = make_checkpoint("tiny-k3", tmp_path / "plain", seed=SEED, text_overrides={"num_nextn_predict_layers": 0})
    with safe_open(str(plain / "model.safetensors"), "pt") as a, safe_open(str(k3_dir / "model.safetensors"), "pt") as b:
        extra = sorted(set(b.keys()) - set(a.keys()))
        assert extra and all(n.startswith("language_model.model.layers.4.") for n in extra)
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_missing_mtp_tensor_is_named(tmp_path, k3_dir):
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(k3_dir, folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not n.endswith("layers.4.eh_proj.weight")}
    save_file(tensors, str(path))
    model = load_model(folder)  # the target itself does not need them
    with pytest.raises(CheckpointError, match="eh_proj"):
        build_mtp_drafter(model, folder, _spec())


def test_taps_and_type(drafter):
    assert isinstance(drafter, MTPDrafter) and drafter.taps == (FINAL_TAP,)


def test_forward_train_trains(k3, k3_dir, seq):
    """The training form (unbound weights, as trainer/distill.py builds them): every weight gets a gradient."""
    ids, hidden = seq
    layer = load_mtp_layers(k3, k3_dir, gemv_layout=False)[0].requires_grad_(True)
    logits = layer.forward_train(hidden.clone(), torch.tensor(ids))[:-1]  # the last row's target is past the end
    torch.nn.functional.cross_entropy(logits, torch.tensor(ids[2:])).backward()
    no_grad = [n for n, p in layer.named_parameters() if p.grad is None]
    assert no_grad == ["block_sparse_moe.gate.e_score_correction_bias"]  # selection only, as in DeepSeek's router
