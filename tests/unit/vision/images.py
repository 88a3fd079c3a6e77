"""Test helper: seeded synthetic images in every mode the processor must handle, encoded as real files.

`make_image(mode, width, height, seed)` -> PIL image: smooth gradients plus noise (so resizing has something to do
and large PNGs stay small), in RGB, RGBA (varying alpha), L, LA, P (adaptive palette), P with a transparent
palette entry, 1 (bilevel), CMYK or I;16. `encode(image, fmt)` -> the file's bytes.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def _rgb_array(width: int, height: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    phase = rng.uniform(0, 6.28, size=(1, 1, 3))
    base = 127.5 + 90 * np.sin(6 * x + 4 * y + phase)
    noise = rng.normal(0.0, 25.0, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)  # [h, w, 3]


def make_image(mode: str, width: int, height: int, seed: int) -> Image.Image:
    rgb = Image.fromarray(_rgb_array(width, height, seed))
    if mode == "RGB":
        return rgb
    if mode in ("RGBA", "LA"):
        alpha = np.random.default_rng(seed + 1).integers(0, 256, size=(height, width), dtype=np.uint8)
        rgba = rgb.copy()
        rgba.putalpha(Image.fromarray(alpha))
        return rgba if mode == "RGBA" else rgba.convert("LA")
    if mode == "P":
        return rgb.quantize(colors=64)
    if mode == "P-transparent":
        image = rgb.quantize(colors=16)
        image.info["transparency"] = 3
        return image
    if mode == "I;16":
        return Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)  # uint16 -> I;16
    return rgb.convert(mode)  # L, 1, CMYK


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()
