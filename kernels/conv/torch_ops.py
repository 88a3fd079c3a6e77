"""Vectorised torch causal conv1d + SiLU over a pooled conv-window state (prefill and decode).

Contract (same math as `kernels.conv.naive.causal_conv1d_naive`; W = kernel width, the pool keeps W−1 inputs):
- `causal_conv1d_prefill(x [T, C], weight [C, W], conv_state_pool [S, C, W-1], state_indices [N], cu_seqlens [N+1])
  -> y [T, C]`: sequence n (tokens `cu_seqlens[n]:cu_seqlens[n+1]`) reads its initial window from pool slot
  `state_indices[n]` (the caller zeroes a fresh sequence's slot) and writes its final window back to that slot in
  place. Slots not named in `state_indices` are never read or written.
- `causal_conv1d_decode(x [N, C], weight [C, W], conv_state_pool, state_indices [N]) -> y [N, C]`: one token per
  sequence; the slot's window shifts left by one in place.
- fp32 arithmetic; `y` in `x.dtype`; windows stored in the pool's dtype. No per-token Python loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _padded_layout(cu_seqlens: torch.Tensor, T: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in a buffer where every sequence is preceded by `pad` window rows.

    Returns (token_pos [T], seq_start [N]): buffer row of each token, and buffer row of each sequence's window start.
    """
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]  # [N]
    seq_of_token = torch.repeat_interleave(torch.arange(N, device=cu.device), lengths, output_size=T)  # [T]
    token_pos = torch.arange(T, device=cu.device) + pad * (seq_of_token + 1)  # [T]
    seq_start = cu[:-1] + pad * torch.arange(N, device=cu.device)  # [N]
    return token_pos, seq_start


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    T, C = x.shape
    W = weight.shape[1]
    pad = W - 1
    N = state_indices.numel()
    slots = state_indices.to(torch.int64)
    token_pos, seq_start = _padded_layout(cu_seqlens, T, pad)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)  # [N]
    taps = torch.arange(pad, device=x.device)  # [W-1]

    # Every sequence laid out as [its window (W-1 rows), its tokens] in one fp32 buffer.
    buf = torch.empty(T + N * pad, C, dtype=torch.float32, device=x.device)  # [T + N(W-1), C]
    window_rows = (seq_start[:, None] + taps).reshape(-1)  # [N*(W-1)]
    buf[window_rows] = conv_state_pool[slots].to(torch.float32).transpose(1, 2).reshape(-1, C)
    buf[token_pos] = x.to(torch.float32)

    # Depthwise valid convolution over the whole buffer; output k covers buffer rows k .. k+W-1.
    conv = F.conv1d(buf.t().unsqueeze(0), weight.to(torch.float32).unsqueeze(1), groups=C)  # [1, C, rows-(W-1)]
    y = F.silu(conv[0].t()[token_pos - pad])  # [T, C]

    # Final window: the last W-1 buffer rows of each sequence's region (window rows included when it is short).
    final_rows = seq_start[:, None] + lengths[:, None] + taps  # [N, W-1]
    final = buf[final_rows.reshape(-1)].reshape(N, pad, C).transpose(1, 2)  # [N, C, W-1]
    conv_state_pool[slots] = final.to(conv_state_pool.dtype)
    return y.to(x.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    slots = state_indices.to(torch.int64)
    window = conv_state_pool[slots].to(torch.float32)  # [N, C, W-1]
    full = torch.cat([window, x.to(torch.float32).unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = F.silu((full * weight.to(torch.float32)).sum(-1))  # [N, C]
    conv_state_pool[slots] = full[:, :, 1:].to(conv_state_pool.dtype)
    return y.to(x.dtype)
