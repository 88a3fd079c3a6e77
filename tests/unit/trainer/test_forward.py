"""The trainer's differentiable forward computes the engine's function: its logits on the engine's loaded model equal
the engine's cached forward (fp32), its chunked KDA equals the token-by-token oracle, and gradients flow."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import LoadConfig, load_model
from kernels.kda.naive import kda_naive
from tests.model_driver import SequenceDriver, rel_err, torch_threads
from trainer.forward import chunk_kda_train, train_forward
from trainer.train import build_model

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    with torch_threads(1):
        folder = make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=3)
        yield load_model(folder, LoadConfig(dtype="float32"))


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, 7900, (rows, length), generator=torch.Generator().manual_seed(5))


def test_training_logits_equal_the_engine_forward(tiny_model):
    ids = _ids(2, 37)  # not a multiple of the KDA chunk
    driver = SequenceDriver(tiny_model, max_seqs=2, max_len=64)
    engine = torch.stack([driver.prefill(i, ids[i].tolist()) for i in range(2)])  # [2, T, V]
    with torch.no_grad():
        ours = train_forward(tiny_model, ids).logits
    assert rel_err(ours, engine) <= REL_TOL


def test_negative_control_a_changed_weight_is_seen(tiny_model):
    """The comparison can fail: scaling one KDA layer's output projection in the trained copy breaks equality."""
    ids = _ids(1, 20)
    engine = SequenceDriver(tiny_model, max_seqs=1, max_len=32).prefill(0, ids[0].tolist())
    proj = tiny_model.model.layers[0].self_attn.o_proj.weight
    saved = proj.detach().clone()
    try:
        with torch.no_grad():
            proj.mul_(1.5)
            ours = train_forward(tiny_model, ids).logits[0]
    finally:
        with torch.no_grad():
            proj.copy_(saved)
    assert rel_err(ours, engine) > 100 * REL_TOL


def test_chunked_kda_equals_the_oracle_with_k3_gates():
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 2, 45, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, t, h, d, generator=gen)
    g = -5.0 * torch.rand(b, t, h, d, generator=gen)  # K3's bounded gate: (-5, 0), strongest decays included
    beta = torch.rand(b, t, h, generator=gen)
    ours = chunk_kda_train(q, k, v, g, beta, 0.35)
    for row in range(b):
        ref, _ = kda_naive(q[row], k[row], v[row], g[row], beta[row], 0.35)
        assert rel_err(ours[row], ref) <= 1e-5


def test_gradients_reach_every_trained_parameter():
    from engine.model.presets import demo_k3_config

    model = build_model(demo_k3_config(tiny=True), seed=0)
    loss = train_forward(model, _ids(2, 24)).logits.logsumexp(-1).mean()
    loss.backward()
    missing = {n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())}
    # layer 0 has no earlier block to mix (the official code never reads these either)
    assert missing == {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
