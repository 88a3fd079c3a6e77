"""Images in chat requests: reading `image_url` parts, checking them, and the prompt's media items for the mesh.

Contract:
- `MediaConfig` (frozen): the checkpoint's preprocessing (`engine.vision.processor.ProcessorConfig`, limits
  included), the `<|media_pad|>` id, and `max_images` per request. `load_media_config(model_dir)` -> None for a
  checkpoint without `vision_config` (images are then refused with 400 "this model is text-only").
- `image_urls(messages, max_images)` -> (where, url) of every image part, in the renderer's order (messages, then
  their content parts; `where` is `messages[i].content[j]`): 400 `too_many_images` past `max_images`, 400 for a
  part without `image_url.url`. gateway/media_fetch.py reads the same list.
- `collect_images(messages, config, fetched)` decodes each image part (`detail` is accepted and ignored: K3 has one
  resolution rule): a base64 `data:` URL, or the bytes `fetched` holds for its URL (http(s) and `file:` URLs,
  fetched — or refused, naming `--allowed-media-domains` / `--allowed-local-media-path` — by
  gateway/media_fetch.py before planning; a URL it holds no bytes for is 400 `media_url_not_allowed`). Fetched
  bytes pass the same checks as a data URL's. A bad image is an `ApiError` (param `messages`) whose message starts
  with the part (`messages[i].content[j]: ...`): 413 for too many bytes, pixels or decoded bytes
  (`ProcessorConfig.max_decoded_bytes`), 400 for everything else, `too_slow` included (decoding took longer than
  `max_decode_s`); `ImageInputError.reason` is the error `code`.
- `expand(token_ids, images, pad_id)` -> (the prompt with each image's pad expanded to its feature rows, one
  `common_pb2.MediaItem` per image: sha256 of its bytes, token offset, feature rows, bytes, MIME type).
Torch-free: it uses only the processor's numpy / Pillow side.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.vision.processor import (ImageInputError, ProcessorConfig, decode_image, expand_media_pads,
                                     load_processor_config, media_spans, plan_resize)
from gateway.protocol import ApiError
from protos import common_pb2

TOO_LARGE = ("too_many_bytes", "too_many_pixels", "too_many_decoded_bytes")
MIME_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp",
              "BMP": "image/bmp", "TIFF": "image/tiff"}
DEFAULT_MAX_IMAGES = 16


@dataclass(frozen=True)
class MediaConfig:
    processor: ProcessorConfig
    pad_id: int
    max_images: int = DEFAULT_MAX_IMAGES


@dataclass(frozen=True)
class DecodedImage:
    data: bytes
    mime_type: str
    size: tuple[int, int]  # original (width, height): the prompt text names it
    feature_rows: int  # <|media_pad|> tokens after expansion


def load_media_config(model_dir: str | Path, max_images: int = DEFAULT_MAX_IMAGES) -> MediaConfig | None:
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    pad_id = raw.get("media_placeholder_token_id")
    if "vision_config" not in raw or pad_id is None:
        return None
    return MediaConfig(load_processor_config(model_dir), int(pad_id), max_images)


def image_parts(messages: Sequence) -> list[tuple[str, object]]:
    """(where, part) of every image part, in conversation order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
            if kind in ("image_url", "image", "input_image"):
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def image_urls(messages: Sequence, max_images: int) -> list[tuple[str, str]]:
    parts = image_parts(messages)
    if len(parts) > max_images:
        raise ApiError(400, f"the request has {len(parts)} images; at most {max_images} are allowed",
                       param="messages", code="too_many_images")
    return [(where, _url(where, part)) for where, part in parts]


def collect_images(messages: Sequence, config: MediaConfig, fetched: Mapping[str, bytes]) -> list[DecodedImage]:
    return [_load(where, url, config, fetched) for where, url in image_urls(messages, config.max_images)]


def _url(where: str, part) -> str:
    image_url = part.get("image_url") if isinstance(part, dict) else getattr(part, "image_url", None)
    url = image_url.get("url") if isinstance(image_url, dict) else getattr(image_url, "url", image_url)
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: an image part needs image_url.url (a base64 data: URL, or an http(s) or file: "
                            "URL the gateway may read)", param="messages")
    return url


def _load(where: str, url: str, config: MediaConfig, fetched: Mapping[str, bytes]) -> DecodedImage:
    source: bytes | str | None = url if url.split(":", 1)[0].lower() == "data" else fetched.get(url)
    if source is None:
        raise ApiError(400, f"{where}: image_url.url was not fetched; only base64 data: URLs, and the http(s) and "
                            "file: URLs allowed by --allowed-media-domains / --allowed-local-media-path, are read",
                       param="messages", code="media_url_not_allowed")
    try:
        image = decode_image(source, config.processor)
    except ImageInputError as exc:
        raise ApiError(413 if exc.reason in TOO_LARGE else 400, f"{where}: {exc}", param="messages",
                       code=exc.reason) from None
    data = source if isinstance(source, bytes) else _payload(source)
    rows = plan_resize(image.width, image.height, config.processor).feature_rows
    return DecodedImage(data, MIME_TYPES.get(image.format or "", "application/octet-stream"), image.size, rows)


def _payload(url: str) -> bytes:
    import base64

    return base64.b64decode(url.partition(",")[2], validate=True)


def expand(token_ids: list[int], images: Sequence[DecodedImage],
           pad_id: int) -> tuple[list[int], tuple[common_pb2.MediaItem, ...]]:
    ids = expand_media_pads(token_ids, [image.feature_rows for image in images], pad_id)
    items = tuple(common_pb2.MediaItem(content_hash=hashlib.sha256(image.data).digest(), token_offset=offset,
                                       num_tokens=length, data=image.data, mime_type=image.mime_type)
                  for (offset, length), image in zip(media_spans(ids, pad_id), images))
    return ids, items
