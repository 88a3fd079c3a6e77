"""Vectorised torch causal conv1d + SiLU over a pooled conv-window state (prefill and decode).

Contract (same math as `kernels.conv.naive.causal_conv1d_naive`; W = kernel width, the pool keeps W−1 inputs):
- `causal_conv1d_prefill(x [T, C], weight [C, W], conv_state_pool [S, C, W-1], state_indices [N], cu_seqlens [N+1])
  -> y [T, C]`: sequence n (tokens `cu_seqlens[n]:cu_seqlens[n+1]`) reads its initial window from pool slot
  `state_indices[n]` (the caller zeroes a fresh sequence's slot) and writes its final window back to that slot in
  place. Slots not named in `state_indices` are never read or written.
- `causal_conv1d_decode(x [N, C], weight [C, W], conv_state_pool, state_indices [N]) -> y [N, C]`: one token per
  sequence; the slot's window shifts left by one in place.
- `causal_conv1d_verify(x, weight, conv_state_pool, state_indices [N], cu_seqlens [N+1], out_slots [T]) -> y`
  (speculative verification): sequence n starts from the window in slot `state_indices[n]`, and the window after
  token t is written to slot `out_slots[t]` when that is >= 0 (-1: not kept). Every window is read before any is
  written, so an out-slot may be an in-slot; out-slots must not repeat. The per-slot window is the rollback unit:
  the engine keeps the window after each verified position and picks the accepted one.
- fp32 arithmetic; `y` in `x.dtype`; windows stored in the pool's dtype. No per-token Python loops: prefill loops
  over sequences and blocks of `ROW_BLOCK` rows, each tap one multiply-add over contiguous rows (a depthwise
  `F.conv1d` over the [C, T] transpose was ~10x slower on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.indexing import slot_range

ROW_BLOCK = 256  # rows per block of the prefill taps: [256, C] fp32 stays in L2 for C up to a few thousand


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                          state_indices: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    T, C = x.shape
    slots = state_indices.to(torch.int64)
    taps = weight.to(torch.float32).t().contiguous()  # [W, C]
    windows = conv_state_pool[slots].to(torch.float32).transpose(1, 2)  # [N, W-1, C], oldest first
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)
    finals = []
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2:
        return y.to(x.dtype)
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        tokens = x[start:end].to(torch.float32)  # [L, C]
        finals.append(_depthwise_taps(windows[n], tokens, taps, y[start:end]))
    F.silu(y, inplace=True)
    conv_state_pool[slots] = torch.stack(finals).transpose(1, 2).to(conv_state_pool.dtype)
    return y.to(x.dtype)


def _depthwise_taps(window: torch.Tensor, tokens: torch.Tensor, taps: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = Σ_j taps[j] · u[i + j] over u = [window (W-1 rows); tokens (L rows)], fp32; returns u's last W-1 rows.

    window [W-1, C], tokens [L, C], taps [W, C], out [L, C]. Rows past the first W-1 read `tokens` directly (no
    concatenated copy), in blocks of `ROW_BLOCK` rows that stay in cache; every tap is one multiply-add over
    contiguous rows."""
    pad, L = window.shape[0], tokens.shape[0]
    head = torch.cat([window, tokens[:pad]])  # [W-1 + min(L, W-1), C]
    _taps_into(head, taps, out[: min(L, pad)])
    for a in range(pad, L, ROW_BLOCK):
        b = min(L, a + ROW_BLOCK)
        _taps_into(tokens[a - pad : b], taps, out[a:b])
    return head[-pad:] if L < pad else tokens[L - pad :]


def _taps_into(u: torch.Tensor, taps: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = Σ_j taps[j] · u[i + j] for the len(out) first rows; u has len(out) + W-1 rows (or more)."""
    rows = out.shape[0]
    if rows == 0:
        return
    torch.mul(u[:rows], taps[0], out=out)
    for j in range(1, taps.shape[0]):
        out.addcmul_(u[j : j + rows], taps[j])


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                         state_indices: torch.Tensor) -> torch.Tensor:
    rows = slot_range(state_indices)  # consecutive slots: work on the pool's rows in place
    slots = state_indices.to(torch.int64)
    window = conv_state_pool[rows] if rows is not None else conv_state_pool[slots]  # [N, C, W-1]
    taps = weight.to(torch.float32)  # [C, W]
    pad = taps.shape[1] - 1
    x32 = x.to(torch.float32)  # [N, C]
    y = window[:, :, 0].to(torch.float32) * taps[:, 0]  # [N, C], taps in the prefill's order
    for j in range(1, pad):
        y.addcmul_(window[:, :, j].to(torch.float32), taps[:, j])
    y.addcmul_(x32, taps[:, pad])
    shifted = torch.cat([window[:, :, 1:], x.to(window.dtype).unsqueeze(-1)], dim=-1)  # [N, C, W-1]
    if rows is not None:
        window.copy_(shifted)
    else:
        conv_state_pool[slots] = shifted
    return F.silu(y).to(x.dtype)


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                         state_indices: torch.Tensor, cu_seqlens: torch.Tensor, out_slots: torch.Tensor) -> torch.Tensor:
    T, C = x.shape
    taps = weight.to(torch.float32).t().contiguous()  # [W, C]
    pad = taps.shape[0] - 1
    windows = conv_state_pool[state_indices.to(torch.int64)].to(torch.float32).transpose(1, 2)  # [N, W-1, C], a copy
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)
    out = out_slots.to(device=x.device, dtype=torch.int64)
    bounds = cu_seqlens.tolist()
    slots, kept = [], []
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        tokens = x[start:end].to(torch.float32)  # [L, C]
        _depthwise_taps(windows[n], tokens, taps, y[start:end])
        wanted = (out[start:end] >= 0).nonzero().flatten()  # [m] token offsets whose window is kept
        if wanted.numel():
            u = torch.cat([windows[n], tokens])  # [W-1+L, C]; the window after token i is u[i+1 : i+W]
            rows = wanted[:, None] + 1 + torch.arange(pad, device=x.device)  # [m, W-1]
            kept.append(u[rows])  # [m, W-1, C]
            slots.append(out[start:end][wanted])
    F.silu(y, inplace=True)
    if slots:
        conv_state_pool[torch.cat(slots)] = torch.cat(kept).transpose(1, 2).to(conv_state_pool.dtype)
    return y.to(x.dtype)
