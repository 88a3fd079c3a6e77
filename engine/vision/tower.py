"""The Kimi K3 vision tower (MoonViT3d) in the released parameter layout, for packed batches of images.

Contract:
- `VisionTower(config)` holds exactly the official parameters (names relative to `vision_tower.`):
  `patch_embed.proj.weight [D, 3, p, p]` (+ `.bias` with `patch_embed_proj_bias`), `patch_embed.pos_emb.weight
  [H0, W0, D]`, `encoder.blocks.N.{norm0, norm1}` (RMSNorm with torch's default eps, or LayerNorm),
  `encoder.blocks.N.wqkv [3·Q, D]`, `.wo [D, Q]`, `.mlp.fc0 [I, D]`, `.mlp.fc1 [D, I]` (biases per config) and
  `encoder.final_layernorm`; Q = qkv_hidden_size = heads × head_dim.
- `forward(pixel_values [L, 3, p, p], grid_thws [N, 3]) -> [M, kh·kw·D]`: image n is `t·h·w` consecutive patch rows
  (row-major over its t × h × w grid, as the processor emits them). Each patch is embedded by `proj` (a convolution
  whose kernel is the patch: one matmul), plus the learnable 2-D position grid resized to (h, w) by
  `F.interpolate` (bilinear or bicubic, `align_corners=False`; used as is when (h, w) equals its shape) and, for
  t > 1, a fixed sin-cos time embedding. Blocks are pre-norm: `x += wo(attn(norm0(x)))`, `x += fc1(gelu_tanh(
  fc0(norm1(x))))`; the attention is non-causal within each image (`kernels` op `vision_attention`), with 2-D
  rotary embeddings on q and k (adjacent channel pairs as complex numbers; pair 2i rotates by column · θᵢ, pair
  2i+1 by row · θᵢ, θᵢ = 10000^(−4i/head_dim)). After `final_layernorm`, each kh × kw patch window becomes one row (the window's
  patches concatenated in row-major order, averaged over t): image n gives (h/kh)·(w/kw) rows, images in order.
- Inputs are cast to the weights' dtype; rotary products run in fp32. Grids must fit the rotary table (512 × 512)
  and divide by the merge kernel; violations raise `ValueError`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import VisionConfig
from kernels.registry import get_kernel

ROPE_MAX_GRID = 512  # the official rotary table covers 512 x 512 patches
ROPE_THETA = 10000.0
SINCOS_BASE = 10000.0  # the time embedding's frequency base


def _norm(config: VisionConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size)  # eps None: finfo(float32).eps, as the official nn.RMSNorm
    return nn.LayerNorm(config.hidden_size)


class PositionGrid(nn.Module):
    """The learnable [H0, W0, D] position grid, resized per image; a fixed sin-cos table across frames."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.mode = config.pos_emb_interpolation
        self.max_frames = config.pos_emb_time
        self.weight = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, config.hidden_size))

    def for_image(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t·h·w, D] position embeddings of one image / clip."""
        if (h, w) == tuple(self.weight.shape[:2]):
            grid = self.weight.reshape(h * w, -1)
        else:
            resized = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.mode)  # [1, D, h, w]
            grid = resized[0].permute(1, 2, 0).reshape(h * w, -1)
        if t == 1:
            return grid
        if t > self.max_frames:
            raise ValueError(f"a clip of {t} frames exceeds the tower's {self.max_frames} time embeddings")
        frames = grid[None] + _sincos(t, grid.shape[-1], grid.device)[:, None, :].to(grid.dtype)  # [t, h*w, D]
        return frames.reshape(t * h * w, -1)


def _sincos(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """[length, dim] fixed embedding: sin of position · ω in the first half, cos in the second, ω = 10000^(−2j/dim)."""
    omega = 1.0 / SINCOS_BASE ** (torch.arange(dim // 2, dtype=torch.float32, device=device) / (dim / 2.0))
    angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * omega[None, :]  # [length, dim/2]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_bias)
        self.pos_emb = PositionGrid(config)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [L, 3, p, p] -> [L, D]."""
        weight = self.proj.weight  # [D, 3, p, p]: the kernel covers the whole patch, so the conv is one matmul
        x = F.linear(pixel_values.reshape(pixel_values.shape[0], -1).to(weight.dtype),
                     weight.reshape(weight.shape[0], -1), self.proj.bias)  # [L, D]
        return x + torch.cat([self.pos_emb.for_image(t, h, w) for t, h, w in grids]).to(x.dtype)


def rope_angles(grids: list[tuple[int, int, int]], head_dim: int, device: torch.device) -> torch.Tensor:
    """[L, head_dim/2] fp32 rotation angle of each channel pair of each patch (frames repeat their grid)."""
    theta = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    parts = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device).repeat_interleave(w).float()  # [h*w]
        cols = torch.arange(w, device=device).repeat(h).float()  # [h*w]
        angles = torch.stack([cols[:, None] * theta, rows[:, None] * theta], dim=-1)  # [h*w, hd/4, 2]
        parts.append(angles.reshape(h * w, head_dim // 2).repeat(t, 1))
    return torch.cat(parts)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [L, H, hd]; rotation [L, 1, hd/2] complex64 (unit) -> x with each channel pair (a, b) taken as a + ib and
    multiplied by its rotation, in x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [L, H, hd/2]
    return torch.view_as_real(pairs * rotation).reshape(x.shape).to(x.dtype)


class MLP2(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.linear_bias)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.norm0, self.norm1 = _norm(config), _norm(config)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.qkv_hidden_size, bias=config.attn_bias)
        self.wo = nn.Linear(config.qkv_hidden_size, config.hidden_size, bias=config.attn_bias)
        self.mlp = MLP2(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """x [L, D]; cu_seqlens [N+1] image boundaries; rotation [L, 1, hd/2] complex64 -> [L, D]."""
        L = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).reshape(L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [L, H, hd]
        q, k = apply_rope(q, rotation), apply_rope(k, rotation)
        attention = get_kernel("vision_attention", x.device)
        o = attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)  # [L, H, hd]
        x = x + self.wo(o.reshape(L, -1))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList([EncoderBlock(config) for _ in range(config.num_layers)])
        self.final_layernorm = _norm(config)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        lengths = [t * h * w for t, h, w in grids]
        cu_seqlens = torch.tensor([0] + lengths, device=x.device).cumsum(0)  # [N+1]
        angles = rope_angles(grids, self.head_dim, x.device)[:, None, :]  # [L, 1, hd/2]
        rotation = torch.polar(torch.ones_like(angles), angles)  # complex64
        for block in self.blocks:
            x = block(x, cu_seqlens, rotation)
        return self.final_layernorm(x)


def merge_windows(x: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """x [L, D] -> [M, kh·kw·D]: each kh × kw window of an image's grid is one row, averaged over frames."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start:start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, -1)
        windows = seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0)  # [h/kh, w/kw, kh, kw, D]
        out.append(windows.reshape((h // kh) * (w // kw), -1))
        start += t * h * w
    return torch.cat(out)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        grids = check_grids(grid_thws, pixel_values.shape[0], self.config.merge_kernel)
        x = self.patch_embed(pixel_values, grids)  # [L, D]
        return merge_windows(self.encoder(x, grids), grids, self.config.merge_kernel)


def check_grids(grid_thws: torch.Tensor, num_patches: int, kernel: tuple[int, int]) -> list[tuple[int, int, int]]:
    """grid_thws [N, 3] -> [(t, h, w)], checked against the patch rows and the tower's limits."""
    if grid_thws.ndim != 2 or grid_thws.shape[1] != 3:
        raise ValueError(f"grid_thws must be [N, 3] (t, h, w), got {list(grid_thws.shape)}")
    grids = [tuple(int(v) for v in row) for row in grid_thws.tolist()]
    for n, (t, h, w) in enumerate(grids):
        if t < 1 or not 1 <= h <= ROPE_MAX_GRID or not 1 <= w <= ROPE_MAX_GRID:
            raise ValueError(f"image {n}: grid {(t, h, w)} is outside 1..{ROPE_MAX_GRID} patches per side")
        if h % kernel[0] or w % kernel[1]:
            raise ValueError(f"image {n}: grid {h}x{w} does not divide by the merge kernel {kernel}")
    total = sum(math.prod(g) for g in grids)
    if total != num_patches:
        raise ValueError(f"grid_thws describe {total} patches, pixel_values holds {num_patches}")
    return grids
