"""Stall deadlines and SSE keep-alives without a network (gateway/stall.py, gateway/mesh_client.py,
gateway/rest_io.py): a decode stream silent past the gap limit raises `WorkerStalled` (the first message gets the
prompt's prefill time more), a silent prefill falls back to the decode worker, a stream that keeps talking is never
cut, a busy worker that answers its health checks is waited on (a queued or preempted request) until its answers
stop, and `with_keepalive` yields keep-alives while it waits without losing the item it waits for. The real
SIGSTOPped worker is tests/faults/test_paused_worker.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.mesh_client import MeshClient, MeshRequest
from gateway.rest_io import KEEPALIVE, with_keepalive
from gateway.stall import StallPolicy, WorkerStalled
from protos import common_pb2, decode_pb2


class _Call:
    """A decode stream: sends `chunks`, each after `gaps_s[i]` seconds of silence."""

    def __init__(self, chunks, gaps_s):
        self.chunks, self.gaps_s = list(chunks), list(gaps_s)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        await asyncio.sleep(self.gaps_s.pop(0))
        return self.chunks.pop(0)

    async def code(self):
        return grpc.StatusCode.OK

    def cancel(self):
        pass


class _Decode:
    def __init__(self, gaps_s):
        self.gaps_s = gaps_s

    def Decode(self, request, timeout=None):  # noqa: N802 (the gRPC method name)
        chunks = [decode_pb2.DecodeChunk(index=0, token_ids=[i]) for i in range(len(self.gaps_s) - 1)]
        chunks.append(decode_pb2.DecodeChunk(index=0, token_ids=[9], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                             usage=common_pb2.Usage(completion_tokens=len(self.gaps_s))))
        return _Call(chunks, self.gaps_s)


class _SilentPrefill:
    async def Prefill(self, request, timeout=None):  # noqa: N802
        await asyncio.sleep(timeout)
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Deadline Exceeded")


async def _generate(gaps_s, route="local", prompt=(1, 2, 3, 4), policy=StallPolicy(timeout_s=0.3),
                    serving_for_s: float = 0.0):
    """The events and stats of one request; the decode worker answers its health checks SERVING every 0.05 s for
    `serving_for_s` seconds (as the gateway's health loop records them)."""
    client = MeshClient(["127.0.0.1:1"], ["127.0.0.1:2"], stall=policy)
    client.decoders["127.0.0.1:1"].stub = _Decode(gaps_s)
    client.prefillers["127.0.0.1:2"].stub = _SilentPrefill()
    client._route = lambda *_args: route
    request = MeshRequest(request_id="r", prompt_token_ids=tuple(prompt), sampling=common_pb2.SamplingParams(),
                          timeout_s=60)

    async def serving():
        end = time.monotonic() + serving_for_s
        while time.monotonic() < end:
            client._serving_at["127.0.0.1:1"] = time.monotonic()
            await asyncio.sleep(0.05)

    health = asyncio.create_task(serving())
    try:
        return [e async for e in client.generate(request)], client.stats
    finally:
        health.cancel()
        await client.close()


def test_a_silent_decode_stream_stalls_after_the_gap_limit():
    start = time.monotonic()
    with pytest.raises(WorkerStalled) as stalled:
        asyncio.run(_generate([0.0, 0.0, 5.0]))
    assert time.monotonic() - start < 2.0
    error = stalled.value.api_error("req-1")
    assert (error.status, error.code, error.headers["Retry-After"]) == (503, "worker_stalled", "5")
    assert "no output for 0.3 s" in error.message and "req-1" in error.message


def test_a_stream_that_keeps_talking_is_never_cut():
    """Eight gaps of 0.2 s (1.6 s in all) under a 0.3 s gap limit: the limit is per gap, not per request."""
    events, _ = asyncio.run(_generate([0.2] * 8))
    assert len(events) == 8 and events[-1].finish_reason == "length"


def test_a_busy_worker_that_answers_its_health_checks_is_waited_on():
    """A request queued or preempted on a busy worker (fair share) is silent far past the gap limit while the worker
    keeps answering SERVING: it waits (1.2 s under a 0.3 s limit). Once the answers stop, the silence ends it within
    the limit of the last one. The control is the test above: the same silence without answers stalls."""
    events, _ = asyncio.run(_generate([1.2, 0.0], serving_for_s=5.0))
    assert len(events) == 2 and events[-1].finish_reason == "length"
    start = time.monotonic()
    with pytest.raises(WorkerStalled):
        asyncio.run(_generate([0.0, 5.0], serving_for_s=0.6))
    assert 0.6 < time.monotonic() - start < 0.6 + 0.3 + 0.5


def test_the_first_message_gets_the_prompts_prefill_time_more():
    policy = StallPolicy(timeout_s=0.3, prefill_tokens_per_s=1000)
    assert policy.first_message_s(700) == pytest.approx(1.0)
    events, _ = asyncio.run(_generate([0.8, 0.0], prompt=range(700), policy=policy))  # a long prompt: 0.8 s is fine
    assert len(events) == 2
    with pytest.raises(WorkerStalled):
        asyncio.run(_generate([0.8, 0.0], prompt=range(4), policy=policy))  # a short one: a stall


def test_a_silent_prefill_is_recomputed_on_the_decode_worker():
    events, stats = asyncio.run(_generate([0.0, 0.0], route="remote"))
    assert stats.prefill_stalls == 1 and stats.prefill_fallbacks == 1
    assert events[-1].route == "fallback" and events[-1].finish_reason == "length"


def test_with_keepalive_keeps_the_pending_item():
    async def slow():
        await asyncio.sleep(0.35)
        yield "a"
        yield "b"

    async def collect():
        return [item async for item in with_keepalive(slow(), 0.1)]

    items = asyncio.run(collect())
    assert items[-2:] == ["a", "b"] and 2 <= items.count(KEEPALIVE) <= 4, items
    assert set(items[:-2]) == {KEEPALIVE}

    async def without():
        return [item async for item in with_keepalive(slow(), 0)]

    assert asyncio.run(without()) == ["a", "b"]


def test_stall_options_are_checked():
    for bad in (dict(timeout_s=0), dict(prefill_tokens_per_s=-1)):
        with pytest.raises(ValueError, match="--stall"):
            StallPolicy(**bad)
