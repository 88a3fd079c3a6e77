"""End to end observability: `kdamesh --log-format json --trace-exporter otlp up` as a subprocess on tiny-k3, with
an OTLP/gRPC trace receiver in this process (the services' real exporters: OTLP over gRPC, batched).

- One streamed chat request (with a W3C `traceparent` and an `X-Request-Id`) yields spans from all four services
  (`service.name` kdamesh-gateway, -prefill, -cache, -decode) under the caller's trace id, every parent link inside
  the trace, and the GenAI attributes on the gateway's root span `chat tiny-k3`.
- `/metrics` of every service (the `metrics {role: url}` line of `kdamesh up`) parses with prometheus_client's
  parser, has the series of the issue, and moves with the request.
- Logs: JSON lines; the gateway's access line and every worker's gRPC access lines carry the request id.
- SIGTERM to `kdamesh up` during a stream: the client still gets its full output (and `[DONE]`), never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.launched import MODEL, launch, stop

TRACE_ID, PARENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
REQUEST_ID = "e2e-observability-1"
SERVICES = ("kdamesh-gateway", "kdamesh-prefill", "kdamesh-cache", "kdamesh-decode")
PAYLOAD_METHODS = ("Commit", "Locate")  # the cache's shared-memory data plane (same host)
MESSAGES = [{"role": "user", "content": "Once upon a time, in a small village by the sea, there lived an old "
                                        "fisherman who told stories every night to the children of the village."}]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span with its service name."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []  # (service.name, opentelemetry.proto Span)

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, s) for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def has(samples: dict, name: str) -> bool:
    return any(key[0] == name for key in samples)


def chat_stream(base: str, max_tokens: int, headers: dict | None = None):
    """POSTs a streamed chat request -> (the response, an iterator of decoded SSE payloads)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    reply = urllib.request.urlopen(request, timeout=60)

    def events():
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield line[len("data: "):]
    return reply, events()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    receiver = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
               OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="100")
    try:
        launched = launch(tmp_path_factory.mktemp("e2e-observability"), "metrics ", env=env,
                          global_flags=["--log-format", "json", "--trace-exporter", "otlp"],
                          up_flags=["--grace-s", "30"])
    except BaseException:
        otlp.stop(0)
        raise
    yield {"proc": launched.proc, "base": f"http://127.0.0.1:{launched.port}", "metrics": json.loads(launched.line),
           "receiver": receiver, "log": launched.log}
    stop(launched.proc)
    otlp.stop(0)


@pytest.fixture(scope="module")
def traced(mesh):
    """One streamed chat request with a W3C `traceparent` and an `X-Request-Id`: its reply and payloads, the spans of
    its trace once all four services exported theirs, and every service's /metrics before and after."""
    assert set(mesh["metrics"]) == {"gateway", "cache", "prefill", "decode"}
    before = {role: scrape(url) for role, url in mesh["metrics"].items()}
    reply, events = chat_stream(mesh["base"], 8, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01",
                                                  "X-Request-Id": REQUEST_ID})
    payloads = list(events)
    receiver = mesh["receiver"]
    deadline = time.monotonic() + 30
    while True:
        got = receiver.of_trace(TRACE_ID)
        names = {s.name for _, s in got}
        if {svc for svc, _ in got} >= set(SERVICES) and {"chat tiny-k3", "decode", "handoff.claim"} <= names:
            break
        assert time.monotonic() < deadline, f"spans of the trace: {sorted((svc, s.name) for svc, s in got)}"
        time.sleep(0.2)
    time.sleep(1.0)  # late spans of the same trace (background handoff removal, snapshot publication)
    after = {role: scrape(url) for role, url in mesh["metrics"].items()}
    return {"reply": reply, "payloads": payloads, "spans": receiver.of_trace(TRACE_ID), "before": before,
            "after": after}


def test_the_request_streams_with_its_request_id(traced):
    payloads = traced["payloads"]
    assert traced["reply"].headers["X-Request-Id"] == REQUEST_ID
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 8


def test_all_four_services_trace_under_the_callers_trace_id(traced):
    got = traced["spans"]
    by_id = {s.span_id: (svc, s) for svc, s in got}
    roots = [s for svc, s in got if s.name == "chat tiny-k3"]
    assert len(roots) == 1 and by_id  # one root span
    root = roots[0]
    assert by_id[root.span_id][0] == "kdamesh-gateway"
    assert root.parent_span_id.hex() == PARENT_SPAN  # the REST caller's span
    orphans = [(svc, s.name) for svc, s in got if s is not root and s.parent_span_id not in by_id]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"

    def chain(span) -> list[str]:
        names = []
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id][1]
            names.append(span.name)
        return names

    servers = {s.name: (svc, s) for svc, s in got}
    assert servers["kdamesh.v1.PrefillService/Prefill"][0] == "kdamesh-prefill"
    assert servers["kdamesh.v1.DecodeService/Decode"][0] == "kdamesh-decode"
    assert chain(servers["kdamesh.v1.PrefillService/Prefill"][1]) == ["chat tiny-k3"]
    assert chain(servers["kdamesh.v1.DecodeService/Decode"][1]) == ["chat tiny-k3"]
    cache_spans = [s for svc, s in got if svc == "kdamesh-cache"]
    assert cache_spans and all(chain(s)[-1] == "chat tiny-k3" for s in cache_spans)
    names = {s.name for s in cache_spans}
    assert {"cache.put", "cache.get"} <= names
    # workers on the cache's host move payloads through its shared-memory arena (Commit / Locate), others over
    # BatchPut / BatchGet (e.g. without /dev/shm)
    assert {f"kdamesh.v1.CacheService/{m}" for m in PAYLOAD_METHODS} <= names or \
        {"kdamesh.v1.CacheService/BatchPut", "kdamesh.v1.CacheService/BatchGet"} <= names


def test_the_root_span_has_the_genai_attributes(traced):
    (root,) = [s for _, s in traced["spans"] if s.name == "chat tiny-k3"]
    usage = json.loads(traced["payloads"][-2])["usage"]
    a = _attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["kdamesh.request_id"] == REQUEST_ID and "error.type" not in a


def test_every_service_metrics_parse_and_move(traced):
    before, after = traced["before"], traced["after"]
    g0, g1 = before["gateway"], after["gateway"]
    assert value(g1, "kdamesh_gateway_requests_total", api="rest", endpoint="chat", status="200") - \
        value(g0, "kdamesh_gateway_requests_total", api="rest", endpoint="chat", status="200") == 1
    for name in ("kdamesh_gateway_time_to_first_token_seconds_count",
                 "kdamesh_gateway_time_per_output_token_seconds_count"):
        assert value(g1, name, endpoint="chat") - value(g0, name, endpoint="chat") == 1, name
    assert value(g1, "kdamesh_gateway_generation_tokens_total", tenant="anonymous") - \
        value(g0, "kdamesh_gateway_generation_tokens_total", tenant="anonymous") == 8
    assert value(g1, "kdamesh_gateway_prompt_tokens_total", tenant="anonymous") > 0
    assert has(g1, "kdamesh_gateway_requests_running")

    p0, p1 = before["prefill"], after["prefill"]
    assert value(p1, "kdamesh_prefill_requests_total", method="Prefill", status="OK") - \
        value(p0, "kdamesh_prefill_requests_total", method="Prefill", status="OK") == 1
    assert value(p1, "kdamesh_prefill_time_to_first_token_seconds_count", path="prefill") == 1
    assert value(p1, "kdamesh_prefill_prefix_lookup_tokens_total") > \
        value(p0, "kdamesh_prefill_prefix_lookup_tokens_total")
    assert value(p1, "kdamesh_prefill_transfer_bytes_total", op="publish") > 0
    assert value(p1, "kdamesh_prefill_transfer_seconds_total", op="publish") > 0
    d0, d1 = before["decode"], after["decode"]
    assert value(d1, "kdamesh_decode_requests_total", method="Decode", status="OK") - \
        value(d0, "kdamesh_decode_requests_total", method="Decode", status="OK") == 1
    assert value(d1, "kdamesh_decode_time_to_first_token_seconds_count", path="handoff") == 1
    assert value(d1, "kdamesh_decode_time_per_output_token_seconds_count", path="handoff") == 1
    assert value(d1, "kdamesh_decode_transfer_bytes_total", op="handoff_load") > 0
    for role, samples in (("prefill", p1), ("decode", d1)):
        for series in ("queue_depth", "running_requests", "kv_block_usage_ratio", "state_slot_usage_ratio",
                       "prefix_hit_tokens_total", "prefix_lookup_tokens_total", "requests_in_flight"):
            assert has(samples, f"kdamesh_{role}_{series}"), (role, series)
    c0, c1 = before["cache"], after["cache"]
    assert any(value(c1, "kdamesh_cache_requests_total", method=m, status="OK") >
               value(c0, "kdamesh_cache_requests_total", method=m, status="OK") for m in ("BatchPut", "Commit"))
    assert value(c1, "kdamesh_cache_transfer_bytes_total", direction="put") > \
        value(c0, "kdamesh_cache_transfer_bytes_total", direction="put")
    assert value(c1, "kdamesh_cache_transfer_seconds_total", direction="put") > 0
    assert value(c1, "kdamesh_cache_stored_bytes") > 0
    for name in ("kdamesh_cache_objects", "kdamesh_cache_evictions_total", "kdamesh_cache_corrupt_reads_total"):
        assert has(c1, name), name


def test_json_log_lines_carry_the_request_id_in_every_service(traced, mesh):
    lines = [json.loads(x) for x in mesh["log"].read_text().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == REQUEST_ID]
    (access,) = [x for x in mine if x.get("logger") == "kdamesh.request"]
    assert access["service"] == "kdamesh-gateway" and access["trace_id"] == TRACE_ID
    r = access["request"]
    assert r["status"] == 200 and r["tenant"] == "anonymous" and r["completion_tokens"] == 8
    assert "ttft_s" in r and "cached_tokens" in r
    rpc = {x["service"] for x in mine if x.get("logger") == "kdamesh.rpc"}
    assert {"kdamesh-prefill", "kdamesh-decode"} <= rpc
    assert not [x for x in lines if "Failed to detach context" in x.get("message", "")]


def test_sigterm_during_a_stream_drains_it_to_its_full_output(mesh):
    """SIGTERM to `kdamesh up` while a stream runs: the gateway stops taking connections and lets the stream end
    (uvicorn's graceful shutdown, `--grace-s 30` so a loaded CI box has time), decode drains it, and the client
    gets every token and `[DONE]`."""
    proc = mesh["proc"]
    assert proc.poll() is None
    reply, events = chat_stream(mesh["base"], 400)  # ~1-2 s of tokens on tiny-k3 (more under load)
    first = next(events)
    assert json.loads(first)["choices"]
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    payloads = [first, *events]
    assert time.monotonic() - started < 30, "the stream hung after SIGTERM"
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 400
    assert proc.wait(timeout=60) == 0
    assert "stopping the mesh" in mesh["log"].read_text()
