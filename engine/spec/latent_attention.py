"""The MLA attention of the drafters' layers (K3's MTP block, DSpark's dense layers), over explicit latent keys.

Contract:
- `DraftMLA` holds the official MLA parameter names (`q_a_proj`/`q_a_layernorm`/`q_b_proj` or `q_proj`,
  `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`, optional output gate `g_proj`), built unsharded.
  `latent(x, positions)` is what a row caches: `[T, kv_lora + rope]` = `kv_a_layernorm(c)` ++ `k_pe`, with RoPE
  applied to `k_pe` at `positions` when the layer has RoPE (DSpark) and not otherwise (the K3 target's NoPE MLA).
- `attend(x, positions, keys, visible)` is the attention of B independent sequences: the rows `x` `[B, T, D]` at
  `positions` `[B, T]` over that sequence's own `keys` `[B, S, C]` (whatever it may see, the rows' own latents
  included), where `visible[b, t, s]` (bool `[B, T, S]`) allows key s for query t; absorbed form (one shared latent
  key/value head, `kv_b_proj` split into the nope-key and value up-projections), fp32 softmax with scale
  `(nope + rope) ** -0.5` (times YaRN's mscale² under YaRN), returns `o_proj(o)` `[B, T, D]`. Keys a row may not see
  take no part (their weight is exactly 0), so padding a batch to its longest sequence changes nothing but rounding.
- `forward(x, positions, ctx_keys, visible)` = `attend` over `keys = ctx_keys ++ latent(x)` (`[B, S + T, C]`,
  `visible` `[B, T, S + T]`).
  Pure torch, differentiable: the same code serves inference (cached keys, a batch of requests) and training (a
  full sequence as a batch of one).
- RoPE is GPT-J style (interleaved pairs, vLLM's `is_neox_style=False`), in fp32; YaRN follows DeepSeek's
  `deepseek_yarn` (inverse frequencies blended by the linear ramp between the beta_fast/beta_slow correction dims;
  cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.common import RMSNorm, _linear
from engine.model.config import MLAConfig


@dataclass(frozen=True)
class RopeConfig:
    dim: int  # qk_rope_head_dim
    theta: float
    factor: float = 1.0  # > 1: YaRN
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def inv_freq(self) -> torch.Tensor:
        """[dim / 2] fp32."""
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        extrapolation = 1.0 / pos_freqs
        if self.factor <= 1.0:
            return extrapolation
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range()
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate
        return interpolation * (1 - keep) + extrapolation * keep

    def _correction_range(self) -> tuple[int, int]:
        def dim_of(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))
        low, high = math.floor(dim_of(self.beta_fast)), math.ceil(dim_of(self.beta_slow))
        return max(low, 0), min(high, self.dim - 1)

    @property
    def cos_sin_scale(self) -> float:
        return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_factor(self) -> float:
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """GPT-J (interleaved) rotation of x [T, ..., rope] at positions [T], in fp32, returned in x.dtype."""
    freqs = positions.to(torch.float32)[:, None] * rope.inv_freq().to(x.device)  # [T, rope/2]
    cos, sin = freqs.cos() * rope.cos_sin_scale, freqs.sin() * rope.cos_sin_scale
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope.dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


class DraftMLA(nn.Module):
    def __init__(self, mla: MLAConfig, hidden: int, latent_eps: float, rope: RopeConfig | None = None):
        super().__init__()
        self.mla, self.rope = mla, rope
        h, nope, rope_dim = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = _linear(hidden, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, latent_eps)
            self.q_b_proj = _linear(mla.q_lora_rank, h * (nope + rope_dim))
        else:
            self.q_proj = _linear(hidden, h * (nope + rope_dim))
        self.kv_a_proj_with_mqa = _linear(hidden, mla.kv_lora_rank + rope_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, latent_eps)
        self.kv_b_proj = _linear(mla.kv_lora_rank, h * (nope + mla.v_head_dim))
        self.o_proj = _linear(h * mla.v_head_dim, hidden)
        if mla.output_gate:
            self.g_proj = _linear(hidden, h * mla.v_head_dim)
        self.scale = mla.softmax_scale * (rope.softmax_factor if rope is not None else 1.0)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the cached latent [T, kv_lora + rope]."""
        lora = self.mla.kv_lora_rank
        ckv = self.kv_a_proj_with_mqa(x)  # [T, lora + rope]
        k_pe = ckv[:, lora:]
        if self.rope is not None:
            k_pe = apply_rope(k_pe, positions, self.rope)
        return torch.cat([self.kv_a_layernorm(ckv[:, :lora]), k_pe], dim=-1)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], positions [B, T], keys [B, S, C], visible [B, T, S] -> [B, T, D]."""
        mla, (b, t) = self.mla, x.shape[:2]
        h, nope, lora = mla.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if mla.q_lora_rank else self.q_proj(x)
        q = q.reshape(b * t, h, nope + mla.qk_rope_head_dim)  # [B*T, H, nope+rope]
        q_pe = q[..., nope:] if self.rope is None else apply_rope(q[..., nope:], positions.reshape(-1), self.rope)
        w_kv = self.kv_b_proj.weight.reshape(h, nope + mla.v_head_dim, lora)  # [H, nope+v, lora]
        q_abs = torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope], w_kv[:, :nope]), q_pe], dim=-1)
        q_abs = q_abs.reshape(b, t, h, -1)  # [B, T, H, C]
        keys = keys.to(x.dtype)
        scores = torch.einsum("bthc,bsc->bths", q_abs.float(), keys.float()) * self.scale  # [B, T, H, S]
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        o_latent = torch.einsum("bths,bsl->bthl", scores.softmax(-1), keys[..., :lora].float())  # [B, T, H, lora]
        o = torch.einsum("bthl,hvl->bthv", o_latent.to(x.dtype), w_kv[:, nope:]).reshape(b, t, h * mla.v_head_dim)
        if mla.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)  # [B, T, D]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_keys: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] after ctx_keys [B, S, C]; visible [B, T, S + T] -> [B, T, D]."""
        own = self.latent(x.flatten(0, 1), positions.reshape(-1)).reshape(*x.shape[:2], -1)  # [B, T, C]
        return self.attend(x, positions, torch.cat([ctx_keys.to(x.dtype), own], dim=1), visible)


def causal_visible(num_ctx: int, num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, S + T]: every row sees all `num_ctx` context keys and the rows up to itself."""
    own = torch.ones(num_rows, num_rows, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(num_rows, num_ctx, dtype=torch.bool, device=device), own], dim=1)
