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
not yet measured on a GPU.

Split-KV (decode batches, one query per sequence): the grid gains a third axis of context splits; split s of a
program walks only keys [s * split_len, (s + 1) * split_len) of its sequence and writes its normalised partial
output and log-sum-exp (fp32) to scratch buffers [splits, T, H, V] / [splits, T, H]; `split_kv.merge_partials`
(torch ops, no host read) merges them per row. A split past a sequence's end walks nothing and weighs nothing. The
split count comes from shapes only — the table's width times the block size (every context's upper bound) and the
programs the batch fills unsplit (`split_kv.choose_num_splits`: few sequences at long context get many splits) —
so a captured bucket always gets the same count and its partials are sized for it. Prefill/mixed batches stay
unsplit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_latent import is_fp8_cache
from kernels.attention.split_kv import choose_num_splits, merge_partials

BLOCK_N = 32  # keys per inner step
ROWS = 32  # query rows (tokens x heads) per program


@triton.jit
def _fp8_dequantise(c, kr, scale_ptr, row, width, k_ok):
    """An FP8 tile times each key's scale: the fp32 after the row's `width` e4m3 values (`row`: the row's byte
    offset; rows are 4-byte aligned, so the scale is fp32 element (row + width) / 4)."""
    sc = tl.load(scale_ptr + (row + width) // 4, mask=k_ok, other=0.0)  # [BN]
    return c.to(tl.float32) * sc[:, None], kr.to(tl.float32) * sc[:, None]


@triton.jit
def _attend_keys(q_c, q_r, pos, kv_ptr, scale_ptr, bt_row, k_lo, k_hi, block_size, stride_kb, stride_ks, scale, V, R,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                 FP8: tl.constexpr):
    """Online softmax of ROWS query rows over key positions [k_lo, k_hi) of one sequence (`bt_row`: its block
    table row), each row seeing keys up to its own position `pos`. -> (acc [ROWS, DV] unnormalised fp32, running
    max m [ROWS], running sum l [ROWS]; l = 0 and m = -inf for a row that saw no key)."""
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_DV), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        kp = k0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        k_ok = kp < k_hi
        blk = tl.load(bt_row + kp // block_size, mask=k_ok, other=0).to(tl.int64)
        row = blk * stride_kb + (kp % block_size).to(tl.int64) * stride_ks  # [BN] element offset of each entry
        c = tl.load(kv_ptr + row[:, None] + dv[None, :], mask=k_ok[:, None] & (dv < V)[None, :], other=0.0)
        kr = tl.load(kv_ptr + row[:, None] + V + dr[None, :], mask=k_ok[:, None] & (dr < R)[None, :], other=0.0)
        if FP8:
            c, kr = _fp8_dequantise(c, kr, scale_ptr, row, V + R, k_ok)
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
    return acc, m_i, l_i


@triton.jit
def _mla_paged_kernel(
    q_ptr, kv_ptr, scale_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, tile_seq_ptr, tile_start_ptr, o_ptr, lse_ptr,
    scale, T, H, V, R, block_size, split_len,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_bt, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, DOT_FP32: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
):
    """Grid (tiles, head blocks, splits). SPLIT: split `sp` attends keys [sp * split_len, (sp + 1) * split_len) and
    writes its normalised partial to o_ptr [splits, T, H, V] fp32 and its log-sum-exp to lse_ptr [splits, T, H]
    (-inf: no key); otherwise (one split, split_len ≥ every context) the output row of `o` [T, H, V]."""
    g = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(tile_seq_ptr + g)
    m0 = tl.load(tile_start_ptr + g)  # first query index (within the sequence) of this tile
    q_start = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_start
    first = tl.load(seq_lens_ptr + n) - q_len  # position of the sequence's first query

    r = tl.arange(0, BLOCK_M * BLOCK_H)
    m = m0 + r // BLOCK_H  # [ROWS] query index within the sequence
    h = hb * BLOCK_H + r % BLOCK_H  # [ROWS] head
    row_ok = (m < q_len) & (h < H)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    q_row = q_ptr + (q_start + m).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_row + dv[None, :], mask=row_ok[:, None] & (dv < V)[None, :], other=0.0)  # [ROWS, DV]
    q_r = tl.load(q_row + V + dr[None, :], mask=row_ok[:, None] & (dr < R)[None, :], other=0.0)  # [ROWS, DR]
    if DOT_FP32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    k_end = tl.where(m0 < q_len, first + tl.minimum(m0 + BLOCK_M, q_len), 0)  # keys [0, k_end) are needed
    k_lo = sp * split_len
    acc, m_i, l_i = _attend_keys(q_c, q_r, first + m, kv_ptr, scale_ptr, bt_ptr + n.to(tl.int64) * stride_bt,
                                 k_lo, tl.minimum(k_end, k_lo + split_len), block_size, stride_kb, stride_ks, scale,
                                 V, R, BLOCK_M * BLOCK_H, BLOCK_N, BLOCK_DV, BLOCK_DR, FP8)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ok = row_ok[:, None] & (dv < V)[None, :]
    if SPLIT:
        part = (sp * T + q_start + m).to(tl.int64) * H + h  # [ROWS] row of the [splits, T, H] partials
        tl.store(o_ptr + part[:, None] * V + dv[None, :], o, mask=out_ok)
        tl.store(lse_ptr + part, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=row_ok)
    else:
        o_row = o_ptr + (q_start + m).to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh
        tl.store(o_row + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=out_ok)


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


def _decode_splits(num_splits: int | None, decode_only: bool, capacity: int, programs: int) -> tuple[int, int]:
    """(splits, keys per split) from shapes only; `num_splits` None: `split_kv.choose_num_splits`."""
    if num_splits is not None and (num_splits < 1 or (num_splits > 1 and not decode_only)):
        raise ValueError(f"num_splits={num_splits}: split-KV takes a decode batch (one query per sequence) and ≥ 1")
    wanted = num_splits if num_splits is not None else choose_num_splits(capacity, programs) if decode_only else 1
    if wanted <= 1:
        return 1, 1 << 30
    split_len = triton.cdiv(triton.cdiv(capacity, wanted), BLOCK_N) * BLOCK_N  # whole key steps per split
    return triton.cdiv(capacity, split_len), split_len


def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, v_dim: int,
                        host: tuple[Sequence[int], Sequence[int]] | None = None, *,
                        num_splits: int | None = None) -> torch.Tensor:
    """`host` (the torch op's host copy of cu_seqlens_q / seq_lens) is not needed here. `num_splits`: context
    splits of a decode batch (None: chosen from the table's width and the batch's programs; 1: unsplit)."""
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
    splits, split_len = _decode_splits(num_splits, decode_only, block_tables.shape[1] * kv_cache.shape[1],
                                       triton.cdiv(T, block_m) * triton.cdiv(H, block_h))
    part_o = torch.empty(splits, T, H, v_dim, dtype=torch.float32, device=q.device) if splits > 1 else out
    part_lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device) if splits > 1 else out
    grid = (num_tiles, triton.cdiv(H, block_h), splits)
    _mla_paged_kernel[grid](
        q, values, scales, block_tables, cu_seqlens_q.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        tile_seq, tile_start, part_o, part_lse,
        scale, T, H, v_dim, Dk - v_dim, kv_cache.shape[1], split_len,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), BLOCK_DR=max(16, triton.next_power_of_2(Dk - v_dim)),
        DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",  # the CPU interpreter mis-multiplies bf16 dots
        FP8=fp8, SPLIT=splits > 1,
        num_warps=8 if v_dim >= 256 else 4,
    )
    if splits > 1:
        out.copy_(merge_partials(part_o, part_lse))  # torch ops, no host read
    return out
