"""What the observability tests share (tests/integration/observability/): the gateway side of a request played with
telemetry's own helpers — the root span (`start_request_span`, continuing a REST `traceparent`), the request id
scope and channels with `client_interceptors()` — and the P/D flow the gateway's mesh client runs (Prefill, then
Decode from the handoff); reading spans, `/metrics` samples and streams; a decode service on its own.

The mesh is tests/integration/mesh_harness.py's (tiny-k3, cache, prefill and decode on free ports in the test's
event loop); spans go to OpenTelemetry's global provider (conftest.py's `spans`), as in production.
"""

from __future__ import annotations

import asyncio
import urllib.request
from contextlib import asynccontextmanager

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from cache_service.config import CacheServiceConfig
from cache_service.server import serve as serve_cache
from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from telemetry import tracing
from telemetry.context import request_id_scope
from telemetry.rpc import client_interceptors
from tests.integration.mesh_harness import engine_args, greedy, prompt_suite

MODEL = "tiny-k3"
PROMPT = prompt_suite()[8]  # 40 tokens: two full 16-token blocks and a tail


def run(coro, timeout_s: float = 50.0):
    async def bounded():
        async with asyncio.timeout(timeout_s):  # nothing may hang
            return await coro
    return asyncio.run(bounded())


async def traced_request(prefill_address: str, decode_address: str, request_id: str, prompt: list[int],
                         max_tokens: int, headers: dict | None = None, handoff_key: common_pb2.ObjectKey | None = None):
    """What the gateway does for one request: root span, request id, Prefill then Decode from the handoff over
    channels with telemetry's client interceptors -> (root span, prefill response, decode chunks)."""
    root = tracing.start_request_span(tracing.get_tracer("kdamesh.gateway"), "text_completion", MODEL, headers,
                                      max_tokens=max_tokens, temperature=0.0, request_id=request_id)
    sampling = greedy(max_tokens)
    async with grpc.aio.insecure_channel(prefill_address, interceptors=client_interceptors()) as pch, \
            grpc.aio.insecure_channel(decode_address, interceptors=client_interceptors()) as dch:
        with root.activate(), request_id_scope(request_id):
            generation = common_pb2.GenerationRequest(request_id=request_id, prompt=common_pb2.TokenIds(ids=prompt),
                                                      sampling=sampling)
            pre = await prefill_pb2_grpc.PrefillServiceStub(pch).Prefill(
                prefill_pb2.PrefillRequest(generation=generation), timeout=30)
            source = decode_pb2.HandoffSource(handoff_key=handoff_key or pre.handoff_key,
                                              first_token_id=pre.first_token_id, cached_tokens=pre.cached_tokens)
            call = decode_pb2_grpc.DecodeServiceStub(dch).Decode(
                decode_pb2.DecodeRequest(generation=generation, handoff=source), timeout=30)
            chunks = [chunk async for chunk in call]
    usage = chunks[-1].usage
    root.finish(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens, finish_reasons=["length"])
    return root, pre, chunks


async def read_rest(call) -> list:
    """The remaining messages of a stream read with `read()` (gRPC forbids mixing it with `async for`)."""
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


def trace_of(exporter: InMemorySpanExporter, trace_id: str) -> list:
    return [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]


def ancestors(span, by_id: dict) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


def local_request(request_id: str, max_tokens: int) -> decode_pb2.DecodeRequest:
    """A Decode that prefills PROMPT on the decode worker itself."""
    return decode_pb2.DecodeRequest(generation=common_pb2.GenerationRequest(
        request_id=request_id, sampling=greedy(max_tokens), prompt=common_pb2.TokenIds(ids=PROMPT)),
        local=decode_pb2.LocalPrefill())


async def start_decode(model_dir, kv_cache_memory: int = 8 << 20) -> tuple[object, int]:
    """A decode service alone on a free port, its model loaded -> (server, port). The caller stops it."""
    server, port = await serve_decode(DecodeServiceConfig(
        engine=engine_args(model_dir, kv_cache_memory=kv_cache_memory), address="127.0.0.1:0"))
    await server.ready()
    return server, port


@asynccontextmanager
async def metered_mesh(model_dir):
    """cache, prefill and decode with their /metrics side ports (free ports)."""
    cache, cport = await serve_cache(CacheServiceConfig(address="127.0.0.1:0", metrics_port=0,
                                                        data_plane=False))  # payloads over BatchPut / BatchGet
    cache_address = f"127.0.0.1:{cport}"
    prefill, pport = await serve_prefill(PrefillServiceConfig(engine=engine_args(model_dir),
                                                              cache_address=cache_address, address="127.0.0.1:0",
                                                              metrics_port=0))
    decode, dport = await serve_decode(DecodeServiceConfig(engine=engine_args(model_dir),
                                                           cache_address=cache_address, address="127.0.0.1:0",
                                                           metrics_port=0))
    try:
        await asyncio.gather(prefill.ready(), decode.ready())
        yield {"cache": cache, "prefill": prefill, "decode": decode,
               "prefill_address": f"127.0.0.1:{pport}", "decode_address": f"127.0.0.1:{dport}"}
    finally:
        for server in (decode, prefill, cache):
            await server.stop(1.0)


async def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
            return reply.read().decode()

    return samples_of(await asyncio.to_thread(get))


def samples_of(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(series name, labels): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)
