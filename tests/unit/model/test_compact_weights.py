"""engine/model/fused.py `attach_compact_weights`: a CPU model loaded from a bf16 checkpoint gets exact bf16 copies
of the weights the small-batch kernel reads (linears, fused projections, routed experts), and its logits are bitwise
those without them; an fp32 checkpoint (values off the bf16 grid) gets none; the copies are what the kernel reads
(a changed copy changes the logits)."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model
from kernels.cpu import small_gemm
from tests.unit.kernels.test_small_gemm import kernel_here


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {dtype: make_checkpoint("tiny-k3", root / dtype, seed=3, dtype=dtype) for dtype in ("bfloat16", "float32")}


def _logits(model, ids: list[int]) -> torch.Tensor:
    from tests.model_driver import SequenceDriver

    driver = SequenceDriver(model, max_seqs=1)
    driver.prefill(0, ids[:-1])
    return driver.decode(0, ids[-1])  # one row: the small-batch kernel's products


def _copies(model) -> list[str]:
    return [name for name, module in model.named_modules()
            if getattr(module, "compact_weight", None) is not None
            or getattr(module, "compact_gate_up", None) is not None]


def test_a_bf16_checkpoint_gets_exact_copies_and_the_same_logits(checkpoints, monkeypatch):
    if not kernel_here():
        return
    compact = load_model(checkpoints["bfloat16"])
    monkeypatch.setenv(small_gemm.COMPACT_ENV, "0")
    plain = load_model(checkpoints["bfloat16"])
    assert _copies(plain) == []  # the switch
    names = _copies(compact)
    assert "lm_head" in names and any(name.endswith("experts") for name in names)
    ids = [5, 17, 300, 42, 7]
    got = _logits(compact, ids)
    assert torch.equal(got, _logits(plain, ids))  # bitwise: the kernel widens the copy back exactly
    compact.lm_head.compact_weight[0, 0] += 1.0  # negative control: the copy is what the kernel reads
    assert not torch.equal(_logits(compact, ids), got)


def test_an_fp32_checkpoint_gets_no_copies(checkpoints):
    assert _copies(load_model(checkpoints["float32"])) == []


def test_compiled_experts_read_their_copies(checkpoints):
    if not kernel_here():
        return
    model = load_model(checkpoints["bfloat16"])
    moe = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "compact_gate_up"))
    experts = moe.experts
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(3, experts.w1.shape[2], generator=gen)
    ids = torch.randint(0, experts.num_experts, (3, 2), generator=gen)
    weights = torch.rand(3, 2, generator=gen)
    run = torch.compile(lambda: experts.run(z, weights, ids, moe.act), backend="eager", fullgraph=True)
    with_copies = run()
    saved = experts.compact_gate_up, experts.compact_w2
    experts.compact_gate_up = experts.compact_w2 = None
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda: experts.run(z, weights, ids, moe.act), backend="eager")(), with_copies)
    experts.compact_gate_up, experts.compact_w2 = saved[0].clone(), saved[1]
    experts.compact_gate_up[ids[0, 0]] *= 2  # negative control: the copy is what the compiled step reads
    torch._dynamo.reset()
    assert not torch.equal(torch.compile(lambda: experts.run(z, weights, ids, moe.act), backend="eager")(),
                           with_copies)


def test_the_copies_go_onto_huge_pages_beside_the_weights(checkpoints):
    from engine.model import huge_pages

    if not kernel_here() or huge_pages.huge_pages_unavailable() is not None:
        return
    model = load_model(checkpoints["bfloat16"])
    weights_arena = model.lm_head.weight.untyped_storage().data_ptr()
    copies_arena = model.lm_head.compact_weight.untyped_storage().data_ptr()
    assert {weights_arena, copies_arena} <= huge_pages._ARENAS
    assert copies_arena != weights_arena  # the second placement moved only the copies
