"""Readable reference for the depthwise causal short convolution + SiLU used by KDA's q/k/v convs.

Contract:
`causal_conv1d_naive(x [T, C], weight [C, W], initial_window [N, C, W-1] | None, cu_seqlens [N+1] | None)
 -> (y [T, C], final_window [N, C, W-1])`

- Tokens of sequence n are `x[cu_seqlens[n]:cu_seqlens[n+1]]` (`cu_seqlens=None`: one sequence of all T tokens).
- `y_t = silu(sum_{j=0}^{W-1} weight[:, j] · x_{t-(W-1)+j})`; inputs before a sequence's start come from its
  initial window (oldest first, `initial_window[n, :, 0]` is the oldest) or are zero when there is no window.
- `final_window[n]` holds the last W−1 inputs of sequence n, oldest first; when the sequence is shorter than W−1 the
  older entries come from the initial window (or zeros).
- Arithmetic in fp32; `y` in `x.dtype`; `final_window` in the initial window's dtype (the state pool's), else
  `x.dtype`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_window: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, C = x.shape
    W = weight.shape[1]
    bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    window_dtype = x.dtype if initial_window is None else initial_window.dtype
    w32 = weight.to(torch.float32)  # [C, W]
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)
    finals = []
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        if initial_window is None:
            history = torch.zeros(W - 1, C, dtype=torch.float32, device=x.device)  # [W-1, C]
        else:
            history = initial_window[n].to(torch.float32).t()  # [W-1, C], oldest first
        padded = torch.cat([history, x[start:end].to(torch.float32)], dim=0)  # [W-1+L, C]
        for i in range(end - start):
            taps = padded[i : i + W]  # [W, C]: inputs t-(W-1) .. t
            y[start + i] = F.silu((taps * w32.t()).sum(0))
        finals.append(padded[padded.shape[0] - (W - 1) :].t())  # [C, W-1]
    final_window = torch.stack(finals).to(window_dtype) if finals else x.new_zeros(0, C, W - 1, dtype=window_dtype)
    return y.to(x.dtype), final_window


def causal_conv1d_verify_naive(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                               state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                               out_slots: torch.Tensor) -> torch.Tensor:
    """Oracle of the `conv_verify` op: token by token, sequence n starts from the window in pool slot
    `state_indices[n]`; the window after token t is written to slot `out_slots[t]` when that is >= 0 (all reads
    happen before any write, so an out-slot may be the in-slot). Returns y [T, C] in x's dtype."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    ys, writes = [], []
    for n in range(len(bounds) - 1):
        window = conv_state_pool[int(state_indices[n])].clone()  # [C, W-1]
        for t in range(bounds[n], bounds[n + 1]):
            y, final = causal_conv1d_naive(x[t: t + 1], weight, window.unsqueeze(0))
            window = final[0]
            ys.append(y)
            if int(out_slots[t]) >= 0:
                writes.append((int(out_slots[t]), window))
    for slot, window in writes:
        conv_state_pool[slot] = window.to(conv_state_pool.dtype)
    return torch.cat(ys) if ys else x.new_zeros(0, x.shape[1])
