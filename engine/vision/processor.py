"""Kimi K3 image preprocessing, equal to the official `KimiK3VisionProcessor`, and the prompt side of images.

Contract:
- `ProcessorConfig` is the checkpoint's `preprocessor_config.json` `media_proc_cfg` (patch size, merge kernel,
  patch limits, mean/std, transparent-background fill) plus this server's input limits; `load_processor_config(dir)`
  reads it (released defaults when the file is absent). `media_proc_cfg()` writes the released form back.
- `decode_image(data, config)`: raw bytes, a base64 `data:` URL or a PIL image -> a decoded PIL image (first frame,
  original mode; no EXIF rotation, as the official code). Every bad input raises `ImageInputError` with a `reason`
  (`not_an_image`, `truncated`, `bad_dimensions`, `too_many_pixels`, `too_many_bytes`, `too_many_decoded_bytes`,
  `too_slow`) and a message; sizes and the decoded bytes (`decoded_bytes`: the pixels in Pillow's layout plus their
  RGB conversion, against `max_decoded_bytes`) are checked from the header, before any pixel is decoded; a decode
  that took more than `max_decode_s` CPU seconds is refused after it (Pillow cannot be interrupted: the engine decodes off
  its step thread, engine/vision/feed.py).
- `preprocess(image, config) -> ProcessedImage`: colour conversion exactly as the official code (with no
  `transparent_bg_config`: Pillow's `convert("RGB")`, so alpha is dropped and palettes / grayscale expand;
  with one: alpha composited over the configured background, before or after the resize), the resize plan
  (`plan_resize`: scaled down to fit `in_patch_limit` patches and `patch_limit_on_one_side` patches per side, then
  zero-padded at the bottom / right to a multiple of patch·merge), Pillow bicubic resize, `(x/255 − mean)/std` in
  float32, and patches `[L, 3, p, p]` in row-major grid order with `grid_thw = (1, H/p, W/p)`. Pure numpy.
- `feature_rows` (of a `ProcessedImage` or `plan_resize`) is the number of encoder rows the image becomes:
  (H/p/merge)·(W/p/merge), the number of `<|media_pad|>` tokens it occupies after `expand_media_pads`.
- `image_prompt(width, height)` is the official placeholder text for one image (original size);
  `expand_media_pads(token_ids, feature_rows_per_image, pad_id)` replaces the k-th `<|media_pad|>` by
  `feature_rows_per_image[k]` copies (pure; `ValueError` when counts differ); `media_spans(expanded, pad_id)` is
  each image's (offset, length) in the expanded prompt (images are never adjacent: the official placeholder puts
  `<|media_end|>` after each pad).
- `to_tensors(images)` is the only function that imports torch: `(pixel_values [ΣL, 3, p, p] float32,
  grid_thws [N, 3] int64)` for `engine.vision.encoder.VisionEncoder`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

PROCESSOR_FILE = "preprocessor_config.json"
FILL_STAGES = ("before_resize", "after_resize")
PATTERNS = ("white", "black", "gray", "chessboard")
REASONS = ("not_an_image", "truncated", "bad_dimensions", "too_many_pixels", "too_many_bytes", "too_many_decoded_bytes",
           "too_slow")
# Bytes per pixel Pillow holds a decoded image in (its internal layout: 1, 2 or 4), by mode; others: 4.
_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}


class ImageInputError(ValueError):
    """An image the server will not process; `reason` is one of `REASONS`, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BackgroundFill:
    """The official `TransparentBgConfig`: what shows through transparent pixels."""

    pattern: str = "black"
    chessboard_square_size: int = 16
    chessboard_square_on_top_left: bool = True
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 200


@dataclass(frozen=True)
class ProcessorConfig:
    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg: BackgroundFill | None = None  # None: plain convert("RGB")
    fill_stage: str = "before_resize"
    # Input limits (ours, not the release's).
    max_image_bytes: int = 20 << 20
    max_pixels: int = 8192 * 8192
    max_side: int = 32768
    max_aspect_ratio: float = 200.0
    # What decoding may cost: the decoded image plus its RGB conversion (Pillow keeps RGB at 4 bytes a pixel), and
    # the CPU time of decoding the pixels (an 81 KiB all-zero PNG can declare 8000x8000).
    max_decoded_bytes: int = 8192 * 8192 * 8
    max_decode_s: float = 10.0
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # media_proc_cfg keys kept verbatim

    @classmethod
    def from_media_proc_cfg(cls, cfg: dict[str, Any]) -> "ProcessorConfig":
        known = {"patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                 "fixed_output_tokens", "image_mean", "image_std", "transparent_bg_config",
                 "transparent_bg_fill_stage"}
        defaults = cls()
        bg = cfg.get("transparent_bg_config")
        stage = cfg.get("transparent_bg_fill_stage", defaults.fill_stage)
        if stage not in FILL_STAGES:
            raise ValueError(f"media_proc_cfg.transparent_bg_fill_stage {stage!r}: expected one of {FILL_STAGES}")
        fill = None if bg is None else BackgroundFill(**bg)
        if fill is not None and fill.pattern not in PATTERNS:
            raise ValueError(f"transparent_bg_config.pattern {fill.pattern!r}: expected one of {PATTERNS}")
        return cls(
            patch_size=int(cfg.get("patch_size", defaults.patch_size)),
            merge_kernel_size=int(cfg.get("merge_kernel_size", defaults.merge_kernel_size)),
            in_patch_limit=int(cfg.get("in_patch_limit", defaults.in_patch_limit)),
            patch_limit_on_one_side=int(cfg.get("patch_limit_on_one_side", defaults.patch_limit_on_one_side)),
            fixed_output_tokens=cfg.get("fixed_output_tokens"),
            image_mean=tuple(float(m) for m in cfg.get("image_mean", defaults.image_mean)),
            image_std=tuple(float(s) for s in cfg.get("image_std", defaults.image_std)),
            transparent_bg=fill, fill_stage=stage,
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def media_proc_cfg(self) -> dict[str, Any]:
        """The released `media_proc_cfg` form of this config (input limits are not part of it)."""
        cfg = {"patch_size": self.patch_size, "merge_kernel_size": self.merge_kernel_size,
               "in_patch_limit": self.in_patch_limit, "patch_limit_on_one_side": self.patch_limit_on_one_side,
               "fixed_output_tokens": self.fixed_output_tokens, "image_mean": list(self.image_mean),
               "image_std": list(self.image_std), **self.extra}
        if self.transparent_bg is not None:
            cfg["transparent_bg_config"] = vars(self.transparent_bg).copy()
            cfg["transparent_bg_fill_stage"] = self.fill_stage
        return cfg


def load_processor_config(model_dir: str | Path) -> ProcessorConfig:
    path = Path(model_dir) / PROCESSOR_FILE
    if not path.is_file():
        return ProcessorConfig()
    return ProcessorConfig.from_media_proc_cfg(json.loads(path.read_text()).get("media_proc_cfg", {}))


# ----------------------------------------------------------------------------------------------------------------
# Decoding and checking
# ----------------------------------------------------------------------------------------------------------------

def decode_image(data: bytes | str | Image.Image, config: ProcessorConfig) -> Image.Image:
    if isinstance(data, Image.Image):
        _check_size(data.size, config)
        return data
    raw = _raw_bytes(data, config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as exc:
        raise ImageInputError("too_many_pixels", f"image is too large to decode: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageInputError("not_an_image", f"the {len(raw)} bytes are not an image in a format Pillow reads, or "
                                              "its header is invalid (e.g. a zero width or height)") from exc
    except (SyntaxError, ValueError, OSError) as exc:
        raise ImageInputError("not_an_image", f"the image header is invalid: {exc}") from exc
    _check_size(image.size, config)
    _check_decoded_bytes(image, config)
    started = time.thread_time()  # CPU time: a loaded machine or a low-priority thread does not change it
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError("truncated", f"{image.format} image is truncated or corrupt: {exc}") from exc
    took = time.thread_time() - started
    if took > config.max_decode_s:
        raise ImageInputError("too_slow", f"decoding the {image.width}x{image.height} image took {took:.1f} CPU "
                                          f"seconds, over the limit of {config.max_decode_s:g} s")
    return image


def decoded_bytes(image: Image.Image) -> int:
    """Memory decoding `image` takes: its pixels in Pillow's layout plus their RGB conversion (4 bytes a pixel)."""
    return image.width * image.height * (_PIXEL_BYTES.get(image.mode, 4) + 4)


def _check_decoded_bytes(image: Image.Image, config: ProcessorConfig) -> None:
    need = decoded_bytes(image)
    if need > config.max_decoded_bytes:
        raise ImageInputError("too_many_decoded_bytes", f"the {image.width}x{image.height} {image.mode} image "
                                                        f"decodes to {need} bytes, over the limit of "
                                                        f"{config.max_decoded_bytes}")


def _raw_bytes(data: bytes | str, config: ProcessorConfig) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, str) and data.startswith("data:"):
        header, _, payload = data.partition(",")
        if not header.endswith(";base64"):
            raise ImageInputError("not_an_image", "a data: URL image must be base64-encoded (data:...;base64,...)")
        if len(payload) * 3 // 4 > config.max_image_bytes:
            raise ImageInputError("too_many_bytes", _too_many_bytes(len(payload) * 3 // 4, config))
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError("not_an_image", f"the data: URL is not valid base64: {exc}") from exc
    else:
        raise ImageInputError("not_an_image", f"an image must be bytes or a base64 data: URL, got {type(data).__name__}")
    if len(raw) > config.max_image_bytes:
        raise ImageInputError("too_many_bytes", _too_many_bytes(len(raw), config))
    if not raw:
        raise ImageInputError("not_an_image", "the image data is empty")
    return raw


def _too_many_bytes(size: int, config: ProcessorConfig) -> str:
    return f"image is {size} bytes, over the limit of {config.max_image_bytes} bytes"


def _check_size(size: tuple[int, int], config: ProcessorConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageInputError("bad_dimensions", f"image has zero size ({width}x{height})")
    if max(width, height) > config.max_side:
        raise ImageInputError("bad_dimensions", f"image is {width}x{height}; sides are limited to {config.max_side}")
    if max(width, height) / min(width, height) > config.max_aspect_ratio:
        raise ImageInputError("bad_dimensions", f"image is {width}x{height}; the aspect ratio is limited to "
                                                f"{config.max_aspect_ratio:g}:1")
    if width * height > config.max_pixels:
        raise ImageInputError("too_many_pixels", f"image is {width}x{height} = {width * height} pixels, over the "
                                                 f"limit of {config.max_pixels}")


# ----------------------------------------------------------------------------------------------------------------
# Colour conversion (the official `fill_transparent_bg_with`)
# ----------------------------------------------------------------------------------------------------------------

def to_rgb(image: Image.Image, fill: BackgroundFill | None) -> Image.Image:
    if fill is None:
        return image.convert("RGB")
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))  # [h, w, 4] uint8
    alpha = rgba[:, :, 3:].astype(np.float32) / 255.0  # [h, w, 1]
    blended = alpha * rgba[:, :, :3] + (1 - alpha) * _background(fill, rgba.shape[0], rgba.shape[1])
    return Image.fromarray(blended.astype(np.uint8))


def _background(fill: BackgroundFill, height: int, width: int) -> np.ndarray:
    """[height, width, 3] uint8."""
    if fill.pattern != "chessboard":
        value = {"white": 255, "black": 0, "gray": 128}[fill.pattern]
        return np.full((height, width, 3), value, dtype=np.uint8)
    size = fill.chessboard_square_size
    parity = (np.arange(height)[:, None] // size + np.arange(width)[None, :] // size) % 2  # [h, w]
    gray = parity == (1 if fill.chessboard_square_on_top_left else 0)
    board = np.where(gray, fill.chessboard_gray_value, fill.chessboard_white_value).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


# ----------------------------------------------------------------------------------------------------------------
# Resize plan, pixels, patches
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResizePlan:
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    grid_height: int  # patches
    grid_width: int
    feature_rows: int  # encoder rows = pad tokens after expansion
    num_tokens: int  # the official count (`fixed_output_tokens` when set, else feature_rows)


def plan_resize(width: int, height: int, config: ProcessorConfig) -> ResizePlan:
    """The official `navit_resize_image`: fit the patch limits, then pad to a multiple of patch · merge."""
    p, side = config.patch_size, config.patch_limit_on_one_side
    fit = math.sqrt(config.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, fit, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    factor = config.merge_kernel_size * p
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    grid_h, grid_w = (new_h + pad_h) // p, (new_w + pad_w) // p
    rows = (grid_h // config.merge_kernel_size) * (grid_w // config.merge_kernel_size)
    tokens = rows if config.fixed_output_tokens is None else int(config.fixed_output_tokens)
    return ResizePlan(new_w, new_h, pad_w, pad_h, grid_h, grid_w, rows, tokens)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [L, 3, p, p] float32, L = grid_height * grid_width
    grid_thw: tuple[int, int, int]  # (1, grid_height, grid_width)
    size: tuple[int, int]  # the original (width, height), as in the prompt text
    plan: ResizePlan

    @property
    def feature_rows(self) -> int:
        return self.plan.feature_rows

    @property
    def prompt(self) -> str:
        return image_prompt(*self.size)


def preprocess(image: Image.Image, config: ProcessorConfig) -> ProcessedImage:
    before = config.fill_stage == "before_resize"
    source = to_rgb(image, config.transparent_bg) if before else image
    plan = plan_resize(source.width, source.height, config)
    resized = source.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    if not before:
        resized = to_rgb(resized, config.transparent_bg)
    pixels = np.pad(np.asarray(resized), ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))  # [H, W, 3] uint8
    normalised = (pixels / 255.0).astype(np.float32)
    normalised -= np.array(config.image_mean)
    normalised *= 1.0 / np.array(config.image_std)
    p = config.patch_size
    patches = normalised.reshape(plan.grid_height, p, plan.grid_width, p, 3).transpose(0, 2, 4, 1, 3)
    return ProcessedImage(pixel_values=np.ascontiguousarray(patches.reshape(-1, 3, p, p)),
                          grid_thw=(1, plan.grid_height, plan.grid_width), size=source.size, plan=plan)


def to_tensors(images: list[ProcessedImage]):
    """(pixel_values [ΣL, 3, p, p] float32, grid_thws [N, 3] int64) as torch tensors."""
    import torch

    pixel_values = torch.cat([torch.from_numpy(im.pixel_values) for im in images])
    grid_thws = torch.tensor([im.grid_thw for im in images], dtype=torch.int64)
    return pixel_values, grid_thws


# ----------------------------------------------------------------------------------------------------------------
# Prompt side
# ----------------------------------------------------------------------------------------------------------------

def image_prompt(width: int, height: int) -> str:
    return f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"


def expand_media_pads(token_ids: list[int], feature_rows_per_image: list[int], pad_id: int) -> list[int]:
    """Replaces the k-th `pad_id` by `feature_rows_per_image[k]` copies of it."""
    pads = sum(1 for t in token_ids if t == pad_id)
    if pads != len(feature_rows_per_image):
        raise ValueError(f"the prompt has {pads} media pad tokens for {len(feature_rows_per_image)} images")
    if any(rows < 1 for rows in feature_rows_per_image):
        raise ValueError(f"every image has at least one feature row, got {list(feature_rows_per_image)}")
    rows = iter(feature_rows_per_image)
    out: list[int] = []
    for token in token_ids:
        out.extend([pad_id] * next(rows) if token == pad_id else [token])
    return out


def media_spans(token_ids: list[int], pad_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `pad_id` in an expanded prompt: one per image, in order."""
    spans: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != pad_id:
            continue
        if spans and spans[-1][0] + spans[-1][1] == i:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans
