"""Triton causal conv1d + SiLU over a pooled conv-window state (prefill and decode).

Contract: identical to `kernels.conv.torch_ops` (same signatures, same in-place pool updates, fp32 arithmetic,
`y` in `x.dtype`, windows in the pool's dtype). Runs on CUDA/ROCm, and on CPU under `TRITON_INTERPRET=1` (tests).

Prefill launches two kernels in order: `_conv_prefill_kernel` (one program per (token block, channel block)) reads
initial windows from the pool, then `_conv_window_kernel` (one program per (sequence, channel block)) overwrites
each window with the final one, so no program reads a window another program has already replaced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_C = 64


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, pool_ptr, y_ptr,
    seq_of_token_ptr, seq_start_ptr, slot_ptr,
    T, C,
    stride_x, stride_w, stride_ps, stride_pc, stride_y,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    tok_ok = tok < T
    ch_ok = ch < C
    seq = tl.load(seq_of_token_ptr + tok, mask=tok_ok, other=0)  # [BT]
    pos = tok - tl.load(seq_start_ptr + seq, mask=tok_ok, other=0)  # position within its sequence
    slot = tl.load(slot_ptr + seq, mask=tok_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = pos - (W - 1) + j  # [BT]: position of tap j; negative means "from the window"
        in_seq = src >= 0
        m_x = (tok_ok & in_seq)[:, None] & ch_ok[None, :]
        xv = tl.load(x_ptr + (tok - (W - 1) + j)[:, None].to(tl.int64) * stride_x + ch[None, :], mask=m_x, other=0.0)
        win_idx = pos + j  # window column when src < 0
        m_w = (tok_ok & (src < 0))[:, None] & ch_ok[None, :]
        wv = tl.load(pool_ptr + slot[:, None] * stride_ps + ch[None, :] * stride_pc + win_idx[:, None],
                     mask=m_w, other=0.0)
        tap = tl.load(w_ptr + ch * stride_w + j, mask=ch_ok, other=0.0).to(tl.float32)  # [BC]
        acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
    out = acc * tl.sigmoid(acc)
    mask = tok_ok[:, None] & ch_ok[None, :]
    tl.store(y_ptr + tok[:, None].to(tl.int64) * stride_y + ch[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_window_kernel(
    x_ptr, pool_ptr, cu_ptr, slot_ptr,
    C, stride_x, stride_ps, stride_pc,
    W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    k = tl.arange(0, BLOCK_K)  # [BK] window columns (BLOCK_K >= W-1)
    ch_ok = ch < C
    k_ok = k < W - 1
    start = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    src = length - (W - 1) + k  # [BK] sequence position of final column k; negative means "old window"
    base = pool_ptr + slot * stride_ps + ch[:, None] * stride_pc
    m_x = (k_ok & (src >= 0))[None, :] & ch_ok[:, None]
    m_w = (k_ok & (src < 0))[None, :] & ch_ok[:, None]
    xv = tl.load(x_ptr + (start + src)[None, :].to(tl.int64) * stride_x + ch[:, None], mask=m_x, other=0.0)
    wv = tl.load(base + (length + k)[None, :], mask=m_w, other=0.0)  # old column length+k
    new = tl.where(m_x, xv.to(tl.float32), wv.to(tl.float32))  # [BC, BK]
    tl.debug_barrier()  # no thread overwrites a column another thread has yet to read
    tl.store(base + k[None, :], new.to(pool_ptr.dtype.element_ty), mask=k_ok[None, :] & ch_ok[:, None])


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, pool_ptr, y_ptr, slot_ptr,
    C, stride_x, stride_w, stride_ps, stride_pc, stride_y,
    W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    k = tl.arange(0, BLOCK_K)  # [BK]
    ch_ok = ch < C
    k_ok = k < W - 1
    slot = tl.load(slot_ptr + n).to(tl.int64)
    base = pool_ptr + slot * stride_ps + ch[:, None] * stride_pc
    m2 = ch_ok[:, None] & k_ok[None, :]
    win = tl.load(base + k[None, :], mask=m2, other=0.0).to(tl.float32)  # [BC, BK] oldest first
    xv = tl.load(x_ptr + n.to(tl.int64) * stride_x + ch, mask=ch_ok, other=0.0).to(tl.float32)  # [BC]
    taps = tl.load(w_ptr + ch[:, None] * stride_w + k[None, :], mask=m2, other=0.0).to(tl.float32)
    last = tl.load(w_ptr + ch * stride_w + (W - 1), mask=ch_ok, other=0.0).to(tl.float32)
    # Shift: column k takes old column k+1; the last column takes x. Everything is loaded before any store.
    nxt = tl.load(base + (k + 1)[None, :], mask=ch_ok[:, None] & (k < W - 2)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(win * taps, axis=1) + xv * last  # [BC]
    shifted = tl.where((k == W - 2)[None, :], xv[:, None], nxt)
    tl.debug_barrier()  # no thread overwrites a column another thread has yet to read
    tl.store(y_ptr + n.to(tl.int64) * stride_y + ch, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=ch_ok)
    tl.store(base + k[None, :], shifted.to(pool_ptr.dtype.element_ty), mask=m2)


def _check(weight: torch.Tensor, conv_state_pool: torch.Tensor) -> int:
    W = weight.shape[1]
    if W < 2:
        raise ValueError("conv kernel width must be >= 2")
    if conv_state_pool.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError("conv_state_pool and weight must be contiguous in their last dim")
    return W


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                          state_indices: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    T, C = x.shape
    W = _check(weight, conv_state_pool)
    x = x.contiguous()
    N = state_indices.numel()
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)  # [T]
    slots = state_indices.to(torch.int64).contiguous()
    y = torch.empty_like(x)
    if T > 0:
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))
        _conv_prefill_kernel[grid](
            x, weight, conv_state_pool, y, seq_of_token, cu, slots,
            T, C, x.stride(0), weight.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), y.stride(0),
            W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
        )
    if N > 0:
        _conv_window_kernel[(N, triton.cdiv(C, BLOCK_C))](
            x, conv_state_pool, cu, slots,
            C, x.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1),
            W=W, BLOCK_K=triton.next_power_of_2(W - 1), BLOCK_C=BLOCK_C,
        )
    return y


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                         state_indices: torch.Tensor, state_slots: slice | None = None) -> torch.Tensor:
    """`state_slots` (the torch op's in-place hint) is not needed: the kernel indexes the pool directly."""
    N, C = x.shape
    W = _check(weight, conv_state_pool)
    x = x.contiguous()
    slots = state_indices.to(torch.int64).contiguous()
    y = torch.empty_like(x)
    if N > 0:
        _conv_decode_kernel[(N, triton.cdiv(C, BLOCK_C))](
            x, weight, conv_state_pool, y, slots,
            C, x.stride(0), weight.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), y.stride(0),
            W=W, BLOCK_K=triton.next_power_of_2(W - 1), BLOCK_C=BLOCK_C,
        )
    return y
