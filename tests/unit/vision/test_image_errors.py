"""Bad images: every kind raises `ImageInputError` (a `ValueError`) with its `reason` and a message that says what is
wrong; sizes and decoded bytes are refused from the header alone (a crafted 9000 × 9000 PNG header with no pixel
data is refused as too many pixels, not as truncated), so nothing large is ever decoded; a decode slower than
`max_decode_s` is refused (the default limits admit these images: `test_good_inputs_decode`, the negative control)."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from PIL import Image

from engine.vision.processor import REASONS, ImageInputError, ProcessorConfig, decode_image
from tests.unit.vision.images import encode, make_image

CONFIG = ProcessorConfig()


def _png_header(width: int, height: int) -> bytes:
    """A PNG with a valid IHDR of the given size and no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = encode(make_image("RGB", 64, 48, 0))
JPEG = encode(make_image("RGB", 64, 48, 0), "JPEG")

CASES = [
    ("text bytes", b"hello, this is not a picture", CONFIG, "not_an_image", "not an image"),
    ("empty", b"", CONFIG, "not_an_image", "empty"),
    ("file path", "/etc/passwd", CONFIG, "not_an_image", "bytes or a base64 data: URL"),
    ("bad base64", "data:image/png;base64,@@@not-base64@@@", CONFIG, "not_an_image", "not valid base64"),
    ("url without base64", "data:image/png,rawbytes", CONFIG, "not_an_image", "base64-encoded"),
    ("zero width header", _png_header(0, 10), CONFIG, "not_an_image", "zero width or height"),
    ("truncated png", PNG[: len(PNG) // 2], CONFIG, "truncated", "truncated"),
    ("truncated jpeg", JPEG[: len(JPEG) // 2], CONFIG, "truncated", "truncated"),
    ("zero size image", Image.new("RGB", (0, 12)), CONFIG, "bad_dimensions", "zero size (0x12)"),
    ("side too long", _png_header(40000, 300), CONFIG, "bad_dimensions", "sides are limited to 32768"),
    ("absurd aspect", encode(make_image("RGB", 1000, 2, 0)), CONFIG, "bad_dimensions", "aspect ratio"),
    ("too many pixels", _png_header(9000, 9000), CONFIG, "too_many_pixels", "81000000 pixels"),
    ("decompression bomb", _png_header(20000, 20000), CONFIG, "too_many_pixels", "too large"),
    ("pixel limit", PNG, ProcessorConfig(max_pixels=1000), "too_many_pixels", "over the limit of 1000"),
    ("too many bytes", PNG, ProcessorConfig(max_image_bytes=100), "too_many_bytes", "over the limit of 100 bytes"),
    ("data url too big", _data_url(PNG), ProcessorConfig(max_image_bytes=100), "too_many_bytes", "100 bytes"),
    # 8000 x 8000 RGB from its header: 4 bytes a pixel in Pillow plus 4 for the RGB conversion
    ("decoded bytes", _png_header(8000, 8000), ProcessorConfig(max_decoded_bytes=500_000_000),
     "too_many_decoded_bytes", "decodes to 512000000 bytes, over the limit of 500000000"),
    ("decode time", PNG, ProcessorConfig(max_decode_s=1e-9), "too_slow", "over the limit of 1e-09 s"),
]


@pytest.mark.parametrize("name, data, config, reason, text", CASES, ids=[c[0] for c in CASES])
def test_bad_image_kind(name, data, config, reason, text):
    with pytest.raises(ImageInputError) as err:
        decode_image(data, config)
    assert err.value.reason == reason
    assert text in str(err.value)
    assert isinstance(err.value, ValueError)


def test_every_reason_is_covered():
    assert {c[3] for c in CASES} == set(REASONS)


def test_good_inputs_decode():
    assert CONFIG.max_decoded_bytes >= 8000 * 8000 * 8 and CONFIG.max_decode_s >= 1  # the cases above pass these
    for data in (PNG, JPEG, _data_url(PNG), _data_url(JPEG, "image/jpeg"), make_image("RGBA", 5, 5, 1)):
        image = decode_image(data, CONFIG)
        assert image.size in ((64, 48), (5, 5))
