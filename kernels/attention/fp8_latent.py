"""FP8 rows of the MLA latent cache (`--kv-cache-dtype fp8`): e4m3 values with one fp32 scale per token.

Contract:
- An FP8 latent cache is a uint8 tensor `[num_blocks, block_size, cache_dim + SCALE_BYTES]`: each token's row is
  its `cache_dim` latent values as `float8_e4m3fn` followed by the token's scale as one native-order fp32; the
  value a kernel uses is `fp8 * scale`. Everything that moves blocks (handoffs, the cache service, prefix reuse)
  moves these bytes as they are.
- `quantize_rows(latent [T, Dk]) -> [T, Dk + SCALE_BYTES] uint8`: scale = max|row| / 448 (e4m3's largest finite
  value; 1 for an all-zero row), values rounded to nearest e4m3. Deterministic: the same latent gives the same bytes.
- `dequantize_rows(rows [..., Dk + SCALE_BYTES] uint8) -> [..., Dk] fp32`.
- `is_fp8_cache(cache)`: the cache holds FP8 rows (uint8). `latent_dim(cache)`: the latent width Dk of either kind.
- The byte accounting (`engine.plan.kv_bytes_per_token`) and the option (`EngineArgs.kv_cache_dtype`) live in the
  engine; `allocate_latent_cache` makes the tensor.
- Kernels dequantise after gathering (the torch path) or while loading a tile (Triton); writes quantise (the
  attention kernels' `write_kv_cache`). `Dk` must be a multiple of 4 (the scale is read through an fp32 view).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per token row
FP8_MAX = 448.0  # largest finite float8_e4m3fn
def allocate_latent_cache(num_blocks: int, block_size: int, cache_dim: int, fp8: bool, dtype: torch.dtype,
                          device: torch.device | str) -> torch.Tensor:
    """A zeroed latent cache: [num_blocks, block_size, cache_dim] in `dtype`, or FP8 rows (uint8, + SCALE_BYTES)."""
    if fp8:
        if cache_dim % 4:
            raise ValueError(f"an FP8 latent cache needs a cache width divisible by 4, got {cache_dim}")
        return torch.zeros(num_blocks, block_size, cache_dim + SCALE_BYTES, dtype=torch.uint8, device=device)
    return torch.zeros(num_blocks, block_size, cache_dim, dtype=dtype, device=device)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def latent_dim(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_fp8_cache(cache) else cache.shape[-1]


def quantize_rows(latent: torch.Tensor) -> torch.Tensor:
    """latent [T, Dk] (any float dtype) -> [T, Dk + SCALE_BYTES] uint8."""
    x = latent.to(torch.float32)
    scale = x.abs().amax(-1, keepdim=True).div_(FP8_MAX)  # [T, 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)  # [T, Dk]
    return torch.cat([values, scale.view(torch.uint8)], dim=-1)  # [T, Dk + 4]


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., Dk + SCALE_BYTES] uint8 -> [..., Dk] fp32 (`rows` may be a gathered copy or a cache view)."""
    dk = rows.shape[-1] - SCALE_BYTES
    rows = rows.contiguous()
    values = rows[..., :dk].view(torch.float8_e4m3fn).to(torch.float32)  # [..., Dk]
    scale = rows.view(torch.float32)[..., dk // 4 :]  # [..., 1]: the row's last 4 bytes as fp32
    return values.mul_(scale)


def as_fp32_rows(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows of either kind as fp32 latents."""
    return dequantize_rows(rows) if is_fp8_cache(rows) else rows.to(torch.float32)
