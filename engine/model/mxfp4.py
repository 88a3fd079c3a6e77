"""MXFP4 weights in the compressed-tensors `mxfp4-pack-quantized` layout (how Kimi K3 ships its routed experts).

Contract:
- `weight_packed` [out, in/2] uint8 holds two e2m1 codes per byte, the LOW nibble first (column 2j low, 2j+1 high).
  An e2m1 code is sign bit 3 and magnitude index bits 0..2 into (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- `weight_scale` [out, in/32] uint8 holds one ue8m0 exponent per 32 input columns: w = v · 2^(scale − 127).
- `dequantize_mxfp4` is exact (every value is representable in fp32); `quantize_mxfp4` rounds to nearest and is
  its inverse on already-quantised values (used to write test and generated checkpoints).
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class MXFP4Error(ValueError):
    pass


def mxfp4_shapes(weight_shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed shape, scale shape) for a dense weight of `weight_shape` [out, in]."""
    out_features, in_features = weight_shape
    if in_features % GROUP:
        raise MXFP4Error(f"in_features {in_features} is not a multiple of {GROUP}")
    return (out_features, in_features // 2), (out_features, in_features // GROUP)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 + [out, in/32] uint8 → [out, in] float32."""
    out_features, half = packed.shape
    if scale.shape != (out_features, 2 * half // GROUP):
        raise MXFP4Error(f"weight_scale shape {list(scale.shape)} does not fit weight_packed {list(packed.shape)}: "
                         f"expected {[out_features, 2 * half // GROUP]}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out_features, 2 * half).long()  # [out, in]
    magnitude = E2M1_VALUES.to(packed.device)[codes & 0x7]
    values = torch.where((codes & 0x8) != 0, -magnitude, magnitude)  # [out, in]
    exponent = scale.to(torch.int32) - 127  # [out, in/32]
    factors = torch.pow(2.0, exponent.float()).repeat_interleave(GROUP, dim=1)  # [out, in]
    return values * factors


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (packed uint8 [out, in/2], scale uint8 [out, in/32]); round to nearest e2m1."""
    out_features, in_features = weight.shape
    mxfp4_shapes((out_features, in_features))
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0 ** -126)  # [out, G]
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # 6 = 1.5·2², so amax/2^e ≤ 8 → clip at 6
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)  # [out, G, 32]
    magnitude_index = (scaled.abs().unsqueeze(-1) - E2M1_VALUES).abs().argmin(dim=-1)  # [out, G, 32]
    sign = ((scaled < 0) & (magnitude_index > 0)).long() << 3
    codes = (magnitude_index | sign).reshape(out_features, in_features).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)
