"""Observability across the in-process mesh (tests/integration/mesh_harness.py, tiny-k3): one trace per request from a
gateway-side root span through prefill, cache and decode; each gRPC service's Prometheus `/metrics`; JSON log lines
carrying the request id in every service; and the decode worker's graceful drain on stop / SIGTERM.

The gateway side is played here with telemetry's own helpers — the root span (`start_request_span`, continuing a
REST `traceparent`), the request id scope and channels with `client_interceptors()` — and the P/D flow the gateway's
mesh client runs (Prefill, then Decode from the handoff). Spans go to OpenTelemetry's global provider, installed once
per process with an in-memory exporter (the services use the global provider, as in production).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from cache_service.server import CacheServiceConfig
from cache_service.server import serve as serve_cache
from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from engine.model.checkpoint import make_checkpoint
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from telemetry import tracing
from telemetry.context import request_id_scope
from telemetry.logs import JsonFormatter, RequestContextFilter, log_request
from telemetry.rpc import client_interceptors
from tests.integration.mesh_harness import Mesh, engine_args, greedy, prompt_suite

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-k3"
PROMPT = prompt_suite()[8]  # 40 tokens: two full 16-token blocks and a tail
PARENT_TRACE, PARENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return make_checkpoint(MODEL, tmp_path_factory.mktemp(MODEL), seed=3)


@pytest.fixture(scope="module")
def spans():
    """The spans every service records, through OpenTelemetry's global provider (installed here once)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, SdkTracerProvider):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider = tracing.setup_tracing("kdamesh-test", "none", span_exporter=exporter)
        assert trace.get_tracer_provider() is provider, "another global tracer provider is installed"
    yield exporter
    exporter.shutdown()  # spans of later tests are dropped


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
            pre = await prefill_pb2_grpc.PrefillServiceStub(pch).Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling), timeout=30)
            source = decode_pb2.HandoffSource(handoff_key=handoff_key or pre.handoff_key,
                                              first_token_id=pre.first_token_id,
                                              prompt=common_pb2.TokenIds(ids=prompt), cached_tokens=pre.cached_tokens)
            call = decode_pb2_grpc.DecodeServiceStub(dch).Decode(decode_pb2.DecodeRequest(
                request_id=request_id, sampling=sampling, handoff=source), timeout=30)
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


# -- (a) one trace --------------------------------------------------------------------------------------------------


def test_one_request_is_one_trace_across_prefill_cache_and_decode(tiny_k3, spans):
    headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}  # from the REST client

    async def go():
        async with Mesh(tiny_k3, cache_data_plane=False) as mesh:  # payloads over BatchPut / BatchGet
            result = await traced_request(mesh.prefill_address, mesh.decode_address, "req-trace-1", PROMPT, 8,
                                          headers)
            await mesh.drain()  # background snapshot publication and handoff claim
            return result

    root, pre, chunks = run(go())
    assert root.trace_id == PARENT_TRACE
    assert sum(len(c.token_ids) for c in chunks) == 8
    got = trace_of(spans, PARENT_TRACE)
    by_id = {s.context.span_id: s for s in got}
    names = {s.name for s in got}
    assert {"text_completion tiny-k3", "kdamesh.v1.PrefillService/Prefill", "prefill", "prefix.lookup",
            "handoff.publish", "kdamesh.v1.CacheService/Lookup", "cache.lookup", "kdamesh.v1.CacheService/BatchPut",
            "cache.put", "kdamesh.v1.DecodeService/Decode", "decode", "handoff.claim",
            "kdamesh.v1.CacheService/BatchGet", "cache.get", "kdamesh.v1.CacheService/Remove"} <= names, sorted(names)
    assert {s.instrumentation_scope.name for s in got} >= {"kdamesh.gateway", "kdamesh.rpc", "kdamesh.prefill",
                                                          "kdamesh.cache", "kdamesh.decode"}

    # parent links: one root (parented on the REST caller's span), every other parent inside the trace
    (root_span,) = [s for s in got if s.name == "text_completion tiny-k3"]
    assert root_span.kind == SpanKind.SERVER and root_span.parent.is_remote
    assert format(root_span.parent.span_id, "016x") == PARENT_SPAN
    orphans = [s.name for s in got if s is not root_span and (s.parent is None or s.parent.span_id not in by_id)]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    one = {s.name: s for s in got}
    puts = [ancestors(s, by_id) for s in got if s.name == "cache.put"]  # the handoff's, and the snapshots'
    assert ["kdamesh.v1.CacheService/BatchPut", "handoff.publish", "prefill", "kdamesh.v1.PrefillService/Prefill",
            "text_completion tiny-k3"] in puts, puts
    gets = [s for s in got if s.name == "cache.get"]  # the client spreads a batch over up to two streams
    for get in gets:
        assert ancestors(get, by_id) == ["kdamesh.v1.CacheService/BatchGet", "handoff.claim", "decode",
                                         "kdamesh.v1.DecodeService/Decode", "text_completion tiny-k3"]
    assert ancestors(one["cache.lookup"], by_id) == ["kdamesh.v1.CacheService/Lookup", "prefix.lookup", "prefill",
                                                     "kdamesh.v1.PrefillService/Prefill", "text_completion tiny-k3"]
    servers = {s.name: s for s in got if s.kind == SpanKind.SERVER and s is not root_span}
    assert all(s.parent.is_remote for s in servers.values())  # each continued from its caller's traceparent
    assert servers["kdamesh.v1.DecodeService/Decode"].attributes["rpc.grpc.status_code"] == 0

    # GenAI attributes on the root; bytes, blocks, hit tokens and backend below it
    a = root_span.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    put = [s for s in got if s.name == "cache.put" and s.attributes["kdamesh.bytes"] > 0]
    assert put and all(s.attributes["kdamesh.cache.backend"] == "memory" for s in put)
    publish = one["handoff.publish"].attributes
    assert publish["kdamesh.blocks"] == 2 and publish["kdamesh.bytes"] >= publish["kdamesh.handoff.bytes"] > 0
    assert "kdamesh.hit_tokens" in one["prefix.lookup"].attributes
    assert one["prefill"].attributes["kdamesh.hit_tokens"] == pre.cached_tokens
    claim = one["handoff.claim"].attributes
    assert claim["kdamesh.blocks"] == 2 and claim["kdamesh.bytes"] > 0 and "error.type" not in claim
    assert one["decode"].attributes["kdamesh.decode.path"] == "handoff"
    assert one["decode"].attributes["gen_ai.usage.output_tokens"] == 8
    assert sum(get.attributes["kdamesh.bytes"] for get in gets) == claim["kdamesh.bytes"]


def test_an_unusable_handoff_is_an_error_type_on_its_span(tiny_k3, spans):
    async def go():
        async with Mesh(tiny_k3) as mesh:
            bogus = common_pb2.ObjectKey(model_fingerprint=mesh.decode_worker.fingerprint,
                                         kind=common_pb2.OBJECT_KIND_HANDOFF, content_hash=b"\x07" * 32)
            return await traced_request(mesh.prefill_address, mesh.decode_address, "req-trace-2", PROMPT, 4,
                                        handoff_key=bogus)

    root, _, chunks = run(go())
    assert sum(len(c.token_ids) for c in chunks) == 4 and not chunks[-1].used_handoff
    one = {s.name: s for s in trace_of(spans, root.trace_id)}
    assert one["handoff.claim"].attributes["error.type"] == "missing"
    assert one["decode"].attributes["kdamesh.decode.path"] == "recompute"
    assert "error.type" not in one["decode"].attributes  # recomputed: the request itself succeeded


# -- (b) /metrics ---------------------------------------------------------------------------------------------------


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

    text = await asyncio.to_thread(get)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_every_grpc_service_serves_metrics_that_move(tiny_k3, spans):
    async def go():
        async with metered_mesh(tiny_k3) as m:
            ports = {role: m[role].metrics_port for role in ("cache", "prefill", "decode")}
            before = {role: await scrape(port) for role, port in ports.items()}
            for i in range(2):  # the second prefill hits the first one's blocks
                await traced_request(m["prefill_address"], m["decode_address"], f"req-metrics-{i}", PROMPT, 8)
            async with grpc.aio.insecure_channel(m["decode_address"]) as channel:  # a stream in flight
                call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
                    request_id="req-metrics-live", sampling=greedy(200),
                    local=decode_pb2.LocalPrefill(prompt=common_pb2.TokenIds(ids=PROMPT))), timeout=30)
                rest = [await call.read()]
                during = await scrape(ports["decode"])
                rest += await read_rest(call)
            await m["prefill"].worker.drain()
            await m["decode"].worker.drain()
            after = {role: await scrape(port) for role, port in ports.items()}
            return before, during, after, rest

    before, during, after, rest = run(go())
    assert rest[-1].usage.completion_tokens == 200

    p0, p1 = before["prefill"], after["prefill"]
    for name in ("kdamesh_prefill_model_loaded", "kdamesh_prefill_running_requests", "kdamesh_prefill_queue_depth",
                 "kdamesh_prefill_kv_block_usage_ratio", "kdamesh_prefill_state_slot_usage_ratio",
                 "kdamesh_prefill_state_snapshots", "kdamesh_prefill_preemptions_total"):
        assert (name, frozenset()) in p1, name
    assert value(p1, "kdamesh_prefill_model_loaded") == 1
    assert value(p1, "kdamesh_prefill_requests_total", method="Prefill", status="OK") - \
        value(p0, "kdamesh_prefill_requests_total", method="Prefill", status="OK") == 2
    assert value(p1, "kdamesh_prefill_time_to_first_token_seconds_count", path="prefill") == 2
    assert value(p1, "kdamesh_prefill_prompt_tokens_total", path="prefill") == 2 * len(PROMPT)
    assert value(p1, "kdamesh_prefill_prefix_lookup_tokens_total") - \
        value(p0, "kdamesh_prefill_prefix_lookup_tokens_total") == 2 * len(PROMPT)
    assert value(p1, "kdamesh_prefill_prefix_hit_tokens_total") > value(p0, "kdamesh_prefill_prefix_hit_tokens_total")
    assert value(p1, "kdamesh_prefill_kv_blocks", state="total") > 0
    assert value(p1, "kdamesh_prefill_kv_blocks", state="cached") > value(p0, "kdamesh_prefill_kv_blocks",
                                                                           state="cached")
    assert value(p1, "kdamesh_prefill_transfer_bytes_total", op="publish") > 0
    assert value(p1, "kdamesh_prefill_transfer_seconds_total", op="publish") > 0
    assert value(p1, "kdamesh_prefill_published_blocks_total") == 2

    d0, d1 = before["decode"], after["decode"]
    assert value(d1, "kdamesh_decode_requests_total", method="Decode", status="OK") - \
        value(d0, "kdamesh_decode_requests_total", method="Decode", status="OK") == 3
    assert value(d1, "kdamesh_decode_time_to_first_token_seconds_count", path="handoff") == 2
    assert value(d1, "kdamesh_decode_time_per_output_token_seconds_count", path="handoff") == 2
    assert value(d1, "kdamesh_decode_time_per_output_token_seconds_count", path="local") == 1
    assert value(d1, "kdamesh_decode_generation_tokens_total", path="handoff") == 16
    assert value(d1, "kdamesh_decode_transfer_bytes_total", op="handoff_load") > 0
    assert value(d1, "kdamesh_decode_handoffs_total", outcome="loaded") == 2
    assert value(d1, "kdamesh_decode_prefix_lookup_tokens_total") > \
        value(d0, "kdamesh_decode_prefix_lookup_tokens_total")
    assert value(during, "kdamesh_decode_running_requests") >= 1
    assert value(during, "kdamesh_decode_requests_in_flight", method="Decode") == 1
    assert value(during, "kdamesh_decode_kv_block_usage_ratio") > 0
    assert value(d1, "kdamesh_decode_running_requests") == 0 and value(d1, "kdamesh_decode_queue_depth") == 0
    assert value(d1, "kdamesh_decode_requests_in_flight", method="Decode") == 0

    c0, c1 = before["cache"], after["cache"]
    for method in ("BatchPut", "BatchGet", "Lookup"):
        assert value(c1, "kdamesh_cache_requests_total", method=method, status="OK") > \
            value(c0, "kdamesh_cache_requests_total", method=method, status="OK"), method
    assert value(c1, "kdamesh_cache_objects") > value(c0, "kdamesh_cache_objects")
    assert value(c1, "kdamesh_cache_stored_bytes") > 0
    assert value(c1, "kdamesh_cache_transfer_bytes_total", direction="put") > 0
    assert value(c1, "kdamesh_cache_hits_total") > value(c0, "kdamesh_cache_hits_total")
    for name in ("kdamesh_cache_evictions_total", "kdamesh_cache_corrupt_reads_total"):
        assert (name, frozenset()) in c1, name


def test_a_cancelled_stream_is_counted_and_its_spans_end_quietly(tiny_k3, spans, caplog):
    from prometheus_client import generate_latest

    async def go():
        server, port = await serve_decode(DecodeServiceConfig(engine=engine_args(tiny_k3), address="127.0.0.1:0"))
        await server.ready()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors()) as channel:
                with request_id_scope("req-cancel"):
                    call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(_local("req-cancel", 300), timeout=30)
                    await call.read()
                    await call.read()
                    call.cancel()
            deadline = time.monotonic() + 10
            while True:
                got = {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(
                    generate_latest(server.metrics.registry).decode()) for s in family.samples}
                if value(got, "kdamesh_decode_requests_in_flight", method="Decode") == 0 and \
                        value(got, "kdamesh_decode_running_requests") == 0:
                    return got
                assert time.monotonic() < deadline, "the cancelled stream is still counted or running"
                await asyncio.sleep(0.05)
        finally:
            await server.stop(1.0)

    with caplog.at_level(logging.WARNING):
        got = run(go())
    assert value(got, "kdamesh_decode_requests_total", method="Decode", status="CANCELLED") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    decode = [s for s in spans.get_finished_spans() if s.name == "decode"
              and s.attributes.get("kdamesh.request_id") == "req-cancel"]
    assert len(decode) == 1 and decode[0].attributes["error.type"] == "cancelled"


# -- (c) logs -------------------------------------------------------------------------------------------------------


def test_json_log_lines_carry_the_request_id_through_every_service(tiny_k3, spans):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter("kdamesh-test"))
    root_logger = logging.getLogger()
    old_level = root_logger.level
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.DEBUG)  # the cache service's access lines are DEBUG

    async def go():
        async with Mesh(tiny_k3, cache_data_plane=False) as mesh:  # payloads over BatchPut / BatchGet
            root, _, chunks = await traced_request(mesh.prefill_address, mesh.decode_address, "req-logs-1", PROMPT,
                                                   6)
            await mesh.drain()
            log_request(request_id="req-logs-1", tenant="acme", model=MODEL, endpoint="/v1/completions",
                        status=200, prompt_tokens=len(PROMPT), completion_tokens=6, cached_tokens=0,
                        ttft_s=0.01, duration_s=0.05)
            return root

    try:
        root = run(go())
    finally:
        root_logger.removeHandler(handler)
        root_logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one JSON object
    mine = [x for x in lines if x.get("request_id") == "req-logs-1"]
    access = [x for x in mine if "rpc" in x]
    assert {x["rpc"]["server"] for x in access} == {"prefill", "decode", "cache"}
    assert {x["rpc"]["method"] for x in access} >= {"Prefill", "Decode", "Lookup", "BatchPut", "BatchGet"}
    assert all(x["rpc"]["status"] == "OK" for x in access)
    assert {x["trace_id"] for x in access} == {root.trace_id}
    (request_line,) = [x for x in mine if "request" in x]
    assert request_line["request"]["tenant"] == "acme" and request_line["request"]["completion_tokens"] == 6


# -- (d) graceful drain ---------------------------------------------------------------------------------------------


async def _health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return reply.status


def _local(request_id: str, max_tokens: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=request_id, sampling=greedy(max_tokens),
                                    local=decode_pb2.LocalPrefill(prompt=common_pb2.TokenIds(ids=PROMPT)))


async def _expect_not_serving_and_refusal(channel) -> None:
    """Health says NOT_SERVING and a new Decode is refused UNAVAILABLE with a reason."""
    deadline = time.monotonic() + 10
    while await _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health never reported NOT_SERVING"
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decode_pb2_grpc.DecodeServiceStub(channel).Decode(_local("late", 4), timeout=5).read()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()


def test_stopping_decode_finishes_running_streams_and_refuses_new_ones(tiny_k3):
    async def go():
        server, port = await serve_decode(DecodeServiceConfig(engine=engine_args(tiny_k3, kv_cache_memory=16 << 20),
                                                              address="127.0.0.1:0"))
        await server.ready()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(_local("running", 300), timeout=30)
            first = await call.read()
            stopping = asyncio.create_task(server.stop(30.0))  # what SIGTERM runs
            await _expect_not_serving_and_refusal(channel)
            rest = await read_rest(call)
            started = time.monotonic()
            await stopping
            return [first, *rest], time.monotonic() - started

    chunks, stop_wait = run(go())
    assert sum(len(c.token_ids) for c in chunks) == 300  # the full output
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stop_wait < 5, "stop returned soon after the last stream ended (it did not sit out the grace period)"


def test_streams_still_running_after_the_grace_period_end_with_a_clean_error(tiny_k3):
    async def go():
        server, port = await serve_decode(DecodeServiceConfig(engine=engine_args(tiny_k3, kv_cache_memory=32 << 20),
                                                              address="127.0.0.1:0"))
        await server.ready()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(_local("long", 3000), timeout=60)
            received = len((await call.read()).token_ids)
            started = time.monotonic()
            stopping = asyncio.create_task(server.stop(0.3))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    received += len(chunk.token_ids)
            await stopping
            return received, ended.value, time.monotonic() - started

    received, error, took = run(go())
    assert 0 < received < 3000
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "grace period" in error.details()
    assert took < 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_to_a_decode_process_drains_its_stream(tiny_k3, tmp_path):
    port = _free_port()
    stderr_path = tmp_path / "decode.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "--log-format", "json", "serve", "--role",
                                 "decode", "--model", str(tiny_k3), "--address", f"127.0.0.1:{port}",
                                 "--kv-cache-memory", "16MiB", "--max-num-seqs", "4", "--torch-threads", "1",
                                 "--grace-s", "30"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
    try:
        line = proc.stdout.readline()  # printed once the model is loaded
        assert "listening" in line, f"decode did not start: {line!r}\n{stderr_path.read_text()[-3000:]}"

        async def go():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(_local("sigterm", 300), timeout=30)
                chunks = [await call.read()]
                proc.send_signal(signal.SIGTERM)
                await _expect_not_serving_and_refusal(channel)
                chunks += await read_rest(call)
                return chunks

        chunks = run(go(), timeout_s=40)
        assert sum(len(c.token_ids) for c in chunks) == 300
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    json_lines = [json.loads(x) for x in stderr_path.read_text().splitlines() if x.startswith("{")]
    assert json_lines and all(x["service"] == "kdamesh-decode" for x in json_lines)
    assert any(x["logger"] == "kdamesh.rpc" and x["rpc"]["method"] == "Decode" and x["request_id"] == "sigterm"
               for x in json_lines)
