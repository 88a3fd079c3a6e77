"""Streams running when the HTTP server stops end with an error event before its grace runs out, never mid-air."""

from __future__ import annotations

import asyncio

import pytest

from gateway.protocol import ApiError
from gateway.rest_io import SHUTTING_DOWN, ShutdownClock, until_shutdown


async def _slow_events(n: int, delay: float):
    for i in range(n):
        await asyncio.sleep(delay)
        yield i


def test_events_pass_through_without_shutdown():
    async def run():
        return [e async for e in until_shutdown(_slow_events(5, 0.001), ShutdownClock(grace_s=5))]
    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_shutdown_deadline_ends_a_long_stream_with_503():
    async def run():
        clock = ShutdownClock(grace_s=0.3, margin_s=0.1)
        seen = []
        clock.begin()
        with pytest.raises(ApiError) as err:
            async for e in until_shutdown(_slow_events(1000, 0.01), clock):
                seen.append(e)
        return seen, err.value
    seen, error = asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert 5 <= len(seen) < 1000  # some output, then a clean error well before the stream would have finished
    assert error.status == 503 and error.message == SHUTTING_DOWN


def test_short_stream_finishes_within_the_grace():
    async def run():
        clock = ShutdownClock(grace_s=2.0, margin_s=0.5)
        clock.begin()
        return [e async for e in until_shutdown(_slow_events(10, 0.01), clock)]
    assert asyncio.run(run()) == list(range(10))
