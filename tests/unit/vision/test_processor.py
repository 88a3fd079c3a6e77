"""Processor parity: `engine.vision.processor` gives exactly the official `KimiK3VisionProcessor`'s pixel values,
grid sizes, token counts and prompt text, on seeded images of many sizes, modes and file formats (RGB, RGBA, LA,
grayscale, 16-bit grayscale, bilevel, palette with and without a transparent entry, CMYK JPEG, GIF), under the
released config and under transparent-background fills before and after the resize; plus the pad expansion."""

from __future__ import annotations

import pytest
import torch

from engine.vision.processor import (
    ProcessorConfig,
    decode_image,
    expand_media_pads,
    image_prompt,
    load_processor_config,
    preprocess,
    to_tensors,
)
from tests.unit.vision.images import encode, make_image
from tests.unit.vision.official import official_preprocess

# (mode, width, height, file format); the big ones exercise the in_patch_limit and patch_limit_on_one_side scaling.
IMAGES = [
    ("RGB", 224, 224, "PNG"), ("RGBA", 100, 300, "PNG"), ("L", 56, 84, "PNG"), ("P", 640, 480, "PNG"),
    ("P-transparent", 97, 61, "PNG"), ("LA", 13, 7, "PNG"), ("1", 1, 1, "PNG"), ("CMYK", 333, 222, "JPEG"),
    ("RGB", 3000, 2000, "JPEG"), ("RGB", 7300, 40, "PNG"), ("I;16", 40, 500, "PNG"), ("RGB", 1024, 768, "JPEG"),
    ("P", 120, 90, "GIF"),
]
SMALL = [im for im in IMAGES if im[1] * im[2] <= 640 * 480]
CONFIGS = {
    "released": ProcessorConfig().media_proc_cfg(),
    "white-before-resize": {**ProcessorConfig().media_proc_cfg(), "transparent_bg_config": {"pattern": "white"}},
    "chessboard-after-resize": {**ProcessorConfig().media_proc_cfg(),
                                "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                                          "chessboard_square_on_top_left": False},
                                "transparent_bg_fill_stage": "after_resize"},
    "gray-after-small-limits": {**ProcessorConfig().media_proc_cfg(), "in_patch_limit": 300,
                                "patch_limit_on_one_side": 24, "transparent_bg_config": {"pattern": "gray"},
                                "transparent_bg_fill_stage": "after_resize"},
}


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}x{case[2]}-{case[3]}"


def _assert_equal_to_official(case, media_proc_cfg: dict, seed: int) -> None:
    mode, width, height, fmt = case
    data = encode(make_image(mode, width, height, seed), fmt)
    want_pixels, want_grids, want_tokens, want_prompt = official_preprocess(data, media_proc_cfg)
    config = ProcessorConfig.from_media_proc_cfg(media_proc_cfg)
    processed = preprocess(decode_image(data, config), config)
    pixel_values, grid_thws = to_tensors([processed])
    assert torch.equal(grid_thws, want_grids)
    assert pixel_values.dtype == want_pixels.dtype and torch.equal(pixel_values, want_pixels)
    assert processed.plan.num_tokens == processed.feature_rows == want_tokens
    assert processed.prompt == want_prompt == image_prompt(width, height)


@pytest.mark.parametrize("case", IMAGES, ids=_case_id)
def test_released_config_equals_official(case):
    _assert_equal_to_official(case, CONFIGS["released"], seed=case[1] + case[2])


@pytest.mark.parametrize("config_name", [name for name in CONFIGS if name != "released"])
@pytest.mark.parametrize("case", SMALL, ids=_case_id)
def test_background_fills_and_limits_equal_official(case, config_name):
    _assert_equal_to_official(case, CONFIGS[config_name], seed=7)


def test_several_images_pack_in_order():
    config = ProcessorConfig()
    images = [preprocess(make_image("RGB", w, h, i), config) for i, (w, h) in enumerate([(56, 56), (90, 30)])]
    pixel_values, grid_thws = to_tensors(images)
    assert grid_thws.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert pixel_values.shape == (16 + 32, 3, 14, 14)
    assert torch.equal(pixel_values[16:], torch.from_numpy(images[1].pixel_values))
    assert [im.feature_rows for im in images] == [4, 8]


def test_expand_media_pads():
    pad = 99
    ids = [1, 2, pad, 3, pad, 4]
    assert expand_media_pads(ids, [3, 1], pad) == [1, 2, pad, pad, pad, 3, pad, 4]
    assert expand_media_pads([5, 6], [], pad) == [5, 6]
    with pytest.raises(ValueError, match="2 media pad tokens for 1 images"):
        expand_media_pads(ids, [3], pad)
    with pytest.raises(ValueError, match="at least one"):
        expand_media_pads(ids, [3, 0], pad)


def test_checkpoint_ships_the_released_processor_config(tiny_dir):
    loaded = load_processor_config(tiny_dir)
    assert loaded == ProcessorConfig()
    for cfg in CONFIGS.values():  # the released form round-trips, with every field written out
        parsed = ProcessorConfig.from_media_proc_cfg(cfg)
        assert ProcessorConfig.from_media_proc_cfg(parsed.media_proc_cfg()) == parsed
        assert parsed.media_proc_cfg().items() >= {k: v for k, v in cfg.items() if k != "transparent_bg_config"}.items()
    with pytest.raises(ValueError, match="fill_stage"):
        ProcessorConfig.from_media_proc_cfg({"transparent_bg_fill_stage": "during"})
