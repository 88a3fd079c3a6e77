"""gateway/worker_metrics.py over real gRPC servers: the workers' series merged by name under `pool` / `worker`
labels (valid exposition: one TYPE line per family), a hanging worker costs the page at most the scrape deadline, a
dead one keeps its last answer until it is stale, a worker that left its pool is forgotten; the gateway's
`render_mesh` puts its own series and the workers' on one page with `kdamesh_gateway_worker_scrape_up`."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.worker_metrics import ScrapeSettings, WorkerSeries
from protos import metrics_pb2_grpc
from worker.info import MetricsServicer


class Hanging(metrics_pb2_grpc.MetricsServiceServicer):
    async def Scrape(self, request, context):
        await asyncio.sleep(30)


def _registry(running: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry).labels("m").set(running)
    Counter("kdamesh_decode_tenant_tokens", "per tenant", ["tenant"], registry=registry).labels("a").inc(3)
    return registry


async def _server(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    metrics_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _samples(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families)  # merged: one family per name
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def test_merges_workers_and_bounds_a_hanging_one():
    async def go():
        one, a = await _server(MetricsServicer(_registry(2)))
        two, b = await _server(MetricsServicer(_registry(5)))
        hang, c = await _server(Hanging())
        channels = {address: grpc.aio.insecure_channel(address) for address in (a, b, c)}
        try:
            series = WorkerSeries(ScrapeSettings(scrape_timeout_s=0.5))
            t0 = time.monotonic()
            await series.refresh({"decode": {a: channels[a], c: channels[c]}, "prefill": {b: channels[b]}})
            return series.render(), series.up, time.monotonic() - t0, (a, b, c)
        finally:
            for channel in channels.values():
                await channel.close()
            for server in (one, two, hang):
                await server.stop(0)

    text, up, seconds, (a, b, c) = asyncio.run(go())
    samples = _samples(text.decode())
    assert samples[("vllm:num_requests_running", frozenset({("model_name", "m"), ("pool", "decode"),
                                                             ("worker", a)}))] == 2
    assert samples[("vllm:num_requests_running", frozenset({("model_name", "m"), ("pool", "prefill"),
                                                             ("worker", b)}))] == 5
    assert samples[("kdamesh_decode_tenant_tokens_total", frozenset({("tenant", "a"), ("pool", "decode"),
                                                                      ("worker", a)}))] == 3  # a series not named here
    assert up == {a: True, b: True, c: False}
    assert seconds < 10  # the hanging worker cost the deadline (0.5 s), not its 30 s


def test_a_dead_worker_keeps_its_last_answer_until_stale_and_a_departed_one_is_forgotten():
    async def go():
        server, a = await _server(MetricsServicer(_registry(1)))
        channel = grpc.aio.insecure_channel(a)
        dead_channel = grpc.aio.insecure_channel(_closed_address())
        try:
            series = WorkerSeries(ScrapeSettings(scrape_timeout_s=0.5, min_interval_s=0.0, stale_after_s=60))
            await series.refresh({"decode": {a: channel}})
            await server.stop(0)
            await series.refresh({"decode": {a: channel}})
            kept = series.render()
            series.settings = ScrapeSettings(scrape_timeout_s=0.5, min_interval_s=0.0, stale_after_s=0.0)
            await series.refresh({"decode": {a: channel}})
            stale = series.render()
            await series.refresh({"decode": {"10.0.0.1:1": dead_channel}})
            return kept, stale, series.up
        finally:
            await channel.close()
            await dead_channel.close()

    kept, stale, up = asyncio.run(go())
    assert b"vllm:num_requests_running" in kept
    assert b"vllm:num_requests_running" not in stale
    assert list(up) == ["10.0.0.1:1"] and up["10.0.0.1:1"] is False


def test_gateway_page_has_its_own_and_the_workers_series():
    async def go():
        server, a = await _server(MetricsServicer(_registry(4)))
        channel = grpc.aio.insecure_channel(a)
        try:
            metrics = GatewayMetrics(model_name="m")
            return (await metrics.render_mesh({"decode": {a: channel}, "prefill": {}}))[0], a
        finally:
            await channel.close()
            await server.stop(0)

    body, a = asyncio.run(go())
    samples = _samples(body.decode())
    assert samples[("vllm:num_requests_running", frozenset({("model_name", "m"), ("pool", "decode"),
                                                             ("worker", a)}))] == 4
    assert samples[("kdamesh_gateway_worker_scrape_up", frozenset({("pool", "decode"), ("address", a)}))] == 1
    assert ("vllm:prompt_tokens_total", frozenset({("model_name", "m")})) in samples  # the gateway's own


def test_the_route_relays_unless_told_not_to(tmp_path):
    """GET /metrics of the app: the worker's series with the default config, none with
    `--no-relay-worker-metrics` (relay_worker_metrics=False)."""
    import json
    from types import SimpleNamespace

    import httpx

    from gateway.app import create_app
    from gateway.config import GatewayConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))

    async def page(relay: bool) -> str:
        server, a = await _server(MetricsServicer(_registry(3)))
        channel = grpc.aio.insecure_channel(a)
        try:
            mesh = SimpleNamespace(decoders={a: SimpleNamespace(channel=channel)}, prefillers={})
            config = GatewayConfig(model=str(tmp_path), decode_addresses=(a,), mode="colocated",
                                   relay_worker_metrics=relay)
            app = create_app(config, mesh=mesh)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
                reply = await http.get("/metrics")
                assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
                return reply.text
        finally:
            await channel.close()
            await server.stop(0)

    assert "vllm:num_requests_running{" in asyncio.run(page(True))
    assert "vllm:num_requests_running" not in asyncio.run(page(False))
