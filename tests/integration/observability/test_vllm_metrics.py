"""vLLM's series on a running mesh: the gateway's `/metrics` has the request-level `vllm:` series and each worker's
`/metrics` the engine-level ones, all labelled `model_name` (the gateway re-exposes the workers' under `pool` and
`worker` labels, never as series of its own), and they move with two disaggregated requests as vLLM's
would (token counters by the prompt and completion lengths, one success per request with its finish reason, one
histogram observation per request and phase — the queue and prefill on the prefill worker, the decode on the
decode worker, never both; a colocated request all three on the decode worker — and prefix cache queries and hits
with the repeated prompt)."""

from __future__ import annotations

import asyncio

from gateway.worker_metrics import ScrapeSettings
from telemetry.metrics import start_metrics_server
from telemetry.vllm import ENGINE_SERIES, HISTOGRAM_SERIES, REQUEST_SERIES
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh, greedy
from tests.integration.observability.harness import PROMPT, samples_of, scrape, value

MODEL = "tiny-k3"
MAX_TOKENS = 6
model_dir = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _names(series: tuple[str, ...]) -> list[str]:
    """The sample names of `series` (a histogram's `_count`, the rest as they are)."""
    return [f"{s}_count" if s in HISTOGRAM_SERIES else s for s in series]


async def _scrape_all(gw, ports: dict[str, int]) -> dict[str, dict]:
    out = {role: await scrape(port) for role, port in ports.items()}
    out["gateway"] = samples_of((await gw.http.get("/metrics")).text)
    return out


async def _two_requests(model_dir):
    async with Mesh(model_dir) as mesh, running_gateway(mesh, model_dir) as gw:
        servers = {"prefill": mesh.prefill_server, "decode": mesh.decode_server}
        http = {role: start_metrics_server(0, "127.0.0.1", s.metrics.registry) for role, s in servers.items()}
        try:
            ports = {role: h.port for role, h in http.items()}
            before = await _scrape_all(gw, ports)
            for _ in range(2):  # the second prefill hits the first one's blocks
                reply = await gw.http.post("/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["finish_reason"] == "length"
            await mesh.drain()
            await asyncio.sleep(ScrapeSettings.min_interval_s)  # the gateway asks a worker again only after this
            after = await _scrape_all(gw, ports)
            local = await mesh.run(PROMPT, greedy(MAX_TOKENS), route="local")  # colocated: all on the decode worker
            assert local.finish[0] == "length"
            after["local"] = await scrape(ports["decode"])
        finally:
            for h in http.values():
                h.close()
        return before, after, gw.config.model_name, mesh.prefill_server.config.model_name


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_vllm_series_on_gateway_and_workers_move_with_requests(model_dir):
    before, after, gateway_model, worker_model = run(_two_requests(model_dir))
    assert gateway_model == worker_model == MODEL
    m = {"model_name": MODEL}
    for name in _names(REQUEST_SERIES):  # request-level: on the gateway only
        labels = dict(m, finished_reason="length") if name == "vllm:request_success_total" else m
        assert (name, frozenset(labels.items())) in after["gateway"], name
        assert not any(key[0] == name for key in after["prefill"]) and \
            not any(key[0] == name for key in after["decode"]), f"{name} on a worker too"
    for role in ("prefill", "decode"):  # engine-level: on every worker; at the gateway only as that worker's
        for name in _names(ENGINE_SERIES):
            mine = [key for key in after[role] if key[0] == name]
            assert mine if name == "vllm:cache_config_info" else (name, frozenset(m.items())) in after[role], \
                (role, name)
            relayed = [key for key in after["gateway"] if key[0] == name]
            assert {dict(key[1]).get("pool") for key in relayed} == {"prefill", "decode"}, f"{name} at the gateway"
        relayed = {key[1] - {("pool", role)} - {k for k in key[1] if k[0] == "worker"}: v
                   for key, v in after["gateway"].items()
                   if key[0] == "vllm:prefix_cache_queries_total" and ("pool", role) in key[1]}
        assert relayed == {frozenset(m.items()): after[role][("vllm:prefix_cache_queries_total",
                                                               frozenset(m.items()))]}, role  # the worker's value
    _gateway_moved(before["gateway"], after["gateway"], m)
    _engines_moved(before["prefill"], after["prefill"], before["decode"], after["decode"], m)
    for phase in ("queue", "prefill", "decode"):  # a colocated request: every phase on the decode worker
        assert _delta(after["decode"], after["local"], f"vllm:request_{phase}_time_seconds_count", **m) == 1, phase
    assert _delta(after["decode"], after["local"], "vllm:prefix_cache_queries_total", **m) == len(PROMPT)


def _gateway_moved(g0: dict, g1: dict, m: dict) -> None:
    assert _delta(g0, g1, "vllm:prompt_tokens_total", **m) == 2 * len(PROMPT)
    assert _delta(g0, g1, "vllm:generation_tokens_total", **m) == 2 * MAX_TOKENS
    assert _delta(g0, g1, "vllm:request_success_total", finished_reason="length", **m) == 2
    assert _delta(g0, g1, "vllm:request_success_total", finished_reason="stop", **m) == 0
    assert _delta(g0, g1, "vllm:time_to_first_token_seconds_count", **m) == 2
    assert _delta(g0, g1, "vllm:e2e_request_latency_seconds_count", **m) == 2
    assert _delta(g0, g1, "vllm:inter_token_latency_seconds_count", **m) == 2 * (MAX_TOKENS - 1)
    assert _delta(g0, g1, "vllm:request_time_per_output_token_seconds_count", **m) == 2
    assert _delta(g0, g1, "vllm:request_prompt_tokens_sum", **m) == 2 * len(PROMPT)
    assert _delta(g0, g1, "vllm:request_generation_tokens_count", **m) == 2
    assert _delta(g0, g1, "vllm:e2e_request_latency_seconds_sum", **m) >= \
        _delta(g0, g1, "vllm:time_to_first_token_seconds_sum", **m) > 0
    assert _delta(g0, g1, "vllm:e2e_request_latency_seconds_bucket", le="+Inf", **m) == 2


def _engines_moved(p0: dict, p1: dict, d0: dict, d1: dict, m: dict) -> None:
    # the prefill worker ran both prompts: queue and prefill once each; their decode ran on the decode worker
    assert _delta(p0, p1, "vllm:request_queue_time_seconds_count", **m) == 2
    assert _delta(p0, p1, "vllm:request_prefill_time_seconds_count", **m) == 2
    assert _delta(p0, p1, "vllm:request_decode_time_seconds_count", **m) == 0
    assert _delta(d0, d1, "vllm:request_decode_time_seconds_count", **m) == 2
    assert _delta(d0, d1, "vllm:request_queue_time_seconds_count", **m) == 0
    assert _delta(d0, d1, "vllm:request_prefill_time_seconds_count", **m) == 0
    assert _delta(d0, d1, "vllm:request_decode_time_seconds_sum", **m) > 0
    # prefix cache in prompt tokens: every prompt token is queried, the repeat hits its full blocks
    assert _delta(p0, p1, "vllm:prefix_cache_queries_total", **m) == 2 * len(PROMPT)
    assert _delta(p0, p1, "vllm:prefix_cache_hits_total", **m) > 0
    assert value(p1, "vllm:prefix_cache_hits_total", **m) == value(p1, "kdamesh_prefill_prefix_hit_tokens_total")
    for role, samples in (("prefill", p1), ("decode", d1)):
        assert value(samples, "vllm:num_requests_running", **m) == 0, role
        assert value(samples, "vllm:num_requests_waiting", **m) == 0, role
        assert 0 <= value(samples, "vllm:kv_cache_usage_perc", **m) <= 1, role
        assert value(samples, "vllm:num_preemptions_total", **m) == 0, role
