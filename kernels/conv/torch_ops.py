"""Vectorised torch causal conv1d + SiLU over a pooled conv-window state (prefill and decode).

Contract (same math as `kernels.conv.naive.causal_conv1d_naive`; W = kernel width, the pool keeps W−1 inputs):
- `causal_conv1d_prefill(x [T, C], weight [C, W], conv_state_pool [S, C, W-1], state_indices [N], cu_seqlens [N+1])
  -> y [T, C]`: sequence n (tokens `cu_seqlens[n]:cu_seqlens[n+1]`) reads its initial window from pool slot
  `state_indices[n]` (the caller zeroes a fresh sequence's slot) and writes its final window back to that slot in
  place. Slots not named in `state_indices` are never read or written.
- `causal_conv1d_decode(x [N, C], weight [C, W], conv_state_pool, state_indices [N], state_slots=None) -> y [N, C]`:
  one token per sequence; the slot's window shifts left by one in place. `state_slots`, a host `slice` equal to
  `state_indices` when they are consecutive (`kernels.indexing.slot_range`), lets it work on the pool's rows in
  place; without it the windows are gathered and scattered by index. Either way nothing is read back to the host
  (the decode step's ops never are: a compiled or captured step holds them).
- `causal_conv1d_verify(x, weight, conv_state_pool, state_indices [N], cu_seqlens [N+1], out_slots [T]) -> y`
  (speculative verification): sequence n starts from the window in slot `state_indices[n]`, and the window after
  token t is written to slot `out_slots[t]` when that is >= 0 (-1: not kept). Every window is read before any is
  written, so an out-slot may be an in-slot; out-slots must not repeat. The per-slot window is the rollback unit:
  the engine keeps the window after each verified position and picks the accepted one. With
  `host=(cu_seqlens, out_slots)` as host ints nothing is read back to the host.
- `causal_conv1d_verify_rows(x [N*Q, C], weight, conv_state_pool, state_indices [N], out_slots [N*Q],
  tokens_per_row Q) -> y` (a compiled verification step, engine/decode_graphs.py): every sequence verifies Q
  tokens (rows n*Q … n*Q+Q-1), the decode's math Q times; the window after each token goes to its out-slot, which
  must be a real slot (the caller points unkept ones at a scratch slot). No Python value depends on the data, so a
  compiled step traces it as plain ops.
- fp32 arithmetic; `y` in `x.dtype`; windows stored in the pool's dtype. No per-token Python loops: prefill loops
  over sequences and blocks of `ROW_BLOCK` rows, each tap one multiply-add over contiguous rows (a depthwise
  `F.conv1d` over the [C, T] transpose was ~10x slower on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.casting import cast, fp32


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
                         state_indices: torch.Tensor, state_slots: slice | None = None) -> torch.Tensor:
    rows = state_slots  # consecutive slots: work on the pool's rows in place
    slots = state_indices.to(torch.int64)
    window = conv_state_pool[rows] if rows is not None else conv_state_pool.index_select(0, slots)  # [N, C, W-1]
    y, shifted = _decode_token(window, x, fp32(weight))  # [N, C], [N, C, W-1]
    if rows is not None:
        window.copy_(shifted)
    else:
        conv_state_pool.index_copy_(0, slots, shifted)
    return cast(F.silu(y), x.dtype)


def _decode_token(window: torch.Tensor, x: torch.Tensor, taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: window [N, C, W-1], x [N, C], taps [C, W] fp32 -> (y [N, C] fp32 before the SiLU,
    the shifted window [N, C, W-1] in the window's dtype)."""
    pad = taps.shape[1] - 1
    y = fp32(window[:, :, 0]) * taps[:, 0]  # [N, C], taps in the prefill's order
    for j in range(1, pad):
        y.addcmul_(fp32(window[:, :, j]), taps[:, j])
    y.addcmul_(fp32(x), taps[:, pad])
    return y, torch.cat([window[:, :, 1:], cast(x, window.dtype).unsqueeze(-1)], dim=-1)


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                         state_indices: torch.Tensor, cu_seqlens: torch.Tensor, out_slots: torch.Tensor,
                         host: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`host`: `(cu_seqlens, out_slots)` as host ints (the runner has them), so nothing is read back; None reads
    the tensors."""
    T, C = x.shape
    taps = weight.to(torch.float32).t().contiguous()  # [W, C]
    pad = taps.shape[0] - 1
    windows = conv_state_pool.index_select(0, state_indices.to(torch.int64)).to(torch.float32).transpose(1, 2)
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)  # windows: [N, W-1, C], a copy
    bounds, out = host if host is not None else (cu_seqlens.tolist(), out_slots.tolist())
    slots, kept = [], []
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        tokens = x[start:end].to(torch.float32)  # [L, C]
        _depthwise_taps(windows[n], tokens, taps, y[start:end])
        wanted = [i for i in range(end - start) if out[start + i] >= 0]  # token offsets whose window is kept
        if wanted:
            u = torch.cat([windows[n], tokens])  # [W-1+L, C]; the window after token i is u[i+1 : i+W]
            rows = [[i + 1 + j for j in range(pad)] for i in wanted]  # [m, W-1]
            kept.append(u[torch.tensor(rows, device=x.device)])  # [m, W-1, C]
            slots.extend(out[start + i] for i in wanted)
    F.silu(y, inplace=True)
    if slots:
        index = torch.tensor(slots, dtype=torch.int64, device=conv_state_pool.device)
        conv_state_pool.index_copy_(0, index, torch.cat(kept).transpose(1, 2).to(conv_state_pool.dtype))
    return y.to(x.dtype)


def causal_conv1d_verify_rows(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                              state_indices: torch.Tensor, out_slots: torch.Tensor, tokens_per_row: int
                              ) -> torch.Tensor:
    """See the module docstring: x [N*Q, C] -> y [N*Q, C]."""
    T, C = x.shape
    n = T // tokens_per_row
    window = conv_state_pool.index_select(0, state_indices.to(torch.int64))  # [N, C, W-1], every read first
    taps = fp32(weight)  # [C, W]
    tokens = x.view(n, tokens_per_row, C)
    slots = out_slots.to(torch.int64).view(n, tokens_per_row)
    ys = []
    for t in range(tokens_per_row):
        y, window = _decode_token(window, tokens[:, t], taps)  # [N, C], [N, C, W-1]
        conv_state_pool.index_copy_(0, slots[:, t], window)
        ys.append(y)
    return cast(F.silu(torch.stack(ys, dim=1).view(T, C)), x.dtype)
