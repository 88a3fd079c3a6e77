"""Prometheus series of the kdamesh services, in a `CollectorRegistry` the caller owns (one per service, so several
services can share a process), and the side HTTP `/metrics` server of the gRPC services.

Every series is prefixed `kdamesh_<service>_` (service: `prefill`, `decode`, `cache`). Per service:
- RPC calls (`RpcMetrics`, counted by `telemetry.rpc`): `requests_total{method, status}` (final gRPC status name),
  `requests_in_flight{method}`, `rpc_seconds{method}` (handler latency; the cache service has its own).
- Serving latency (`ServingMetrics`), recorded for successful requests only, as the GenAI conventions say:
  `time_to_first_token_seconds` and `time_per_output_token_seconds` histograms with the OpenTelemetry GenAI bucket
  boundaries of `gen_ai.server.time_to_first_token` / `gen_ai.server.time_per_output_token`,
  `e2e_request_seconds` (those of `gen_ai.server.request.duration`), and `prompt_tokens_total`,
  `generation_tokens_total`, `cached_prompt_tokens_total`. Workers label them by `path` (prefill: "prefill"; decode:
  "handoff", "local", "recompute").
- Engine state, read at scrape time (`EngineCollector` over an `EngineGauges` snapshot): `running_requests`,
  `queue_depth` (waiting requests), `kv_block_usage_ratio`, `kv_blocks{state="total"|"free"|"cached"}`,
  `state_slot_usage_ratio`, `state_snapshots`, `state_snapshot_slots`, `prefix_lookup_tokens_total`,
  `prefix_hit_tokens_total`, `preemptions_total` (of which `fair_preemptions_total`: to give a waiting tenant its
  share), the per-tenant `tenant_running_requests{tenant}`, `tenant_waiting_requests{tenant}` and
  `tenant_weight{tenant}` (each tenant with work now, labelled by its configured name, or `#` + a hash of its cache
  salt: never a key or a salt), and
  `model_loaded` (0 until the engine is up; the rest are absent until then).
- The same snapshot feeds the engine-level `vllm:` series (telemetry/vllm.py, label `model_name`), among them the
  engine's request phase histograms (`EngineGauges.queue_time` / `prefill_time` / `decode_time`).
- Worker counters, read at scrape time (`CounterCollector` over `CounterSample`s): e.g. `transfer_bytes_total{op}`
  and `transfer_seconds_total{op}` (payload moved to or from the cache service, and the wall time of those calls),
  handoff and remote-prefix outcomes.
- The gateway keeps its series in gateway/metrics.py (per-tenant tokens among them) and can take `TTFT_BUCKETS`,
  `TPOT_BUCKETS`, `REQUEST_DURATION_BUCKETS`, `RequestTimer` or `ServingMetrics` from here.
- The cache service keeps its own series (cache_service/metrics.py: objects, bytes, evictions, corrupt reads,
  transfer bytes and seconds) and adds `RpcMetrics`.

`start_metrics_server(port, host, registry)` serves a registry on `http://host:port/metrics` from daemon threads
(telemetry/metrics_http.py: GET and a body-less HEAD; port 0: a free port); `render(registry)` is the body and content type for an existing
HTTP app.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from telemetry.metrics_http import MetricsServer
from telemetry.vllm import BucketCounts, VllmEngineCollector

# OpenTelemetry GenAI semantic conventions, "Generative AI model server metrics" (ExplicitBucketBoundaries, seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def prefix_of(service: str) -> str:
    return f"kdamesh_{service}"


# -- RPC calls ----------------------------------------------------------------------------------------------------


class RpcMetrics:
    """Per-call counts of a gRPC server (recorded by `telemetry.rpc.ServerCallInterceptor`)."""

    def __init__(self, registry: CollectorRegistry, service: str, with_latency: bool = True):
        p = prefix_of(service)
        self.requests = Counter(f"{p}_requests", "gRPC calls handled, by method and final status",
                                ["method", "status"], registry=registry)
        self.in_flight = Gauge(f"{p}_requests_in_flight", "gRPC calls being handled", ["method"], registry=registry)
        self.seconds = Histogram(f"{p}_rpc_seconds", "gRPC handler latency (seconds)", ["method"],
                                 buckets=RPC_BUCKETS, registry=registry) if with_latency else None


# -- serving latency -------------------------------------------------------------------------------------------------


class RequestTimer:
    """Times one request's output: `add_tokens(n)` as tokens are produced, `finish()` at the end.

    ttft_s: creation -> first token; tpot_s: (last token - first token) / (tokens - 1), None under two tokens;
    duration_s: creation -> finish (or now)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.started = clock()
        self.first: float | None = None
        self.last: float | None = None
        self.ended: float | None = None
        self.tokens = 0

    def add_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += n

    def finish(self) -> None:
        if self.ended is None:
            self.ended = self._clock()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.started

    @property
    def tpot_s(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    @property
    def duration_s(self) -> float:
        return (self.ended if self.ended is not None else self._clock()) - self.started


class ServingMetrics:
    """TTFT, TPOT, end-to-end latency and token counts of successful requests, labelled by `labels`."""

    def __init__(self, registry: CollectorRegistry, service: str, labels: tuple[str, ...], with_tpot: bool = True):
        p = prefix_of(service)
        self.labels = labels
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token of successful requests "
                              "(seconds; buckets of gen_ai.server.time_to_first_token)", list(labels),
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "Time per output token after the first of "
                              "successful requests (seconds; buckets of gen_ai.server.time_per_output_token)",
                              list(labels), buckets=TPOT_BUCKETS, registry=registry) if with_tpot else None
        self.e2e = Histogram(f"{p}_e2e_request_seconds", "End-to-end latency of successful requests (seconds; "
                             "buckets of gen_ai.server.request.duration)", list(labels),
                             buckets=REQUEST_DURATION_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of successful requests", list(labels),
                                     registry=registry)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Output tokens of successful requests",
                                         list(labels), registry=registry)
        self.cached_tokens = Counter(f"{p}_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                                     list(labels), registry=registry)

    def observe(self, timer: RequestTimer, label_values: tuple[str, ...], *, prompt_tokens: int = 0,
                completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        timer.finish()
        if timer.ttft_s is not None:
            self.ttft.labels(*label_values).observe(timer.ttft_s)
        if self.tpot is not None and timer.tpot_s is not None:
            self.tpot.labels(*label_values).observe(timer.tpot_s)
        self.e2e.labels(*label_values).observe(timer.duration_s)
        self.prompt_tokens.labels(*label_values).inc(prompt_tokens)
        self.generation_tokens.labels(*label_values).inc(completion_tokens)
        self.cached_tokens.labels(*label_values).inc(cached_tokens)


# -- engine state and worker counters, read at scrape time -------------------------------------------------------


@dataclass(frozen=True)
class EngineGauges:
    """A snapshot of an engine's scheduler and pools (read without locking: each number is one consistent read)."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_usage: float  # fraction of KV blocks owned by requests
    state_groups_total: int  # KDA running-state slot groups (one per running request)
    state_groups_free: int
    snapshots: int  # KDA prefix snapshots held
    snapshot_slots: int
    prefix_lookup_tokens: int  # prompt tokens of admitted requests (cumulative)
    prefix_hit_tokens: int  # of those, served from the prefix cache (cumulative)
    preemptions: int  # cumulative
    queue_time: BucketCounts | None = None  # the engine's cumulative request phase histograms (telemetry.vllm)
    prefill_time: BucketCounts | None = None
    decode_time: BucketCounts | None = None
    inference_time: BucketCounts | None = None
    iteration_tokens: BucketCounts | None = None  # tokens per engine step
    cache_config: tuple[tuple[str, str], ...] = ()  # vllm:cache_config_info's labels (empty: no series)
    spec_num_drafts: int = 0  # speculative decoding (cumulative; telemetry.vllm's vllm:spec_decode_* series)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # empty: the worker does not speculate (no series)
    fair_preemptions: int = 0  # cumulative: preemptions that gave a waiting tenant its fair share
    tenants: tuple[tuple[str, int, int, float], ...] = ()  # (tenant label, running, waiting, weight), with work


class EngineCollector(Collector):
    """The engine series of one worker (see the module docstring); `read()` returns None until the engine is up."""

    def __init__(self, service: str, read: Callable[[], EngineGauges | None]):
        self._p = prefix_of(service)
        self._read = read

    def collect(self) -> Iterator[Metric]:
        p = self._p
        g = self._read()
        yield GaugeMetricFamily(f"{p}_model_loaded", "1 once the model is loaded and the engine runs",
                                value=0 if g is None else 1)
        if g is None:
            return
        yield GaugeMetricFamily(f"{p}_running_requests", "Requests in the engine's running batch", value=g.running)
        yield GaugeMetricFamily(f"{p}_queue_depth", "Requests waiting for admission", value=g.waiting)
        yield GaugeMetricFamily(f"{p}_kv_block_usage_ratio", "Fraction of KV blocks owned by requests",
                                value=g.kv_usage)
        blocks = GaugeMetricFamily(f"{p}_kv_blocks", "KV blocks of the pool by state", labels=["state"])
        blocks.add_metric(["total"], g.kv_blocks_total)
        blocks.add_metric(["free"], g.kv_blocks_free)
        blocks.add_metric(["cached"], g.kv_blocks_cached)
        yield blocks
        used = g.state_groups_total - g.state_groups_free
        yield GaugeMetricFamily(f"{p}_state_slot_usage_ratio", "Fraction of KDA running-state slots in use",
                                value=used / g.state_groups_total if g.state_groups_total else 0.0)
        yield GaugeMetricFamily(f"{p}_state_snapshots", "KDA state snapshots held for prefix caching",
                                value=g.snapshots)
        yield GaugeMetricFamily(f"{p}_state_snapshot_slots", "KDA state snapshot slots", value=g.snapshot_slots)
        yield CounterMetricFamily(f"{p}_prefix_lookup_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=g.prefix_lookup_tokens)
        yield CounterMetricFamily(f"{p}_prefix_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=g.prefix_hit_tokens)
        yield CounterMetricFamily(f"{p}_preemptions", "Requests preempted (recomputed later), for memory or for a "
                                  "tenant's fair share", value=g.preemptions)
        yield CounterMetricFamily(f"{p}_fair_preemptions", "Requests preempted to give a waiting tenant its fair "
                                  "share", value=g.fair_preemptions)
        yield from tenant_families(p, g.tenants)


def tenant_families(p: str, tenants: Iterable[tuple[str, int, int, float]]) -> Iterator[Metric]:
    """`tenant_running_requests`, `tenant_waiting_requests` and `tenant_weight` of the tenants with work."""
    families = [GaugeMetricFamily(f"{p}_tenant_running_requests", "A tenant's requests in the running batch",
                                  labels=["tenant"]),
                GaugeMetricFamily(f"{p}_tenant_waiting_requests", "A tenant's requests waiting for admission",
                                  labels=["tenant"]),
                GaugeMetricFamily(f"{p}_tenant_weight", "A tenant's weight in the fair share of the running slots "
                                  "and KV pool", labels=["tenant"])]
    for tenant, *values in tenants:
        for family, value in zip(families, values):
            family.add_metric([tenant], value)
    yield from families


@dataclass(frozen=True)
class CounterSample:
    """One value of a cumulative counter: `name` without prefix or `_total` (e.g. "transfer_bytes")."""

    name: str
    documentation: str
    value: float
    labels: tuple[tuple[str, str], ...] = field(default=())


class CounterCollector(Collector):
    """Counters a worker keeps itself (plain numbers), exposed at scrape time; `read()` returns [] until ready."""

    def __init__(self, service: str, read: Callable[[], Iterable[CounterSample]]):
        self._p = prefix_of(service)
        self._read = read

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for s in self._read():
            family = families.get(s.name)
            if family is None:
                family = families[s.name] = CounterMetricFamily(f"{self._p}_{s.name}", s.documentation,
                                                                labels=[k for k, _ in s.labels])
            family.add_metric([v for _, v in s.labels], s.value)
        yield from families.values()


class WorkerMetrics:
    """Everything a prefill or decode worker exposes, in one registry: its `kdamesh_<service>_*` series and the
    engine-level `vllm:` series of `model_name` (telemetry.vllm)."""

    def __init__(self, registry: CollectorRegistry, service: str, with_tpot: bool, model_name: str = ""):
        self.registry = registry
        self.service = service
        self.model_name = model_name
        self.rpc = RpcMetrics(registry, service)
        self.serving = ServingMetrics(registry, service, ("path",), with_tpot=with_tpot)

    def watch_engine(self, read: Callable[[], EngineGauges | None]) -> None:
        self.registry.register(EngineCollector(self.service, read))
        self.registry.register(VllmEngineCollector(self.model_name, read))

    def watch_counters(self, read: Callable[[], Iterable[CounterSample]]) -> None:
        self.registry.register(CounterCollector(self.service, read))


# -- exposition -------------------------------------------------------------------------------------------------


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of the registry in the Prometheus text format."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> MetricsServer:
    """Serves `registry` on http://host:port/metrics (port 0: a free port; `.port` tells which)."""
    return MetricsServer(port, host, registry)


def metrics_host(grpc_address: str) -> str:
    """The host part of a gRPC listen address ('0.0.0.0:50054' -> '0.0.0.0'; '[::]:1' -> '::'; ':1' -> '0.0.0.0')."""
    host = grpc_address.rsplit(":", 1)[0].strip("[]")
    return host or "0.0.0.0"
