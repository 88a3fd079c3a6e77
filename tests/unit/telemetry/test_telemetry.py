"""telemetry/: the package's import bounds, the GenAI buckets, request timing, collectors, log formats, the request id,
`setup_tracing`'s exporter choice, the gateway's root span, and the gRPC interceptors on a small in-process server
(trace context, request id, status counts, access log) — with explicit providers and registries, never the globals."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry import tracing
from telemetry.context import (current_request_id, request_id_from_headers, request_id_from_metadata,
                               request_id_scope)
from telemetry.logs import JsonFormatter, RequestContextFilter, TextFormatter, log_request
from telemetry.metrics import (REQUEST_DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, CounterCollector,
                               CounterSample, EngineCollector, EngineGauges, RequestTimer, RpcMetrics, ServingMetrics,
                               render, start_metrics_server)
from telemetry.rpc import client_interceptors, server_interceptors

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = ({"telemetry", "opentelemetry", "prometheus_client", "grpc", "grpc_health", "grpc_reflection"}
           | set(sys.stdlib_module_names))


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def memory_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# -- package bounds -------------------------------------------------------------------------------------------------


def test_telemetry_imports_only_opentelemetry_prometheus_grpc_and_the_stdlib():
    for path in sorted((ROOT / "telemetry").glob("*.py")):
        roots = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots.add(node.module.split(".")[0])
        assert not roots - ALLOWED, f"{path.name} imports {sorted(roots - ALLOWED)}"


def test_importing_telemetry_pulls_no_service_or_engine():
    code = ("import sys, telemetry.rpc, telemetry.logs, telemetry.metrics, telemetry.tracing; "
            "bad = {'torch', 'engine', 'cache_service', 'prefill_service', 'decode_service', 'gateway'} "
            "& set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# -- metrics --------------------------------------------------------------------------------------------------------


def test_buckets_are_the_genai_semantic_convention_boundaries():
    assert TTFT_BUCKETS == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0)
    assert TPOT_BUCKETS == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def test_request_timer_measures_ttft_and_time_per_output_token():
    now = [10.0]
    timer = RequestTimer(clock=lambda: now[0])
    now[0] = 10.25
    timer.add_tokens(1)  # the first token
    now[0] = 10.35
    timer.add_tokens(2)  # a chunk of two
    now[0] = 10.45
    timer.add_tokens(1)
    timer.add_tokens(0)  # an empty chunk changes nothing
    now[0] = 10.5
    timer.finish()
    now[0] = 99.0
    assert timer.ttft_s == pytest.approx(0.25)
    assert timer.tpot_s == pytest.approx((10.45 - 10.25) / 3)
    assert timer.duration_s == pytest.approx(0.5)
    single = RequestTimer(clock=lambda: 1.0)
    single.add_tokens(1)
    assert single.tpot_s is None


def test_serving_metrics_use_the_genai_buckets_and_count_successes():
    registry = CollectorRegistry()
    serving = ServingMetrics(registry, "decode", ("path",))
    now = [0.0]
    timer = RequestTimer(clock=lambda: now[0])
    now[0] = 0.03
    timer.add_tokens(1)
    now[0] = 0.13
    timer.add_tokens(5)
    serving.observe(timer, ("handoff",), prompt_tokens=100, completion_tokens=6, cached_tokens=64)
    got = samples(registry)
    labels = frozenset({("path", "handoff")})
    assert got[("kdamesh_decode_prompt_tokens_total", labels)] == 100
    assert got[("kdamesh_decode_generation_tokens_total", labels)] == 6
    assert got[("kdamesh_decode_cached_prompt_tokens_total", labels)] == 64
    ttft = {dict(k[1])["le"]: v for k, v in got.items() if k[0] == "kdamesh_decode_time_to_first_token_seconds_bucket"}
    assert [float(le) for le in ttft if le != "+Inf"] == list(TTFT_BUCKETS)
    assert ttft["0.02"] == 0 and ttft["0.04"] == 1  # 30 ms
    tpot = {dict(k[1])["le"]: v for k, v in got.items()
            if k[0] == "kdamesh_decode_time_per_output_token_seconds_bucket"}
    assert [float(le) for le in tpot if le != "+Inf"] == list(TPOT_BUCKETS)
    assert tpot["0.01"] == 0 and tpot["0.025"] == 1  # (0.13 - 0.03) / 5 = 20 ms
    e2e = {dict(k[1])["le"] for k in got if k[0] == "kdamesh_decode_e2e_request_seconds_bucket"}
    assert sorted(float(le) for le in e2e if le != "+Inf") == list(REQUEST_DURATION_BUCKETS)


def test_engine_and_counter_collectors_read_at_scrape_time():
    registry = CollectorRegistry()
    state = {"gauges": None, "bytes": 0}
    registry.register(EngineCollector("decode", lambda: state["gauges"]))
    registry.register(CounterCollector("decode", lambda: [
        CounterSample("transfer_bytes", "bytes", state["bytes"], (("op", "handoff_load"),))]))
    before = samples(registry)
    assert before[("kdamesh_decode_model_loaded", frozenset())] == 0
    assert not any(name == "kdamesh_decode_queue_depth" for name, _ in before)
    state["gauges"] = EngineGauges(running=3, waiting=2, kv_blocks_total=100, kv_blocks_free=60, kv_blocks_cached=10,
                                   kv_usage=0.4, state_groups_total=8, state_groups_free=5, snapshots=4,
                                   snapshot_slots=16, prefix_lookup_tokens=500, prefix_hit_tokens=320, preemptions=1,
                                   fair_preemptions=1, tenants=(("acme", 2, 0, 2.5), ("#0123456789abcdef", 1, 2, 1.0)))
    state["bytes"] = 4096
    after = samples(registry)
    assert after[("kdamesh_decode_model_loaded", frozenset())] == 1
    assert after[("kdamesh_decode_running_requests", frozenset())] == 3
    assert after[("kdamesh_decode_queue_depth", frozenset())] == 2
    assert after[("kdamesh_decode_kv_block_usage_ratio", frozenset())] == pytest.approx(0.4)
    assert after[("kdamesh_decode_kv_blocks", frozenset({("state", "free")}))] == 60
    assert after[("kdamesh_decode_state_slot_usage_ratio", frozenset())] == pytest.approx(3 / 8)
    assert after[("kdamesh_decode_prefix_hit_tokens_total", frozenset())] == 320
    assert after[("kdamesh_decode_transfer_bytes_total", frozenset({("op", "handoff_load")}))] == 4096
    assert after[("kdamesh_decode_fair_preemptions_total", frozenset())] == 1
    assert after[("kdamesh_decode_tenant_running_requests", frozenset({("tenant", "acme")}))] == 2
    assert after[("kdamesh_decode_tenant_waiting_requests", frozenset({("tenant", "#0123456789abcdef")}))] == 2
    assert after[("kdamesh_decode_tenant_weight", frozenset({("tenant", "acme")}))] == 2.5
    state["gauges"] = replace(state["gauges"], tenants=(("acme", 1, 0, 2.5),))  # a tenant without work has no series
    assert not any(dict(labels).get("tenant") == "#0123456789abcdef" for _, labels in samples(registry))


def test_metrics_server_serves_the_registry():
    import urllib.request

    registry = CollectorRegistry()
    RpcMetrics(registry, "prefill").requests.labels("Prefill", "OK").inc()
    server = start_metrics_server(0, "127.0.0.1", registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.close()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "kdamesh_prefill_requests_total" in names
    body, content_type = render(registry)
    assert content_type.startswith("text/plain") and b"kdamesh_prefill_requests_total" in body


# -- request id and logs ------------------------------------------------------------------------------------------


def test_request_id_from_headers_and_metadata():
    assert request_id_from_headers({"X-Request-Id": "abc-123"}) == "abc-123"
    assert request_id_from_headers({"x-request-id": "abc-123"}) == "abc-123"
    generated = request_id_from_headers({"x-request-id": "has spaces"})
    assert generated != "has spaces" and len(generated) == 32
    assert request_id_from_headers({"x-request-id": "x" * 129}) != "x" * 129
    assert request_id_from_metadata((("user-agent", "grpc"), ("x-request-id", "r1"))) == "r1"
    assert request_id_from_metadata(()) is None
    with request_id_scope("outer"):
        with request_id_scope("inner"):
            assert current_request_id() == "inner"
        assert current_request_id() == "outer"
    assert current_request_id() is None


def _capture(fmt: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(fmt)
    handler.addFilter(RequestContextFilter("kdamesh-test"))
    logger = logging.getLogger(f"telemetry-test-{id(stream)}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, stream


def test_json_lines_carry_request_id_trace_id_and_structured_fields():
    provider, _ = memory_provider()
    logger, stream = _capture(JsonFormatter())
    with request_id_scope("req-42"), provider.get_tracer("t").start_as_current_span("work") as span:
        logger.info("hello %s", "world", extra={"rpc": {"method": "Decode", "status": "OK"}})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    logger.warning("outside")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    first, second, third = lines
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert first["message"] == "hello world" and first["level"] == "INFO" and first["service"] == "kdamesh-test"
    assert first["request_id"] == "req-42" and first["trace_id"] == trace_id and len(first["span_id"]) == 16
    assert first["rpc"] == {"method": "Decode", "status": "OK"}
    assert "ValueError: boom" in second["exception"]
    assert "request_id" not in third and "trace_id" not in third


def test_text_lines_show_the_request_id_or_a_dash():
    logger, stream = _capture(TextFormatter())
    with request_id_scope("req-7"):
        logger.info("inside")
    logger.info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert "[req-7]: inside" in inside and "[-]: outside" in outside


def test_log_request_is_one_structured_line():
    logger, stream = _capture(JsonFormatter())
    log_request(request_id="req-9", tenant="acme", model="tiny-k3", endpoint="/v1/completions", status=200,
                prompt_tokens=12, completion_tokens=8, cached_tokens=0, ttft_s=0.0123, duration_s=0.2,
                route="remote", finish_reasons=["length"], logger=logger)
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert line["request_id"] == "req-9"
    assert line["request"] == {"request_id": "req-9", "tenant": "acme", "model": "tiny-k3",
                               "endpoint": "/v1/completions", "status": 200, "prompt_tokens": 12,
                               "completion_tokens": 8, "cached_tokens": 0, "ttft_s": 0.0123, "duration_s": 0.2,
                               "route": "remote", "finish_reasons": ["length"]}


# -- tracing --------------------------------------------------------------------------------------------------------


def test_exporter_choice_follows_flag_then_environment(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.resolve_exporter("auto") == "none"
    assert isinstance(tracing.setup_tracing("svc", "auto", set_global=False), trace.NoOpTracerProvider)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.resolve_exporter("auto") == "otlp"
    assert tracing.resolve_exporter("console") == "console"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.resolve_exporter("auto") == "none"
    with pytest.raises(ValueError):
        tracing.resolve_exporter("jaeger")


def test_setup_tracing_names_the_service_and_takes_a_test_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kdamesh-decode-7")
    exporter = InMemorySpanExporter()
    provider = tracing.setup_tracing("kdamesh-decode", "none", span_exporter=exporter, set_global=False)
    with provider.get_tracer("t").start_as_current_span("x"):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "kdamesh-decode-7"
    otlp = tracing.setup_tracing("kdamesh-decode", "otlp", set_global=False)  # exports lazily: nothing to reach
    otlp.shutdown()


def test_root_span_continues_a_rest_traceparent_with_genai_attributes():
    provider, exporter = memory_provider()
    tracer = provider.get_tracer("kdamesh.gateway")
    parent_trace, parent_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"Traceparent": f"00-{parent_trace}-{parent_span}-01", "content-type": "application/json"}
    root = tracing.start_request_span(tracer, "chat", "tiny-k3", headers, max_tokens=64, temperature=0.7,
                                      top_p=None, request_id="req-1", tenant="acme", stream=True)
    assert root.trace_id == parent_trace
    with root.activate():
        with tracing.child_span(tracer, "inner"):
            pass
    root.finish(input_tokens=12, output_tokens=30, cached_tokens=0, finish_reasons=["stop"], response_id="chatcmpl-1")
    root.finish(input_tokens=99)  # ignored: already ended
    inner, span = exporter.get_finished_spans()
    assert span.name == "chat tiny-k3" and span.kind == SpanKind.SERVER
    assert format(span.parent.span_id, "016x") == parent_span and span.parent.is_remote
    assert inner.parent.span_id == span.context.span_id
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny-k3"
    assert a["gen_ai.request.max_tokens"] == 64 and a["gen_ai.request.temperature"] == 0.7
    assert "gen_ai.request.top_p" not in a
    assert a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 30
    assert a["gen_ai.response.finish_reasons"] == ("stop",) and a["kdamesh.request_id"] == "req-1"


def test_root_span_without_traceparent_starts_a_trace_and_records_errors():
    provider, exporter = memory_provider()
    root = tracing.start_request_span(provider.get_tracer("g"), "text_completion", "m", {}, max_tokens=5)
    root.finish(error_type="503", error_message="mesh unavailable")
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.name == "text_completion m"
    assert span.attributes["error.type"] == "503" and span.status.status_code == StatusCode.ERROR


def test_child_span_records_error_type_and_keeps_a_precise_one():
    provider, exporter = memory_provider()
    tracer = provider.get_tracer("t")
    with pytest.raises(KeyError):
        with tracing.child_span(tracer, "plain"):
            raise KeyError("k")
    with pytest.raises(RuntimeError):
        with tracing.child_span(tracer, "precise") as span:
            tracing.mark_error(span, "missing")
            raise RuntimeError("x")
    plain, precise = exporter.get_finished_spans()
    assert plain.attributes["error.type"] == "KeyError" and plain.status.status_code == StatusCode.ERROR
    assert precise.attributes["error.type"] == "missing"


# -- gRPC interceptors ----------------------------------------------------------------------------------------------


def _echo_handlers(seen: list):
    async def say(request: bytes, context) -> bytes:
        seen.append((current_request_id(), trace.get_current_span().get_span_context().trace_id))
        if request == b"missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        return b"echo:" + request

    async def count(request: bytes, context):
        seen.append((current_request_id(), trace.get_current_span().get_span_context().trace_id))
        for i in range(int(request)):
            yield str(i).encode()

    return grpc.method_handlers_generic_handler("test.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Count": grpc.unary_stream_rpc_method_handler(count)})


def test_interceptors_carry_trace_context_and_request_id_and_count_calls():
    provider, exporter = memory_provider()
    registry = CollectorRegistry()
    rpc_metrics = RpcMetrics(registry, "echo")
    logger, stream = _capture(JsonFormatter())
    access = logging.getLogger("kdamesh.rpc")
    access.addHandler(logger.handlers[0])
    old_level = access.level
    access.setLevel(logging.INFO)
    seen: list = []

    async def go():
        server = grpc.aio.server(interceptors=server_interceptors("echo", tracer_provider=provider,
                                                                  metrics=rpc_metrics))
        server.add_generic_rpc_handlers((_echo_handlers(seen),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 interceptors=client_interceptors(provider)) as channel:
                say = channel.unary_unary("/test.Echo/Say")
                count = channel.unary_stream("/test.Echo/Count")
                with request_id_scope("req-abc"), provider.get_tracer("gw").start_as_current_span("root") as root:
                    assert await say(b"hi", timeout=5) == b"echo:hi"
                    assert [m async for m in count(b"3", timeout=5)] == [b"0", b"1", b"2"]
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await say(b"missing", timeout=5)
                    assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert await say(b"plain", timeout=5) == b"echo:plain"  # no request id bound: none sent
        finally:
            await server.stop(0)
        return root

    try:
        root = asyncio.run(go())
    finally:
        access.removeHandler(logger.handlers[0])
        access.setLevel(old_level)
    trace_id = root.get_span_context().trace_id
    assert seen[:3] == [("req-abc", trace_id)] * 3
    assert seen[3][0] is None and seen[3][1] != trace_id

    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == SpanKind.SERVER and s.context.trace_id == trace_id]
    assert [s.name for s in servers] == ["test.Echo/Say", "test.Echo/Count", "test.Echo/Say"]
    for s in servers:  # each call's server span is a child of the caller's current span
        assert s.parent.span_id == root.get_span_context().span_id and s.parent.is_remote
        assert s.attributes["rpc.system"] == "grpc" and s.attributes["rpc.service"] == "test.Echo"
    assert [s.attributes["rpc.grpc.status_code"] for s in servers] == [0, 0, 5]
    assert "error.type" not in servers[2].attributes  # NOT_FOUND is the client's error, not the server's

    got = samples(registry)
    assert got[("kdamesh_echo_requests_total", frozenset({("method", "Say"), ("status", "OK")}))] == 2
    assert got[("kdamesh_echo_requests_total", frozenset({("method", "Say"), ("status", "NOT_FOUND")}))] == 1
    assert got[("kdamesh_echo_requests_total", frozenset({("method", "Count"), ("status", "OK")}))] == 1
    assert got[("kdamesh_echo_requests_in_flight", frozenset({("method", "Say")}))] == 0
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["rpc"]["method"], x["rpc"]["status"], x.get("request_id")) for x in lines] == [
        ("Say", "OK", "req-abc"), ("Count", "OK", "req-abc"), ("Say", "NOT_FOUND", "req-abc"), ("Say", "OK", None)]
    assert all(x["rpc"]["server"] == "echo" and x["rpc"]["service"] == "test.Echo" for x in lines)
