"""The DSpark drafter: its math against a plain-torch oracle, its context cache under rollback, contract, folder."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.config import ConfigError
from engine.model.loader import CheckpointError
from engine.spec.capture import forward_with_taps
from engine.spec.drafter import DraftQuery
from engine.spec.dspark import build_dspark_drafter
from tests.unit.engine.spec.drafters.conftest import one_sequence, tokens
from tests.unit.engine.spec.drafters.naive import naive_dspark_logits


def _spec(folder, k=4, method="greedy"):
    return SimpleNamespace(num_speculative_tokens=k, model=str(folder), draft_sample_method=method)


@pytest.fixture(scope="module")
def drafter(k3, dspark_dir):
    return build_dspark_drafter(k3, dspark_dir, _spec(dspark_dir))


@pytest.fixture(scope="module")
def seq(k3, drafter):
    ids = tokens(26, seed=4)
    batch, cache = one_sequence(k3, ids)
    _, hidden = forward_with_taps(k3, batch, cache, drafter.taps)
    return ids, hidden


def test_forward_train_matches_naive_oracle(drafter, seq):
    ids, hidden = seq
    anchors = torch.tensor([1, 7, 20])
    ours = drafter.model.forward_train(hidden, torch.tensor(ids), anchors)
    want = naive_dspark_logits(drafter.model, hidden, torch.tensor(ids), anchors)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    # negative control: a causal block (not DSpark's non-causal one) disagrees with ours
    causal = naive_dspark_logits(drafter.model, hidden, torch.tensor(ids), anchors, causal_block=True)
    assert not torch.allclose(ours, causal, atol=1e-3)


def test_drafts_follow_the_training_forward(drafter, seq):
    ids, hidden = seq
    p = 14
    drafter.observe("r", 0, ids[:6], hidden[:6])
    drafter.observe("r", 6, ids[6:p], hidden[6:p])
    draft = drafter.propose([DraftQuery("r", ids[: p + 1], 4)])[0]
    assert len(draft.tokens) == 4 and draft.probs is None
    # teacher-forced on the drafter's own picks, the training form picks the same tokens
    forced = torch.tensor(ids[: p + 1] + list(draft.tokens) + ids[p + 5:])
    logits = drafter.model.forward_train(hidden, forced, torch.tensor([p]))[0]
    assert tuple(int(t) for t in logits.argmax(-1)) == draft.tokens
    assert drafter.propose([DraftQuery("r", ids[: p + 1], 4)])[0] == draft
    assert drafter.propose([DraftQuery("r", ids[: p + 1], 2)])[0].tokens == draft.tokens[:2]
    assert drafter.propose([DraftQuery("r", ids[:p], 4)])[0].tokens == ()  # observed past the anchor
    drafter.release("r")
    assert "r" not in drafter.requests


def assert_same_rows(got, want):
    """Rows computed in calls of other sizes (chunks vs one call): MKL's fp32 products round a row differently with
    the call's row count on an Intel AVX-512 CPU (up to ~1e-6 here), so equal within 1e-5, not bitwise; a wrong
    or stale row differs by orders more."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cut", [11, 5])
def test_rollback_equals_a_fresh_run(k3, dspark_dir, seq, cut):
    ids, hidden = seq
    a, b = (build_dspark_drafter(k3, dspark_dir, _spec(dspark_dir)) for _ in range(2))
    a.observe("r", 0, ids[:4], hidden[:4])
    a.observe("r", 4, ids[4:16], hidden[4:16])
    a.rollback("r", cut)
    b.observe("r", 0, ids[:cut], hidden[:cut])
    assert_same_rows(a.context_rows("r"), b.context_rows("r"))
    q = [DraftQuery("r", ids[: cut + 1], 4)]
    assert a.propose(q) == b.propose(q)
    a.rollback("r", 0)
    assert "r" not in a.requests


def test_probabilistic_drafts_carry_their_distribution(k3, dspark_dir, seq):
    ids, hidden = seq
    d = build_dspark_drafter(k3, dspark_dir, _spec(dspark_dir, 3, "probabilistic"))
    d.observe("r", 0, ids[:10], hidden[:10])
    draft = d.propose([DraftQuery("r", ids[:11], 3)])[0]
    assert draft.probs.shape == (3, k3.config.vocab_size)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert d.propose([DraftQuery("r", ids[:11], 3)])[0].tokens == draft.tokens


def test_folder_must_match_the_target(k3, dspark_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dspark_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["target_layer_ids"], raw["num_target_layers"] = [0, 9], 2
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        build_dspark_drafter(k3, bad, _spec(bad))


def test_missing_tensor_is_named_and_shared_weights_are_ignored(k3, dspark_dir, tmp_path):
    folder = tmp_path / "d"
    shutil.copytree(dspark_dir, folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["embed_tokens.weight"] = torch.zeros(2, 2)  # vLLM drops these; so do we
    save_file(tensors, str(path))
    build_dspark_drafter(k3, folder, _spec(folder))
    tensors.pop("markov_head.markov_w2.weight")
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="markov_w2"):
        build_dspark_drafter(k3, folder, _spec(folder))


def test_factory_forms(k3, k3_dir, dspark_dir):
    from engine.spec import dspark, mtp

    target = SimpleNamespace(model=k3, model_dir=str(k3_dir), max_num_seqs=2, compilation=None)
    assert isinstance(mtp.build(SimpleNamespace(num_speculative_tokens=2, model=None, draft_sample_method="greedy"),
                                target), mtp.MTPDrafter)
    built = dspark.build(_spec(dspark_dir, k=2), target)
    assert isinstance(built, dspark.DSparkDrafter) and built.k == 2


def test_forward_train_trains(k3, dspark_dir, seq):
    ids, hidden = seq
    model = build_dspark_drafter(k3, dspark_dir, _spec(dspark_dir)).model.requires_grad_(True)
    anchors = torch.tensor([2, 9, 17])
    logits = model.forward_train(hidden.clone(), torch.tensor(ids), anchors)  # [B, N, V]
    targets = torch.tensor(ids)[anchors[:, None] + 1 + torch.arange(4)]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fewer_drafts_than_the_trained_block_run_the_whole_block(k3, dspark_dir, seq):
    ids, hidden = seq
    full, short = (build_dspark_drafter(k3, dspark_dir, _spec(dspark_dir, k, "probabilistic")) for k in (4, 2))
    assert short.model.config.block_size == 4 and short.width == 4
    for d in (full, short):
        d.observe("r", 0, ids[:12], hidden[:12])
    want, got = full.propose([DraftQuery("r", ids[:13], 4)])[0], short.propose([DraftQuery("r", ids[:13], 2)])[0]
    assert got.tokens == want.tokens[:2]
    torch.testing.assert_close(got.probs, want.probs[:2], rtol=1e-5, atol=1e-6)
    # negative control: a block of only k tokens (vLLM's width) attends differently, so its logits differ
    ctx = short.cache.gather(short.ids([short.requests["r"].slot]), 12)
    anchor, mask = short.ids([12]), short.model.config.mask_token_id
    wide = short.model.request_blocks(anchor, short.ids([[ids[12], mask, mask, mask]]), ctx, short.ids([12]))
    narrow = short.model.request_blocks(anchor, short.ids([[ids[12], mask]]), ctx, short.ids([12]))
    assert not torch.allclose(wide[:, :2], narrow, atol=1e-4)
