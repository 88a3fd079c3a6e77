"""Images inside engine requests: checking them at admission, and feeding their encoder rows to each forward.

Contract:
- `ImageInput(offset, length, hash, data)` is a `MediaSpan` (so `BlockHasher` mixes `hash` into every block the
  span overlaps) plus the encoded image bytes.
- `check_images` decodes each image fully (so a corrupt file fails admission, not a step) but preprocesses
  nothing: the runner resizes and normalises an image only when the encoder cache misses it. An image
  `MediaSetup.encode_ahead` returned (it carries `config`) was decoded and checked there: only its span is checked.
- `MediaSetup.encode_ahead(images)` is the heavy part done OFF the step thread (`AsyncEngine` runs it on a media
  thread before the request reaches the engine): each image decoded once (the decode limits of
  engine/vision/processor.py), checked against its span length and — unless the encoder cache holds it —
  preprocessed and run through the encoder, its rows carried on the returned `ImageInput.rows`; `prepare` then only stores them in the encoder cache, so a step never
  decodes or encodes that image. Raises `InvalidRequestError` as `check_images` does.
- `check_images(token_ids, images, pad_id, config)` -> the images, each carrying the config; raises
  `InvalidRequestError` (param `messages`) when a span leaves the prompt, overlaps another, covers a token other
  than `pad_id`, when a pad token lies (with images, or without any for a model that takes them) outside every span, when an image has no bytes or does not decode
  (`ImageInputError`'s message), or when its feature rows differ from its span length.
- `MediaFeeder(encoder, cache)`: `prepare(pieces)` encodes, in ONE `VisionEncoder` call for the whole step
  (batched across requests), every image that overlaps a piece and is not in the `EncoderCache` yet; images
  whose tokens are all computed already (prefix-cache hits, earlier chunks) overlap no piece and are never
  encoded. `inputs(pieces)` -> `(mm_positions [M] int64, mm_embeds [M, E])` for one packed forward (row of the
  packed batch, feature row), slicing each image's rows to the part of its span the piece covers; `(None,
  None)` when no piece touches an image. A piece is anything with `req` (having `media`), `start`, `num_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.memory.hashing import MediaSpan
from engine.vision.cache import EncoderCache
from engine.vision.encoder import VisionEncoder
from engine.vision.processor import (ImageInputError, ProcessorConfig, decode_image, plan_resize, preprocess,
                                     to_tensors)


@dataclass(frozen=True)
class ImageInput(MediaSpan):
    data: bytes = b""
    config: ProcessorConfig | None = field(default=None, compare=False, repr=False)  # set once checked
    rows: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [length, E], by encode_ahead


def check_images(token_ids: Sequence[int], images: Sequence[ImageInput], pad_id: int | None,
                 config: ProcessorConfig) -> tuple[ImageInput, ...]:
    """The images, each carrying the preprocessing config; raises InvalidRequestError (see the contract)."""
    if not images:
        if pad_id is not None and pad_id in token_ids:
            raise InvalidRequestError("the prompt has media pad tokens but no images", param="messages")
        return ()
    if pad_id is None:
        raise InvalidRequestError("this model takes no images", param="messages")
    _check_spans(token_ids, images, pad_id)
    return tuple(image if image.config is not None else _checked(image, n, config)[0]
                 for n, image in enumerate(images))


def _check_spans(token_ids: Sequence[int], images: Sequence[ImageInput], pad_id: int) -> None:
    end = 0
    for n, image in enumerate(sorted(images, key=lambda m: m.offset)):
        if image.offset < end or image.length < 1 or image.offset + image.length > len(token_ids):
            raise InvalidRequestError(f"image {n}: its span [{image.offset}, {image.offset + image.length}) "
                                      f"overlaps another or leaves the {len(token_ids)}-token prompt",
                                      param="messages")
        if any(t != pad_id for t in token_ids[image.offset:image.offset + image.length]):
            raise InvalidRequestError(f"image {n}: its span covers tokens other than the media pad",
                                      param="messages")
        end = image.offset + image.length
    if sum(1 for t in token_ids if t == pad_id) != sum(m.length for m in images):
        raise InvalidRequestError("the prompt has media pad tokens outside every image", param="messages")


def _checked(image: ImageInput, n: int, config: ProcessorConfig):
    """-> (the image carrying `config`, its decoded PIL image)."""
    if not image.data:
        raise InvalidRequestError(f"image {n} has no data", param="messages")
    try:
        decoded = decode_image(image.data, config)
    except ImageInputError as exc:
        raise InvalidRequestError(f"image {n}: {exc}", param="messages") from None
    rows = plan_resize(*decoded.size, config).feature_rows
    if rows != image.length:
        raise InvalidRequestError(f"image {n} has {rows} feature rows; its span has {image.length} pad tokens",
                                  param="messages")
    return ImageInput(image.offset, image.length, image.hash, image.data, config), decoded


def _pixels(images: Sequence[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [ΣL, 3, p, p], grid_thws [N, 3]) of checked images."""
    if any(image.config is None for image in images):
        raise ValueError("an image reached the runner unchecked (check_images was skipped)")
    return to_tensors([preprocess(decode_image(image.data, image.config), image.config) for image in images])


def _overlap(image: MediaSpan, start: int, end: int) -> tuple[int, int] | None:
    lo, hi = max(start, image.offset), min(end, image.offset + image.length)
    return (lo, hi) if lo < hi else None


class MediaFeeder:
    def __init__(self, encoder: VisionEncoder, cache: EncoderCache):
        self.encoder = encoder
        self.cache = cache
        self.num_encoded = 0  # images run through the encoder (cache misses)

    def _touched(self, pieces) -> list[ImageInput]:
        seen: dict[bytes, ImageInput] = {}
        for piece in pieces:
            for image in getattr(piece.req, "media", ()):
                if _overlap(image, piece.start, piece.start + piece.num_tokens):
                    seen.setdefault(image.hash, image)
        return list(seen.values())

    def encode(self, image: ImageInput, n: int, config: ProcessorConfig) -> ImageInput:
        """One image decoded, checked, preprocessed and encoded (any thread: it only asks the cache whether it holds
        the image, and then neither preprocesses nor encodes it)."""
        checked, decoded = _checked(image, n, config)
        if image.hash in self.cache:  # seen before: the step finds its rows (or, evicted meanwhile, encodes it)
            return checked
        pixel_values, grid_thws = to_tensors([preprocess(decoded, config)])  # [L, 3, p, p], [1, 3]
        rows = self.encoder(pixel_values.to(self.encoder.dtype), grid_thws)  # [length, E]
        return dataclasses.replace(checked, rows=rows)

    def prepare(self, pieces) -> None:
        todo = [image for image in self._touched(pieces) if image.hash not in self.cache]
        for image in [image for image in todo if image.rows is not None]:  # encoded ahead, off the step thread
            self.cache.put(image.hash, image.rows)
        todo = [image for image in todo if image.rows is None]
        if not todo:
            return
        pixel_values, grid_thws = _pixels(todo)  # [ΣL, 3, p, p], [N, 3]
        rows = self.encoder(pixel_values.to(self.encoder.dtype), grid_thws)  # [M, E]
        for image, features in zip(todo, rows.split([image.length for image in todo])):
            self.cache.put(image.hash, features)
        self.num_encoded += len(todo)

    def inputs(self, pieces) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        positions: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        base = 0
        for piece in pieces:
            start = piece.start
            for image in getattr(piece.req, "media", ()):
                span = _overlap(image, start, start + piece.num_tokens)
                if span is None:
                    continue
                lo, hi = span
                positions.append(torch.arange(base + lo - start, base + hi - start, dtype=torch.long))
                embeds.append(self._rows(image)[lo - image.offset:hi - image.offset])
            base += piece.num_tokens
        if not positions:
            return None, None
        return torch.cat(positions), torch.cat(embeds)  # [M], [M, E]

    def _rows(self, image: ImageInput) -> torch.Tensor:
        rows = self.cache.get(image.hash)
        if rows is None:
            rows = image.rows
        if rows is None:  # evicted since `prepare` (a budget below one step's images): encode it alone
            pixel_values, grid_thws = _pixels([image])
            rows = self.encoder(pixel_values.to(self.encoder.dtype), grid_thws)  # [rows, E]
        return rows


@dataclass(frozen=True)
class MediaSetup:
    """What an engine needs for images: the feeder (None for a text-only checkpoint), the preprocessing config
    and the pad token id (None: the model takes no images)."""

    feeder: MediaFeeder | None
    processor: ProcessorConfig
    pad_id: int | None

    def encode_ahead(self, images: Sequence[ImageInput]) -> tuple[ImageInput, ...]:
        """The images decoded, checked and encoded (see the module docstring); as given for a text-only model."""
        if self.feeder is None:
            return tuple(images)  # the engine refuses them (`check_images`)
        return tuple(self.feeder.encode(image, n, self.processor) for n, image in enumerate(images))


def load_media(model_dir, load_config, pad_id: int | None, cache_bytes: int) -> MediaSetup:
    """Loads the vision encoder where the checkpoint has one (`engine.vision.loader.load_vision`)."""
    from engine.vision.loader import load_vision
    from engine.vision.processor import load_processor_config

    encoder = load_vision(model_dir, load_config)
    if encoder is None:
        return MediaSetup(None, ProcessorConfig(), None)
    return MediaSetup(MediaFeeder(encoder, EncoderCache(cache_bytes)), load_processor_config(model_dir), pad_id)
