"""End to end, `kdamesh up` on tiny-k3: a stock vLLM dashboard pointed at the API URL alone reads every panel, and
every metrics port passes aiohttp's HEAD (aiperf's reachability check).

- After a few requests through the official `openai` client (one repeating a prompt, so the prefix cache hits, and
  one with n=2), the gateway's `/metrics` has, for `model_name="tiny-k3"`, every series that vLLM's published
  Grafana dashboard queries (examples/observability/prometheus_grafana/grafana.json in vLLM's repository: the names
  only) and the series issue 28 lists, with samples that moved (counts > 0) where traffic moves them; the engine
  series come from the workers through the gateway, labelled by `pool` and `worker`.
- HEAD /metrics on the gateway, the cache service and both workers: 200, no body, on a connection aiohttp then reuses.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.launched import MODEL, launch, stop

# The series behind each query of vLLM's dashboard (histograms by their _bucket/_sum/_count), then those the issue
# names; `moves`: their value after the requests is > 0 (a gauge at rest may be 0).
DASHBOARD_SERIES = ("vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
                    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
                    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
                    "vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
                    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
                    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
                    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                    "vllm:request_max_num_generation_tokens_sum")
ISSUE_SERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:iteration_tokens_total_sum",
                "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum",
                "vllm:request_inference_time_seconds_sum", "vllm:cache_config_info")
AT_REST = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
UNLABELLED = {"vllm:cache_config_info"}  # as vLLM's: the cache's configuration as labels, no model_name
PROMPT = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm at sea."}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("e2e-gateway-metrics"), "metrics ")
    yield {"base": f"http://127.0.0.1:{launched.port}", "metrics": json.loads(launched.line)}
    stop(launched.proc)


def _traffic(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    for _ in range(2):  # the second one hits the first one's prefix
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
    client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, n=2, temperature=0.7, seed=1)


def _gateway_samples(base: str) -> dict[str, list]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def test_a_vllm_dashboard_reads_every_panel_from_the_gateway_alone(mesh):
    _traffic(mesh["base"])
    samples = _gateway_samples(mesh["base"])
    for name in (*DASHBOARD_SERIES, *ISSUE_SERIES):
        ours = [s for s in samples.get(name, []) if name in UNLABELLED or s.labels.get("model_name") == MODEL]
        assert ours, f"{name} is missing at the gateway's /metrics"
        if name not in AT_REST:
            assert sum(s.value for s in ours) > 0, f"{name} did not move"
    engine = [s for s in samples["vllm:num_requests_running"] if s.labels.get("model_name") == MODEL]
    assert {s.labels["pool"] for s in engine} == {"prefill", "decode"}  # from both workers, through the gateway
    assert {s.labels["enable_prefix_caching"] for s in samples["vllm:cache_config_info"]} == {"True"}
    up = samples["kdamesh_gateway_worker_scrape_up"]
    assert len(up) == 2 and all(s.value == 1 for s in up)


async def _head_then_get(url: str) -> tuple[int, int, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.head(url) as head:
            head_status, head_body = head.status, len(await head.read())
        async with session.get(url) as get:
            return head_status, head_body, get.status


def test_every_metrics_port_answers_head(mesh):
    assert set(mesh["metrics"]) == {"gateway", "cache", "prefill", "decode"}
    for role, url in mesh["metrics"].items():
        assert asyncio.run(_head_then_get(url)) == (200, 0, 200), role
