"""telemetry.vllm and engine.phase_times on their own: the engine's phase histograms count a request once per phase
(a handed-off one: queue and prefill; a resumed one: decode), the worker collector exposes vLLM's names, types and
cumulative buckets, and the gateway's request metrics count tokens, reasons and one histogram observation each."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.phase_times import PhaseTimes, RequestTimes
from gateway.metrics import GatewayMetrics
from telemetry.metrics import EngineGauges, WorkerMetrics
from telemetry.vllm import ENGINE_SERIES, REQUEST_LATENCY_BUCKETS, REQUEST_SERIES, finished_reason


def samples_of(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _times(queued=0.0, scheduled=1.0, first=3.0, last=10.0, **flags) -> RequestTimes:
    return RequestTimes(queued=queued, scheduled=scheduled, first_token=first, last_token=last, **flags)


def test_phase_times_count_each_phase_once():
    phases = PhaseTimes()
    phases.observe(_times())  # queue 1 s, prefill 2 s, decode 7 s
    phases.observe(_times(handed_off=True))  # the prefill engine's half: queue and prefill
    phases.observe(_times(scheduled=4.0, first=5.0, last=6.5, resumed=True))  # the decode half: decode 2.5 s
    phases.observe(_times(scheduled=None, first=None, last=None))  # aborted while waiting: nothing
    s = phases.snapshot()
    assert (sum(s.queue.counts), sum(s.prefill.counts), sum(s.decode.counts)) == (2, 2, 2)
    assert (s.queue.total, s.prefill.total, s.decode.total) == (2.0, 4.0, 9.5)
    assert s.queue.bounds == REQUEST_LATENCY_BUCKETS
    assert s.queue.counts[REQUEST_LATENCY_BUCKETS.index(1.0)] == 2  # le is inclusive
    assert s.decode.counts[REQUEST_LATENCY_BUCKETS.index(2.5)] == 1
    assert s.decode.counts[REQUEST_LATENCY_BUCKETS.index(10.0)] == 1
    assert sum(s.inference.counts) == 3 and s.inference.total == 9.0 + 9.0 + 2.5  # last token - scheduled, each


def test_iteration_tokens_count_each_step():
    phases = PhaseTimes()
    for tokens in (1, 16, 17, 300):
        phases.observe_step(tokens)
    s = phases.snapshot().iteration_tokens
    assert sum(s.counts) == 4 and s.total == 334
    assert s.counts[s.bounds.index(1.0)] == 1 and s.counts[s.bounds.index(16.0)] == 1
    assert s.counts[s.bounds.index(32.0)] == 1 and s.counts[s.bounds.index(512.0)] == 1


def test_request_times_stamp_in_order():
    t = RequestTimes()
    t.mark_scheduled()
    first_scheduled = t.scheduled
    t.mark_token()
    t.mark_scheduled()  # rescheduled after a preemption: the first admission counts
    t.mark_token()
    assert t.queued <= first_scheduled == t.scheduled <= t.first_token <= t.last_token


def _gauges(phases: PhaseTimes) -> EngineGauges:
    s = phases.snapshot()
    return EngineGauges(running=2, waiting=1, kv_blocks_total=10, kv_blocks_free=6, kv_blocks_cached=1, kv_usage=0.4,
                        state_groups_total=4, state_groups_free=2, snapshots=0, snapshot_slots=4,
                        prefix_lookup_tokens=80, prefix_hit_tokens=32, preemptions=3, queue_time=s.queue,
                        prefill_time=s.prefill, decode_time=s.decode, inference_time=s.inference,
                        iteration_tokens=s.iteration_tokens,
                        cache_config=(("block_size", "16"), ("enable_prefix_caching", "True")))


def test_worker_exposes_engine_level_vllm_series():
    phases = PhaseTimes()
    phases.observe(_times())
    metrics = WorkerMetrics(CollectorRegistry(), "decode", with_tpot=True, model_name="kimi")
    metrics.watch_engine(lambda: _gauges(phases))
    samples = samples_of(metrics.registry)
    m = {"model_name": "kimi"}
    histograms = {"vllm:iteration_tokens_total"}
    for name in ENGINE_SERIES:
        name = name + "_count" if name.endswith("_seconds") or name in histograms else name
        labels = {"block_size": "16", "enable_prefix_caching": "True"} if name == "vllm:cache_config_info" else m
        assert (name, frozenset(labels.items())) in samples, name
    assert value(samples, "vllm:num_requests_running", **m) == 2
    assert value(samples, "vllm:num_requests_waiting", **m) == 1
    assert value(samples, "vllm:kv_cache_usage_perc", **m) == 0.4
    assert value(samples, "vllm:prefix_cache_queries_total", **m) == 80
    assert value(samples, "vllm:prefix_cache_hits_total", **m) == 32
    assert value(samples, "vllm:num_preemptions_total", **m) == 3
    assert value(samples, "vllm:request_decode_time_seconds_bucket", le="5.0", **m) == 0
    assert value(samples, "vllm:request_decode_time_seconds_bucket", le="10.0", **m) == 1  # cumulative
    assert value(samples, "vllm:request_decode_time_seconds_bucket", le="+Inf", **m) == 1
    assert value(samples, "vllm:request_decode_time_seconds_sum", **m) == 7.0
    assert value(samples, "vllm:request_inference_time_seconds_sum", **m) == 9.0
    assert value(samples, "vllm:iteration_tokens_total_count", **m) == 0
    assert value(samples, "kdamesh_decode_running_requests") == 2  # the kdamesh series stay


def test_worker_exposes_no_vllm_series_before_its_engine():
    metrics = WorkerMetrics(CollectorRegistry(), "prefill", with_tpot=False, model_name="kimi")
    metrics.watch_engine(lambda: None)
    assert "vllm:" not in generate_latest(metrics.registry).decode()


def test_gateway_request_level_series():
    metrics = GatewayMetrics(model_name="kimi")
    text = generate_latest(metrics.registry).decode()
    for name in REQUEST_SERIES:  # made at once, reading 0
        assert f'{name.removesuffix("_total")}' in text and 'model_name="kimi"' in text, name
    metrics.observe_run(["length"], 40, 6, start=10.0, first=10.5, last=11.0, num_tokens=6, n=2, max_tokens=6)
    metrics.observe_run(["tool_calls"], 10, 3, start=0.0, first=0.1, last=0.2, num_tokens=3)
    metrics.observe_run([], 10, 2, start=0.0, first=0.1, last=0.3, num_tokens=2)  # cut short
    metrics.observe_run([], 10, 0, start=0.0, first=None, last=None, num_tokens=0)  # refused: not counted
    s = samples_of(metrics.registry)
    m = {"model_name": "kimi"}
    assert value(s, "vllm:prompt_tokens_total", **m) == 60
    assert value(s, "vllm:generation_tokens_total", **m) == 11
    assert [value(s, "vllm:request_success_total", finished_reason=r, **m) for r in ("stop", "length", "abort")] \
        == [1, 1, 1]
    assert value(s, "vllm:time_to_first_token_seconds_count", **m) == 3
    assert value(s, "vllm:e2e_request_latency_seconds_count", **m) == 3
    assert value(s, "vllm:inter_token_latency_seconds_count", **m) == 5 + 2 + 1
    assert abs(value(s, "vllm:inter_token_latency_seconds_sum", **m) - (0.5 + 0.1 + 0.2)) < 1e-9
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.1", **m) == 7  # 5 gaps of 0.1, 2 of 0.05
    assert value(s, "vllm:request_time_per_output_token_seconds_count", **m) == 3  # one mean gap per request
    assert value(s, "vllm:request_prompt_tokens_count", **m) == 3
    assert value(s, "vllm:request_prompt_tokens_sum", **m) == 60
    assert value(s, "vllm:request_generation_tokens_bucket", le="5.0", **m) == 2
    assert value(s, "vllm:request_generation_tokens_sum", **m) == 11
    assert (value(s, "vllm:request_params_n_count", **m), value(s, "vllm:request_params_n_sum", **m)) == (3, 4)
    assert value(s, "vllm:request_params_max_tokens_count", **m) == 1  # the others did not set it
    assert value(s, "vllm:request_params_max_tokens_sum", **m) == 6
    assert value(s, "vllm:request_max_num_generation_tokens_sum", **m) == 6 + 3 + 2


def test_finished_reason_names():
    assert [finished_reason(r) for r in ("stop", "length", "abort", "tool_calls", None)] == \
        ["stop", "length", "abort", "stop", "stop"]



def test_a_speculating_worker_exposes_vllms_spec_decode_counters():
    phases = PhaseTimes()
    metrics = WorkerMetrics(CollectorRegistry(), "decode", with_tpot=True, model_name="kimi")
    metrics.watch_engine(lambda: dataclasses.replace(_gauges(phases), spec_num_drafts=10, spec_num_draft_tokens=30,
                                                     spec_num_accepted_tokens=17, spec_accepted_per_pos=(9, 5, 3)))
    samples = samples_of(metrics.registry)
    m = {"model_name": "kimi"}
    assert value(samples, "vllm:spec_decode_num_drafts_total", **m) == 10
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total", **m) == 30
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total", **m) == 17
    assert [value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **m)
            for i in range(3)] == [9, 5, 3]
    plain = WorkerMetrics(CollectorRegistry(), "decode", with_tpot=True, model_name="kimi")
    plain.watch_engine(lambda: _gauges(phases))
    assert "spec_decode" not in generate_latest(plain.registry).decode()  # no speculation: no series
