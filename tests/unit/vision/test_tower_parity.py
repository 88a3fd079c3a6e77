"""Vision tower + projector parity: our `VisionEncoder` equals the official MoonViT3d + PatchMergerMLPV2 (fp32,
max |ours − ref| ≤ 1e-4 · max |ref| per image) on the tiny-k3 folder and on a variant config, for square and
non-square grids, grids equal to the learnable position grid (16 × 16 in tiny-k3), smaller and larger ones (the
position grid is interpolated), several images packed in one call, and both official attention paths (eager and
flash-attn varlen, the latter on the harness's stand-in)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.vision.encoder import VISION_PREFIXES, feature_rows
from engine.vision.loader import build_vision, init_vision_weights
from engine.model.presets import preset_config
from tests.model_driver import rel_err
from tests.reference.k3_reference import load_reference_package

REL_TOL = 1e-4
GRIDS = {
    "square-exact": [[1, 16, 16]],
    "square-smaller": [[1, 8, 8]],
    "square-larger": [[1, 32, 32]],
    "wide": [[1, 6, 10]],
    "tall-larger": [[1, 24, 14]],
    "packed": [[1, 16, 16], [1, 4, 6], [1, 10, 2], [1, 2, 2]],
}


def _pixels(grids: list[list[int]], patch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thws = torch.tensor(grids, dtype=torch.int64)
    total = int(grid_thws.prod(dim=1).sum())
    return torch.randn(total, 3, patch, patch, generator=torch.Generator().manual_seed(seed)), grid_thws


def _official_features(tower, projector, pixel_values, grid_thws, attn: str) -> list[torch.Tensor]:
    for block in tower.encoder.blocks:
        block.attn_implementation = attn
    with torch.no_grad():
        return list(projector(tower(pixel_values, grid_thws)))


def _assert_per_image(ours: torch.Tensor, official: list[torch.Tensor], grid_thws: torch.Tensor) -> None:
    rows = feature_rows(grid_thws, (2, 2))
    assert [f.shape[0] for f in official] == rows and ours.shape[0] == sum(rows)
    for mine, theirs in zip(torch.split(ours, rows), official):
        assert rel_err(mine, theirs) <= REL_TOL


def test_layout_equals_official_and_checkpoint(tiny_dir, encoder, reference):
    official = {n: tuple(t.shape) for n, t in reference.state_dict().items() if n.startswith(VISION_PREFIXES)}
    ours = {n: tuple(t.shape) for n, t in encoder.state_dict().items()}
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        stored = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n.startswith(VISION_PREFIXES)}
    assert ours == official == stored
    assert 3_000 <= sum(t.numel() for t in encoder.parameters()) <= 100_000  # tiny-k3 keeps a tiny tower
    for name, tensor in reference.state_dict().items():
        if name in ours:  # the official model read the same values from the folder
            assert torch.equal(tensor, encoder.state_dict()[name]), name


@pytest.mark.parametrize("attn", ["eager", "flash_attention_2"])
@pytest.mark.parametrize("case", sorted(GRIDS))
def test_tiny_k3_matches_official(encoder, reference, case, attn):
    pixel_values, grid_thws = _pixels(GRIDS[case], 14, seed=len(case))
    official = _official_features(reference.vision_tower, reference.mm_projector, pixel_values, grid_thws, attn)
    _assert_per_image(encoder(pixel_values, grid_thws), official, grid_thws)


def _variant_vision_config() -> dict:
    raw = copy.deepcopy(preset_config("tiny-k3"))
    raw["vision_config"].update({"norm_type": "layernorm", "attn_bias": True, "linear_bias": True,
                                 "patch_embed_proj_bias": True, "vt_num_attention_heads": 3, "qkv_hidden_size": 48,
                                 "pos_emb_interpolation_mode": "bicubic", "init_pos_emb_height": 12,
                                 "init_pos_emb_width": 10, "projector_ln_eps": 1e-6})
    return raw


def _official_modules(vision_config: dict):
    pkg = load_reference_package()
    cfg = pkg.configuration_kimi_k3.KimiK3VisionConfig(**vision_config)
    cfg._attn_implementation = "eager"
    k3 = pkg.modeling_kimi_k3
    tower = k3.MoonViT3dPretrainedModel(k3.VisionTowerConfig(cfg)).float().eval()
    return tower, k3.PatchMergerMLPV2(k3.ProjectorConfig(cfg)).float().eval()


@pytest.mark.parametrize("grids", [[[1, 12, 10]], [[1, 8, 6], [1, 20, 4]], [[2, 8, 6]], [[1, 4, 4], [3, 6, 10]]],
                         ids=["exact", "interpolated", "clip", "image+clip"])
def test_variant_config_matches_official(grids):
    """LayerNorm, biases everywhere, qkv width ≠ hidden width, bicubic non-square position grid, multi-frame clips
    (sin-cos time embedding, frames averaged in the merge)."""
    raw = _variant_vision_config()
    config = ModelConfig.from_dict(raw)
    ours = build_vision(config, torch.float32, "cpu")
    init_vision_weights(ours, seed=11)
    tower, projector = _official_modules(raw["vision_config"])
    state = ours.state_dict()
    tower.load_state_dict({n.removeprefix("vision_tower."): t for n, t in state.items()
                           if n.startswith("vision_tower.")}, strict=True)
    projector.load_state_dict({n.removeprefix("mm_projector."): t for n, t in state.items()
                               if n.startswith("mm_projector.")}, strict=True)
    pixel_values, grid_thws = _pixels(grids, 14, seed=5)
    official = _official_features(tower, projector, pixel_values, grid_thws, "eager")
    _assert_per_image(ours(pixel_values, grid_thws), official, grid_thws)


def test_bad_grids_are_refused(encoder):
    pixel_values, grid_thws = _pixels([[1, 4, 4]], 14, seed=0)
    with pytest.raises(ValueError, match="patches"):
        encoder(pixel_values[:-1], grid_thws)
    with pytest.raises(ValueError, match="merge kernel"):
        encoder(*_pixels([[1, 3, 4]], 14, seed=0))
    with pytest.raises(ValueError, match="512"):
        encoder(torch.zeros(514 * 2, 3, 14, 14), torch.tensor([[1, 514, 2]]))
