"""Triton routed experts (kernels/moe/triton_fused.py) in the CPU interpreter, against the torch paths: dense and
packed MXFP4 weights, fp32 and bf16, experts with no tokens, ids of other ranks' experts, and the host-sync-free
alignment. The checks run in a `TRITON_INTERPRET=1` child process (tests/triton_child.py says why).
"""

from __future__ import annotations

import importlib

import torch

from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import moe_experts_grouped
from kernels.moe.mxfp4 import MXFP4Weight, dequantize, moe_experts_mxfp4
from kernels.moe.router import route
from kernels.registry import _IMPLS
from tests.triton_child import ChildChecks
from tests.unit.kernels.test_mxfp4 import _packed_experts

SITU = GatedActivation("situ", beta=4.0, linear_beta=25.0)
SWIGLU = GatedActivation("silu")


def _fused():
    return importlib.import_module("kernels.moe.triton_fused")


def _inputs(T: int, E: int, k: int, D: int = 64, I: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w1, w3, w2 = _packed_experts(E, I, D, gen, fused=True)
    x = torch.randn(T, D, generator=gen)
    weights, ids = route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1, 1, True, 2.446)
    return x, (w1, w3, w2), weights, ids


def check_mxfp4_matches_torch():
    for T, E in ((7, 4), (2, 8)):  # the second leaves most experts without tokens
        x, (w1, w3, w2), weights, ids = _inputs(T, E, 2)
        out = _fused().moe_experts_mxfp4(x, w1, w3, w2, weights, ids, SITU)
        torch.testing.assert_close(out, moe_experts_mxfp4(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)


def check_dense_matches_grouped():
    x, packed, weights, ids = _inputs(9, 4, 2, seed=1)
    w1, w3, w2 = (dequantize(w.packed, w.scale) for w in packed)
    out = _fused().moe_experts_dense(x, w1, w3, w2, weights, ids, SWIGLU)
    torch.testing.assert_close(out, moe_experts_grouped(x, w1, w3, w2, weights, ids, SWIGLU), atol=1e-5, rtol=1e-5)


def check_mxfp4_bf16():
    x, (w1, w3, w2), weights, ids = _inputs(5, 4, 2, seed=2)
    out = _fused().moe_experts_mxfp4(x.bfloat16(), w1, w3, w2, weights, ids, SITU)
    assert out.dtype == torch.bfloat16
    ref = moe_experts_mxfp4(x, w1, w3, w2, weights, ids, SITU)
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


def check_ids_of_other_ranks_add_nothing():
    x, (w1, w3, w2), weights, ids = _inputs(6, 4, 2, seed=3)
    local = ids - 2  # this rank holds experts 2, 3 of 4: ids 0, 1 become -2, -1
    halves = [MXFP4Weight(w.packed[2:], w.scale[2:]) for w in (w1, w3, w2)]
    out = _fused().moe_experts_mxfp4(x, *halves, weights, local, SITU)
    torch.testing.assert_close(out, moe_experts_mxfp4(x, *halves, weights, local, SITU), atol=1e-5, rtol=1e-5)


def check_align_pads_each_expert_to_blocks():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])  # expert 5 is not on this rank (E = 4)
    sorted_ids, block_expert = _fused().align(ids, 4, 4)
    assert sorted_ids.numel() == 20 and block_expert.tolist() == [0, 2, -1, -1, -1]
    assert sorted_ids[:4].tolist() == [1, 4, 6, 6] and sorted_ids[4:8].tolist() == [0, 2, 5, 6]
    assert (sorted_ids[8:] == 6).all()  # padding: T*k, never a real assignment


def check_registry_targets_resolve():
    for op in ("moe_experts", "moe_experts_mxfp4"):
        module_name, func_name = _IMPLS[op]["triton"].split(":")
        assert callable(getattr(importlib.import_module(module_name), func_name))


TRITON_CHECKS = ChildChecks(__name__, timeout_s=300)
TRITON_CHECKS.checks.update({name: fn for name, fn in globals().items() if name.startswith("check_")})
test_triton_interpreted = TRITON_CHECKS.pytest_test()  # one test per check, all run in one interpreter child
