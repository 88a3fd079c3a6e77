"""`EncoderCache`: rows by content hash within a byte budget, least recently used evicted first; and
`worker.codec.media_from_proto` / `processor.media_spans`, the wire and prompt sides of image spans."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.vision.cache import EncoderCache
from engine.vision.processor import media_spans
from protos import common_pb2
from worker.codec import media_from_proto


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # n * 16 bytes


def test_lru_within_budget():
    cache = EncoderCache(budget_bytes=64)
    cache.put(b"a", rows(2))
    cache.put(b"b", rows(2))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", rows(2))  # 96 bytes > 64: evicts b, the least recent
    assert b"b" not in cache and b"a" in cache and b"c" in cache and cache.used_bytes == 64
    assert cache.get(b"b") is None and (cache.hits, cache.misses) == (1, 1)
    cache.put(b"huge", rows(10))  # larger than the whole budget: not kept, and it empties the cache
    assert len(cache) == 0 and cache.used_bytes == 0
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_media_spans_and_wire_items():
    assert media_spans([1, 9, 9, 2, 9, 3], pad_id=9) == [(1, 2), (4, 1)]
    item = common_pb2.MediaItem(content_hash=bytes(32), token_offset=4, num_tokens=1, data=b"x")
    first = common_pb2.MediaItem(content_hash=bytes(range(32)), token_offset=1, num_tokens=2, data=b"y")
    images = media_from_proto([item, first])
    assert [(m.offset, m.length, m.data) for m in images] == [(1, 2, b"y"), (4, 1, b"x")]
    with pytest.raises(InvalidRequestError):
        media_from_proto([common_pb2.MediaItem(content_hash=b"short", token_offset=0, num_tokens=1)])
