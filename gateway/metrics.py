"""The gateway's Prometheus metrics (`GET /metrics`, text exposition format).

Contract:
- `GatewayMetrics(registry)` registers every series in the registry it is given (a fresh `CollectorRegistry` by
  default: no process globals, so several apps in one process — tests — never collide). `render()` returns the
  exposition text and its content type.
- Series (prefix `kdamesh_gateway_`):
  `requests_total{api, endpoint, status}` (counter; `api` "rest" | "grpc", `status` the HTTP status, or its twin for
  gRPC), `requests_running{api}` (gauge), `time_to_first_token_seconds{endpoint}`,
  `time_per_output_token_seconds{endpoint}`, `e2e_request_latency_seconds{endpoint}` (histograms),
  `prompt_tokens_total{tenant}`, `generation_tokens_total{tenant}`, `cached_tokens_total{tenant}` (counters),
  `rate_limited_total{tenant, limit}` (counter), `worker_healthy{pool, address}` (gauge, 1 or 0),
  `mesh_routes_total{route}` (counter: "remote" | "local" | "fallback").
- The latency histograms use the OpenTelemetry GenAI bucket boundaries of `telemetry.metrics`
  (`gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`, `gen_ai.server.request.duration`),
  the same as the workers' `kdamesh_<service>_*` histograms, so gateway and worker latencies compare bucket for bucket.
- Tenant labels are bounded by the configured tenants (the directory's names; "anonymous" in open mode).
- vLLM's request-level series (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:request_success_total{finished_reason}`, `vllm:time_to_first_token_seconds`,
  `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, label `model_name`: telemetry/vllm.py)
  are observed by `observe_run` once per run that reached the engine (a finished choice or an output token); a
  request refused or failed before any output is not among them, as vLLM's engine never saw it. The workers
  expose the engine-level `vllm:` series, so no request is counted twice across the mesh.
- The workers' own series (engine gauges, `vllm:` engine series, the `kdamesh_prefill_*` / `kdamesh_decode_*`
  series, whatever a worker exposes) follow the gateway's on the same `/metrics`, labelled `pool` and `worker`
  (gateway/worker_metrics.py): `await render_mesh(pools)` scrapes the workers over gRPC within a short deadline
  (a dead worker delays the page by at most that) and renders both; `kdamesh_gateway_worker_scrape_up{pool,
  address}` says whose series are current.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from telemetry.metrics import REQUEST_DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, render
from gateway.worker_metrics import Pools, ScrapeSettings, WorkerSeries
from telemetry.vllm import VllmRequestMetrics, finished_reason

__all__ = ["E2E_BUCKETS", "TPOT_BUCKETS", "TTFT_BUCKETS", "GatewayMetrics"]

E2E_BUCKETS = REQUEST_DURATION_BUCKETS  # gen_ai.server.request.duration


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "",
                 scrape: ScrapeSettings = ScrapeSettings()):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.workers = WorkerSeries(scrape)
        r.register(_ScrapeUp(self.workers))
        self.vllm = VllmRequestMetrics(r, model_name)
        p = "kdamesh_gateway_"
        self.requests = Counter(p + "requests_total", "Requests answered, by API, endpoint and status",
                                ["api", "endpoint", "status"], registry=r)
        self.running = Gauge(p + "requests_running", "Requests in flight", ["api"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to the first output token",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time per output token after the first",
                              ["endpoint"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request latency, arrival to last token",
                             ["endpoint"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens", ["tenant"], registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens", ["tenant"], registry=r)
        self.cached_tokens = Counter(p + "cached_tokens_total", "Prompt tokens served from the prefix cache",
                                     ["tenant"], registry=r)
        self.rate_limited = Counter(p + "rate_limited_total", "Requests refused by a tenant limit",
                                    ["tenant", "limit"], registry=r)
        self.worker_healthy = Gauge(p + "worker_healthy", "Whether a mesh worker passes its health check",
                                    ["pool", "address"], registry=r)
        self.routes = Counter(p + "mesh_routes_total", "Requests by prefill route", ["route"], registry=r)

    def count_request(self, api: str, endpoint: str, status: int) -> None:
        self.requests.labels(api, endpoint, str(status)).inc()

    def observe_tokens(self, tenant: str, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt)
        self.generation_tokens.labels(tenant).inc(generated)
        self.cached_tokens.labels(tenant).inc(cached)

    def observe_timing(self, endpoint: str, start: float, first: float | None, last: float | None,
                       num_tokens: int) -> None:
        """Times from `time.monotonic()`: arrival, first token, last token."""
        if first is not None:
            self.ttft.labels(endpoint).observe(max(0.0, first - start))
            if last is not None and num_tokens > 1:
                self.tpot.labels(endpoint).observe(max(0.0, last - first) / (num_tokens - 1))
        if last is not None:
            self.e2e.labels(endpoint).observe(max(0.0, last - start))

    def observe_run(self, finish_reasons: list[str], prompt_tokens: int, generation_tokens: int, start: float,
                    first: float | None, last: float | None, num_tokens: int, n: int = 1,
                    max_tokens: int | None = None) -> None:
        """vLLM's request-level series for one closed run (see the module docstring); a run with no finished
        choice but some output was cut short ("abort"); the reason is that of its first finished choice."""
        if not finish_reasons and first is None:
            return
        reason = finished_reason(finish_reasons[0]) if finish_reasons else "abort"
        self.vllm.observe(reason, prompt_tokens, generation_tokens, start, first, last, num_tokens, n, max_tokens)

    def render(self) -> tuple[bytes, str]:
        """The gateway's own series only (see `render_mesh`)."""
        return render(self.registry)

    async def render_mesh(self, pools: Pools) -> tuple[bytes, str]:
        """The gateway's series, then its workers' (scraped now, each within the scrape deadline)."""
        await self.workers.refresh(pools)
        own = {family.name for family in self.registry.collect()}
        body, content_type = render(self.registry)
        return body + self.workers.render(exclude=own), content_type


class _ScrapeUp:
    """`kdamesh_gateway_worker_scrape_up{pool, address}`: 1 when the latest scrape of the worker answered."""

    def __init__(self, workers: WorkerSeries):
        self._workers = workers

    def collect(self):
        family = GaugeMetricFamily("kdamesh_gateway_worker_scrape_up", "Whether the latest metrics scrape of a mesh "
                                   "worker answered (its series on this page are current)", labels=["pool", "address"])
        for address, up in sorted(self._workers.up.items()):
            family.add_metric([self._workers.pool_of(address), address], 1 if up else 0)
        yield family
