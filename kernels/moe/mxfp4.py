"""Routed experts with packed MXFP4 weights, dequantised one expert tile at a time inside the MoE.

Format (compressed-tensors `mxfp4-pack-quantized`, how Kimi K3 ships its routed experts): a weight [N, K] is
`packed` [N, K/2] uint8 — two e2m1 codes per byte, the LOW nibble first (column 2j low, 2j+1 high); a code is sign
bit 3 and magnitude index bits 0..2 into (0, 0.5, 1, 1.5, 2, 3, 4, 6) — and `scale` [N, K/32] uint8, one ue8m0
exponent per 32 columns: `w = v · 2^(scale − 127)`. Stacked experts add a leading [E] dim to both.

Contract:
- `MXFP4Weight(packed, scale)` is one stacked weight; `dequantize_into(packed, scale, out)` writes `[N, K]` values
  into `out` (any float dtype; exact: every value is a power of two times 0.5..6) and returns it.
- `moe_experts_mxfp4(x, w1, w3, w2, topk_weights, topk_ids, act)`: the `moe_experts` op (kernels/moe/naive.py: same
  math, ids outside `[0, E)` add nothing) with `MXFP4Weight`s `w1`/`w3` [E, I, D·] and `w2` [E, D, I·]. Its result
  equals `moe_experts_grouped` on the dequantised weights up to fp32 rounding. Torch path: the assignments are
  sorted by expert once, and for each expert with tokens its gate/up and down weights are dequantised into
  `kernels.workspace` scratch buffers (one expert's worth; never the whole layer) right before its two matmuls.
  When w1/w3 (packed and scale) are halves of one `[E, 2I, ·]` tensor, gate and up dequantise and multiply as one.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import combine, gate_up_storage, sort_assignments
from kernels.workspace import gathered, scratch

GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class MXFP4Weight(NamedTuple):
    packed: torch.Tensor  # [E, N, K/2] uint8
    scale: torch.Tensor  # [E, N, K/32] uint8


@cache
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the (low nibble, high nibble) values of every byte."""
    codes = torch.arange(16)
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)  # [16]
    byte = torch.arange(256)
    return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1).to(dtype=dtype, device=device)


def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] uint8, scale [N, K/32] uint8 -> out [N, K] (written, returned)."""
    n, half = packed.shape
    table = _byte_table(out.dtype, out.device)
    torch.index_select(table, 0, packed.reshape(-1).to(torch.int32), out=out.view(n * half, 2))
    factor = torch.exp2(scale.to(torch.float32) - 127.0).to(out.dtype)  # [N, K/32], exact powers of two
    out.view(n, scale.shape[1], GROUP).mul_(factor.unsqueeze(-1))
    return out


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh [..., N, K] tensor (stacked experts welcome)."""
    lead = packed.shape[:-2]
    n, half = packed.shape[-2:]
    out = torch.empty(*lead, n, 2 * half, dtype=dtype, device=packed.device)
    flat_p, flat_s = packed.reshape(-1, n, half), scale.reshape(-1, n, scale.shape[-1])
    flat_o = out.view(-1, n, 2 * half)
    for e in range(flat_p.shape[0]):
        dequantize_into(flat_p[e], flat_s[e], flat_o[e])
    return out


def _gate_up_tile(w1: MXFP4Weight, w3: MXFP4Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [2I, D] gate/up weights, dequantised into scratch."""
    inter, width = w1.packed.shape[1], 2 * w1.packed.shape[2]
    tile = scratch("moe.mxfp4.gate_up", (2 * inter, width), dtype, w1.packed.device)
    packed, scales = gate_up_storage(w1.packed, w3.packed), gate_up_storage(w1.scale, w3.scale)
    if packed is not None and scales is not None:
        return dequantize_into(packed[e], scales[e], tile)
    dequantize_into(w1.packed[e], w1.scale[e], tile[:inter])
    dequantize_into(w3.packed[e], w3.scale[e], tile[inter:])
    return tile


def moe_experts_mxfp4(
    x: torch.Tensor,
    w1: MXFP4Weight,
    w3: MXFP4Weight,
    w2: MXFP4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: GatedActivation,
) -> torch.Tensor:
    k = topk_ids.shape[1]
    inter = w1.packed.shape[1]
    width, down_in = w2.packed.shape[1], 2 * w2.packed.shape[2]
    plan = sort_assignments(topk_ids, w1.packed.shape[0])
    rows = gathered(x, plan.order // k, "moe.rows")  # [T*k, D], sorted; rows off this rank come last, unused
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)  # [R, D]
    start = 0
    for e, count in enumerate(plan.counts.tolist()):
        if count == 0:
            continue
        seg = rows[start : start + count]  # [count, D]
        h = seg @ _gate_up_tile(w1, w3, e, x.dtype).t()  # [count, 2I]
        down = dequantize_into(w2.packed[e], w2.scale[e], scratch("moe.mxfp4.down", (width, down_in), x.dtype,
                                                                  x.device))  # [D, I]
        torch.mm(act(h[:, :inter], h[:, inter:]), down.t(), out=out[start : start + count])
        start += count
    return combine(out, plan, topk_weights, x.dtype)
