"""Triton routed experts: grouped GEMMs over expert-sorted, block-padded assignments, with no host sync.

Contract: `moe_experts_dense(x, w1, w3, w2, topk_weights, topk_ids, act)` is the `moe_experts` op and
`moe_experts_mxfp4(x, w1, w3, w2, ...)` (`kernels.moe.mxfp4.MXFP4Weight`s) the `moe_experts_mxfp4` op, with the
results of kernels/moe/naive.py (ids outside `[0, E)` add nothing) up to rounding. fp32, bf16 and fp16 inputs; fp32
products run at IEEE precision (no TF32). On CPU they run only under `TRITON_INTERPRET=1` (tests); there every
product is computed in fp32, because the interpreter's bf16/fp16 `tl.dot` returns garbage (Triton 3.9).

Design (after vLLM's fused_moe): `align` sorts the T·k assignments by expert and pads each expert's run to a multiple
of BLOCK_M, entirely with tensor ops on the device — the padded length has a static bound `T·k + E·(BLOCK_M − 1)`,
so the launch grid is known without reading any count back. One program computes a [BLOCK_M, BLOCK_N] tile of one
expert's output (`block_expert[m]`, −1 for blocks past the end: the program exits). The first GEMM reads x rows
(assignment // k) against w1|w3 as one `[E, 2I, D]` weight; the activation runs on its `[T·k, 2I]` output; the
second GEMM multiplies by w2 and the routing weight and writes each assignment's row; rows are summed per token in
fp32. MXFP4 weights are decoded inside the K loop, tile by tile: the packed bytes of a [BLOCK_N, BLOCK_K] tile are
split into their low/high nibbles (interleaved: low first), mapped to e2m1 values, and scaled by `2^(s − 127)` per 32
columns — the full-precision weight never exists in memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import gate_up_storage
from kernels.moe.mxfp4 import GROUP, MXFP4Weight

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _e2m1_tile(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/2] uint8 -> [BLOCK_N, BLOCK_K] fp32 e2m1 values (low nibble first)."""
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.int32)  # [BN, BK]
    idx = codes & 7
    normal = tl.exp2(((idx >> 1) - 1).to(tl.float32)) * (1.0 + 0.5 * (idx & 1).to(tl.float32))  # idx 2..7
    magnitude = tl.where(idx >= 2, normal, 0.5 * idx.to(tl.float32))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, s_ptr, out_ptr, rw_ptr, sorted_ptr, block_expert_ptr,
    N, K, num_ids, a_row_div,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MXFP4: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] assignment ids
    row_ok = ids < num_ids
    rows = ids // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :],
                    other=0.0)  # [BM, BK]
        if MXFP4:
            offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_h[None, :],
                             mask=n_ok[:, None] & (offs_h < K // 2)[None, :], other=0)  # [BN, BK/2]
            offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            scale = tl.load(s_ptr + expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :],
                            mask=n_ok[:, None] & (offs_g < K // 32)[None, :], other=127)  # [BN, BK/32]
            factor = tl.exp2(scale.to(tl.float32) - 127.0)
            w = tl.reshape(_e2m1_tile(packed, BLOCK_N, BLOCK_K), (BLOCK_N, BLOCK_K // 32, 32)) * factor[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(a.dtype)
        else:
            w = tl.load(b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :],
                        mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # [BN, BK]
        if IEEE:  # fp32 inputs, or the interpreter (whose bf16/fp16 tl.dot is wrong): an fp32 IEEE product
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if MUL_WEIGHT:
        acc = acc * tl.load(rw_ptr + ids, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + ids[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] int64: assignment ids by expert, each expert's run padded to block_m with T·k,
    block_expert [P / block_m] int64: the expert of each block, −1 past the end); P = T·k + E·(block_m − 1),
    rounded up to block_m. Tensor ops only (no host sync)."""
    flat = topk_ids.reshape(-1)
    total, device = flat.numel(), flat.device
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # [T*k], E = not on this rank
    # [E]; a scatter-add, not `bincount`, which reads its input's max back to the host on CUDA (a sync, and a
    # failure inside CUDA graph capture: bench/gpu_validate.py on an H200)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)  # [E]
    order = torch.argsort(key, stable=True)  # [T*k]
    sorted_key = key[order].clamp_max(num_experts - 1)
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E]
    dest = (padded_ends - (counts + block_m - 1) // block_m * block_m)[sorted_key] + (
        torch.arange(total, device=device) - first_of_expert[sorted_key])
    capacity = -(-(total + num_experts * (block_m - 1)) // block_m) * block_m
    dest = torch.where(key[order] < num_experts, dest, capacity)  # off-rank assignments land in a dropped slot
    sorted_ids = torch.full((capacity + 1,), total, dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_ids[:capacity], torch.where(block_expert < num_experts, block_expert, -1)


def _gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None, sorted_ids, block_expert, num_ids: int,
          a_row_div: int, n: int, k: int, routing: torch.Tensor | None, out_dtype: torch.dtype,
          block_m: int) -> torch.Tensor:
    """out [num_ids, n]: row i = (a[i // a_row_div] @ b[expert(i)]^T) (× routing[i]); b [E, n, k] or packed."""
    out = torch.zeros(num_ids, n, dtype=out_dtype, device=a.device)
    block_n, block_k = 64, 64 if k % 64 == 0 else GROUP
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    s = scale if scale is not None else b
    _moe_gemm_kernel[grid](
        a, b, s, out, routing if routing is not None else out, sorted_ids, block_expert,
        n, k, num_ids, a_row_div,
        a.stride(0), b.stride(0), b.stride(1), s.stride(0), s.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MXFP4=scale is not None,
        MUL_WEIGHT=routing is not None, IEEE=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1")
    return out


def _fused(x, gate_up, gate_up_scale, down, down_scale, inter, width, topk_weights, topk_ids, act):
    if x.dtype not in DTYPES:
        raise TypeError(f"triton MoE supports {DTYPES}, got {x.dtype} (use the torch backend)")
    T, D = x.shape
    k = topk_ids.shape[1]
    block_m = 16 if T * k <= 256 else 64
    sorted_ids, block_expert = align(topk_ids, gate_up.shape[0], block_m)
    x = x.contiguous()
    h = _gemm(x, gate_up, gate_up_scale, sorted_ids, block_expert, T * k, k, 2 * inter, D, None, x.dtype,
              block_m)  # [T*k, 2I]
    hidden = act(h[:, :inter], h[:, inter:]).contiguous()  # [T*k, I]
    routing = topk_weights.to(torch.float32).reshape(-1).contiguous()
    out = _gemm(hidden, down, down_scale, sorted_ids, block_expert, T * k, 1, width, inter, routing,
                torch.float32, block_m)  # [T*k, D] weighted
    return out.view(T, k, width).sum(1).to(x.dtype)


def moe_experts_dense(x, w1, w3, w2, topk_weights, topk_ids, act: GatedActivation) -> torch.Tensor:
    gate_up = gate_up_storage(w1, w3)
    if gate_up is None:
        gate_up = torch.cat([w1, w3], dim=1)
    return _fused(x, gate_up.contiguous(), None, w2.contiguous(), None, w1.shape[1], w2.shape[1], topk_weights,
                  topk_ids, act)


def moe_experts_mxfp4(x, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight, topk_weights, topk_ids,
                      act: GatedActivation) -> torch.Tensor:
    packed, scale = gate_up_storage(w1.packed, w3.packed), gate_up_storage(w1.scale, w3.scale)
    if packed is None or scale is None:
        packed, scale = torch.cat([w1.packed, w3.packed], dim=1), torch.cat([w1.scale, w3.scale], dim=1)
    return _fused(x, packed.contiguous(), scale.contiguous(), w2.packed.contiguous(), w2.scale.contiguous(),
                  w1.packed.shape[1], w2.packed.shape[1], topk_weights, topk_ids, act)
