"""Triton MLA attention over a paged latent cache (absorbed form: MQA with one shared KV head).

Contract: same signature and result as `kernels.attention.torch_paged.mla_paged_attention` (see
`kernels.attention.naive` for the exact semantics). Runs on CUDA/ROCm and on CPU under `TRITON_INTERPRET=1`.

Work split: a "tile" is up to BLOCK_M consecutive query tokens of one sequence; one program handles one tile and
BLOCK_H heads, i.e. BLOCK_M·BLOCK_H query rows that all share the same keys (MQA), so each key block is loaded once
per program. The program walks the sequence's block table BLOCK_N positions at a time with an online softmax
(fp32), reading only positions below the tile's last query position + 1 (never past `seq_lens[n]`). The tile table
is built on the device from `cu_seqlens_q` with an upper bound on the tile count, so there is no host sync.
Queries and cache normally share a dtype; if they differ the cache is cast to the query dtype inside the kernel. An
FP8 cache (`kernels.attention.fp8_latent`: uint8 rows of e4m3 values and a per-token fp32 scale) is read through
an fp8 view and an fp32 view of the same rows and dequantised per loaded tile (fp32, then the dot's dtype). Dots
take bf16/fp16 operands on GPUs (fp32 accumulation) and fp32 operands (exact, `input_precision="ieee"`, no TF32) for
fp32 inputs and under the CPU interpreter (whose bf16 `tl.dot` is wrong). Untuned: block sizes are first guesses,
not yet measured on a GPU, and there is no split-KV, so a small decode batch at long context uses few programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_latent import is_fp8_cache

BLOCK_N = 32  # keys per inner step
ROWS = 32  # query rows (tokens x heads) per program


@triton.jit
def _fp8_dequantise(c, kr, scale_ptr, row, width, k_ok):
    """An FP8 tile times each key's scale: the fp32 after the row's `width` e4m3 values (`row`: the row's byte
    offset; rows are 4-byte aligned, so the scale is fp32 element (row + width) / 4)."""
    sc = tl.load(scale_ptr + (row + width) // 4, mask=k_ok, other=0.0)  # [BN]
    return c.to(tl.float32) * sc[:, None], kr.to(tl.float32) * sc[:, None]


@triton.jit
def _mla_paged_kernel(
    q_ptr, kv_ptr, scale_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, tile_seq_ptr, tile_start_ptr, o_ptr,
    scale, H, V, R, block_size,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_bt, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, DOT_FP32: tl.constexpr, FP8: tl.constexpr,
):
    g = tl.program_id(0)
    hb = tl.program_id(1)
    n = tl.load(tile_seq_ptr + g)
    m0 = tl.load(tile_start_ptr + g)  # first query index (within the sequence) of this tile
    q_start = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + n)
    first = seq_len - q_len  # position of the sequence's first query

    r = tl.arange(0, BLOCK_M * BLOCK_H)
    m = m0 + r // BLOCK_H  # [ROWS] query index within the sequence
    h = hb * BLOCK_H + r % BLOCK_H  # [ROWS] head
    row_ok = (m < q_len) & (h < H)
    pos = first + m  # [ROWS] query position
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    q_row = q_ptr + (q_start + m).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_row + dv[None, :], mask=row_ok[:, None] & (dv < V)[None, :], other=0.0)  # [ROWS, DV]
    q_r = tl.load(q_row + V + dr[None, :], mask=row_ok[:, None] & (dr < R)[None, :], other=0.0)  # [ROWS, DR]
    if DOT_FP32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    m_i = tl.full((BLOCK_M * BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M * BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_H, BLOCK_DV), dtype=tl.float32)
    k_end = tl.where(m0 < q_len, first + tl.minimum(m0 + BLOCK_M, q_len), 0)  # keys [0, k_end) are needed
    for k0 in range(0, k_end, BLOCK_N):
        kp = k0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        k_ok = kp < k_end
        blk = tl.load(bt_ptr + n.to(tl.int64) * stride_bt + kp // block_size, mask=k_ok, other=0).to(tl.int64)
        entry = kv_ptr + blk * stride_kb + (kp % block_size).to(tl.int64) * stride_ks  # [BN]
        c = tl.load(entry[:, None] + dv[None, :], mask=k_ok[:, None] & (dv < V)[None, :], other=0.0)
        kr = tl.load(entry[:, None] + V + dr[None, :], mask=k_ok[:, None] & (dr < R)[None, :], other=0.0)
        if FP8:
            c, kr = _fp8_dequantise(c, kr, scale_ptr, blk * stride_kb + (kp % block_size).to(tl.int64) * stride_ks,
                                    V + R, k_ok)
        c = c.to(q_c.dtype)
        s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
        s += tl.dot(q_r, tl.trans(kr.to(q_r.dtype)), input_precision="ieee")  # [ROWS, BN] fp32
        s = s * scale
        visible = (kp[None, :] <= pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = o_ptr + (q_start + m).to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh
    tl.store(o_row + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < V)[None, :])


def _tile_table(cu_seqlens_q: torch.Tensor, block_m: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_seq [G], tile_start [G]) for G = num_tiles ≥ the real tile count; spare tiles get start 2**30."""
    cu = cu_seqlens_q.to(torch.int64)
    tiles = (cu[1:] - cu[:-1] + block_m - 1) // block_m  # [N]
    tile_cu = torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)])  # [N+1]
    g = torch.arange(num_tiles, device=cu.device)
    seq = torch.searchsorted(tile_cu, g, right=True) - 1  # [G]
    valid = g < tile_cu[-1]
    seq = torch.where(valid, seq, 0)
    start = torch.where(valid, (g - tile_cu[seq]) * block_m, 1 << 30)
    return seq.to(torch.int32).contiguous(), start.to(torch.int32).contiguous()


def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, v_dim: int,
                        host: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`host` (the torch op's host copy of cu_seqlens_q / seq_lens) is not needed here."""
    T, H, Dk = q.shape
    N = seq_lens.numel()
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dim")
    fp8 = is_fp8_cache(kv_cache)
    values = kv_cache.view(torch.float8_e4m3fn) if fp8 else kv_cache  # FP8 rows: e4m3 values ...
    scales = kv_cache.view(torch.float32) if fp8 else kv_cache  # ... and their fp32 scales, same storage
    decode_only = T == N  # typically one query per sequence: tile by heads only (any tiling is correct)
    block_h = max(16, min(ROWS, triton.next_power_of_2(H))) if decode_only else min(16, triton.next_power_of_2(H))
    block_m = 1 if decode_only else max(1, ROWS // block_h)
    num_tiles = triton.cdiv(T, block_m) + N
    tile_seq, tile_start = _tile_table(cu_seqlens_q, block_m, num_tiles)
    block_tables = block_tables.to(torch.int32).contiguous()
    grid = (num_tiles, triton.cdiv(H, block_h))
    _mla_paged_kernel[grid](
        q, values, scales, block_tables, cu_seqlens_q.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        tile_seq, tile_start, out,
        scale, H, v_dim, Dk - v_dim, kv_cache.shape[1],
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), BLOCK_DR=max(16, triton.next_power_of_2(Dk - v_dim)),
        DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",  # the CPU interpreter mis-multiplies bf16 dots
        FP8=fp8,
        num_warps=8 if v_dim >= 256 else 4,
    )
    return out
