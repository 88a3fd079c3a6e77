"""Causal conv1d + SiLU: torch and Triton (interpreter) paths against the naive oracle, pooled windows in place."""

import pytest
import torch

from kernels.conv import torch_ops
from kernels.conv.naive import causal_conv1d_naive
from tests import triton_child

W = 4
LENGTHS = [5, 1, 2, 9, 0, 3, 17]  # includes sequences shorter than W-1 and an empty one


def _batch(lengths, C, pool_slots=12, dtype=torch.float32, pool_dtype=torch.float32):
    N = len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), C).to(dtype)
    weight = torch.randn(C, W)
    pool = torch.full((pool_slots, C, W - 1), float("nan"), dtype=pool_dtype)  # poisoned: unused slots stay NaN
    slots = torch.randperm(pool_slots)[:N]
    return x, weight, pool, slots, cu


def _untouched(pool, slots):
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[slots] = False
    return bool(pool[others].isnan().all())


@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_prefill_matches_naive(with_window, dtype, pool_dtype):
    x, weight, pool, slots, cu = _batch(LENGTHS, 24, dtype=dtype, pool_dtype=pool_dtype)
    init = torch.randn(len(LENGTHS), 24, W - 1).to(pool_dtype) if with_window else None
    pool[slots] = init if with_window else 0.0
    y_ref, final_ref = causal_conv1d_naive(x, weight, init, cu)
    y = torch_ops.causal_conv1d_prefill(x, weight, pool, slots, cu)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool[slots], final_ref.to(pool_dtype), atol=0, rtol=0)
    assert _untouched(pool, slots)


def test_naive_short_sequence_window_keeps_old_inputs():
    init = torch.arange(6, dtype=torch.float32).view(1, 2, 3)  # [1, C=2, W-1=3]
    x = torch.tensor([[10.0, 20.0]])
    _, final = causal_conv1d_naive(x, torch.randn(2, W), init, torch.tensor([0, 1]))
    torch.testing.assert_close(final, torch.tensor([[[1.0, 2.0, 10.0], [4.0, 5.0, 20.0]]]))


def test_naive_formula_single_sequence():
    x, weight = torch.randn(6, 3), torch.randn(3, W)
    y, _ = causal_conv1d_naive(x, weight)
    padded = torch.cat([torch.zeros(W - 1, 3), x])
    expected = torch.stack([torch.nn.functional.silu((padded[t : t + W] * weight.t()).sum(0)) for t in range(6)])
    torch.testing.assert_close(y, expected)


def _prefill_equals_decode_steps(ops):
    x, weight, pool, slots, cu = _batch([7, 2, 11], 16)
    pool[slots] = torch.randn(3, 16, W - 1)
    step_pool = pool.clone()
    y_prefill = ops.causal_conv1d_prefill(x, weight, pool, slots, cu)
    # Decode every sequence one token at a time (all sequences batched while they have tokens left).
    y_steps = torch.empty_like(y_prefill)
    for i in range(11):
        live = [n for n in range(3) if cu[n] + i < cu[n + 1]]
        rows = torch.tensor([int(cu[n]) + i for n in live])
        y_steps[rows] = ops.causal_conv1d_decode(x[rows], weight, step_pool, slots[live])
    torch.testing.assert_close(y_steps, y_prefill, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step_pool, pool, equal_nan=True)
    assert _untouched(step_pool, slots)


def test_torch_prefill_equals_decode_steps():
    _prefill_equals_decode_steps(torch_ops)


def _decode_matches_naive_and_shifts_in_place(x, weight, pool, slots, init):
    """One torch decode step from windows `init` [N, C, W-1] in `slots`: the naive result; other slots untouched."""
    pool[slots] = init
    y_ref, final_ref = causal_conv1d_naive(x, weight, init, torch.arange(len(slots) + 1))
    y = torch_ops.causal_conv1d_decode(x, weight, pool, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], final_ref, atol=0, rtol=0)
    assert _untouched(pool, slots)


def test_decode_matches_naive_and_shifts_in_place():
    x, weight, pool, slots, _ = _batch([1] * 5, 40, pool_dtype=torch.bfloat16)
    _decode_matches_naive_and_shifts_in_place(x, weight, pool, slots, torch.randn(5, 40, W - 1).to(torch.bfloat16))


def test_decode_on_consecutive_slots_shifts_the_pool_in_place():
    x, weight, pool, _, _ = _batch([1] * 4, 24)
    slots = torch.tensor([5, 6, 7, 8])  # consecutive: the in-place path
    _decode_matches_naive_and_shifts_in_place(x, weight, pool, slots, torch.randn(4, 24, W - 1))


# --- Triton checks: run in one TRITON_INTERPRET=1 child per module, reported by `test_triton_interpreted` ----------
# (tests/triton_child.py says why).

TRITON_CHECKS = triton_child.ChildChecks(__name__)
triton_check = TRITON_CHECKS.check


def _triton_conv():
    """kernels.conv.triton_ops, checked to be built for the Triton interpreter."""
    return triton_child.import_interpreted("kernels.conv.triton_ops", "_conv_decode_kernel")


def _triton_prefill_matches_torch(pool_dtype):
    x, weight, pool, slots, cu = _batch(LENGTHS, 70, pool_dtype=pool_dtype)  # C not a multiple of the block
    pool[slots] = torch.randn(len(LENGTHS), 70, W - 1).to(pool_dtype)
    ref_pool = pool.clone()
    y_ref = torch_ops.causal_conv1d_prefill(x, weight, ref_pool, slots, cu)
    y = _triton_conv().causal_conv1d_prefill(x, weight, pool, slots, cu)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    # The interpreter truncates fp32 -> bf16 (GPUs round to nearest): allow one bf16 ulp.
    ulp = 0 if pool_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=ulp, equal_nan=True)


@triton_check
def triton_prefill_matches_torch_fp32_pool():
    _triton_prefill_matches_torch(torch.float32)


@triton_check
def triton_prefill_matches_torch_bf16_pool():
    _triton_prefill_matches_torch(torch.bfloat16)


@triton_check
def triton_decode_matches_torch():
    x, weight, pool, slots, _ = _batch([1] * 4, 70)
    pool[slots] = torch.randn(4, 70, W - 1)
    ref_pool = pool.clone()
    y_ref = torch_ops.causal_conv1d_decode(x, weight, ref_pool, slots)
    y = _triton_conv().causal_conv1d_decode(x, weight, pool, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0, equal_nan=True)


@triton_check
def triton_prefill_equals_decode_steps():
    _prefill_equals_decode_steps(_triton_conv())


test_triton_interpreted = TRITON_CHECKS.pytest_test()
