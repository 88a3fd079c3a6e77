"""deploy/grafana/kdamesh.json is a Grafana dashboard built on the series kdamesh exports: valid JSON with its uid
and title, panels with PromQL targets, and every series an expression names is one the gateway or a worker
exposes (collected from the real metric classes, not a hand-kept list)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from engine.phase_times import PhaseTimes
from gateway.metrics import GatewayMetrics
from telemetry.metrics import EngineGauges, WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "kdamesh.json"
SERIES = re.compile(r"\b(?:vllm:|kdamesh_)[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def exported_series() -> set[str]:
    """Every sample name the gateway and the prefill and decode workers expose."""
    s = PhaseTimes().snapshot()
    gauges = EngineGauges(running=0, waiting=0, kv_blocks_total=1, kv_blocks_free=1, kv_blocks_cached=0, kv_usage=0.0,
                          state_groups_total=1, state_groups_free=1, snapshots=0, snapshot_slots=1,
                          prefix_lookup_tokens=0, prefix_hit_tokens=0, preemptions=0, queue_time=s.queue,
                          prefill_time=s.prefill, decode_time=s.decode, inference_time=s.inference,
                          iteration_tokens=s.iteration_tokens, cache_config=(("block_size", "16"),))
    names = _exported(GatewayMetrics(model_name="m").registry)
    for role in ("prefill", "decode"):
        worker = WorkerMetrics(CollectorRegistry(), role, with_tpot=role == "decode", model_name="m")
        worker.watch_engine(lambda: gauges)
        names |= _exported(worker.registry)
    return names


def _targets(dashboard: dict) -> list[dict]:
    return [t for panel in dashboard["panels"] for t in panel["targets"]]


def test_dashboard_parses_and_names_itself():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "kdamesh-serving"
    assert dashboard["title"] == "kdamesh serving (vLLM metrics)"
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dashboard["panels"]:
        assert panel["type"] and panel["title"] and panel["targets"], panel.get("title")
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables


def test_every_expression_names_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exported = exported_series()
    used = set()
    for target in _targets(dashboard):
        names = SERIES.findall(target["expr"])
        assert names, target["expr"]  # every target reads at least one of our series
        unknown = set(names) - exported
        assert not unknown, (target["expr"], unknown)
        used |= set(names)
    for variable in dashboard["templating"]["list"]:
        assert set(SERIES.findall(json.dumps(variable.get("query", "")))) <= exported, variable["name"]
    core = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_bucket",
            "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
            "vllm:iteration_tokens_total_bucket", "vllm:request_inference_time_seconds_bucket",
            "vllm:request_params_n_sum", "vllm:request_params_max_tokens_bucket",
            "vllm:request_max_num_generation_tokens_bucket", "vllm:cache_config_info",
            "kdamesh_gateway_worker_scrape_up"}
    assert core <= used, core - used


def test_the_check_catches_an_unknown_series():
    assert "vllm:num_requests_swapped" not in exported_series()
    assert "kdamesh_gateway_requests_total" in exported_series()
