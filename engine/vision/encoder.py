"""The K3 image encoder: the vision tower, the `patchmergerv2` projector, and where their rows enter a prompt.

Contract:
- `VisionEncoder(config)` owns `vision_tower` (engine/vision/tower.py) and `mm_projector`; its parameter names
  are the checkpoint's (`vision_tower.*`, `mm_projector.proj.0.weight [kD, kD]`, `mm_projector.proj.2.weight
  [E, kD]`, `mm_projector.post_norm.weight [E]`; k = kh·kw patches per row, D the tower width, E the text width).
- `forward(pixel_values [L, 3, p, p], grid_thws [N, 3]) -> [M, E]`: the rows of all images, in order; image n has
  `feature_rows(grid_thws, kernel)[n]` of them. The projector maps each merged row to
  `rmsnorm(proj.2(gelu(proj.0(row))))` (exact GELU; RMSNorm eps `projector_ln_eps`, computed by torch's RMSNorm).
- `media_inputs(token_ids, features, pad_id) -> (mm_positions [M], mm_embeds [M, E])`: the `ForwardBatch` fields for
  a prompt whose `<|media_pad|>` tokens are already expanded to one per feature row (see
  `engine.vision.processor.expand_media_pads`); raises `ValueError` when the pad count and the rows differ.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import VisionConfig
from engine.vision.tower import VisionTower

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class PatchMergerV2(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        merged = config.merged_size
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), nn.GELU(),
                                  nn.Linear(merged, config.text_hidden_size, bias=False))
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_eps)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, kD] -> [M, E]."""
        return self.post_norm(self.proj(rows))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.vision_tower = VisionTower(config)
        self.mm_projector = PatchMergerV2(config)

    @property
    def config(self) -> VisionConfig:
        return self.vision_tower.config

    @property
    def dtype(self) -> torch.dtype:
        return self.mm_projector.post_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mm_projector.post_norm.weight.device

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        return self.mm_projector(self.vision_tower(pixel_values.to(self.device), grid_thws))  # [M, E]


def feature_rows(grid_thws: torch.Tensor, kernel: tuple[int, int]) -> list[int]:
    """Rows each image contributes: (h / kh) · (w / kw) of its patch grid (frames are averaged)."""
    return [(int(h) // kernel[0]) * (int(w) // kernel[1]) for _, h, w in grid_thws.tolist()]


def media_inputs(token_ids: list[int] | torch.Tensor, features: torch.Tensor,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mm_positions [M] int64, mm_embeds [M, E]) placing feature row i at the i-th pad token of the prompt."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    positions = torch.nonzero(ids == pad_id).flatten()  # [M]
    if positions.numel() != features.shape[0]:
        raise ValueError(f"the prompt has {positions.numel()} media pad tokens for {features.shape[0]} image "
                         "feature rows; expand each image's pad to its rows first")
    return positions, features
