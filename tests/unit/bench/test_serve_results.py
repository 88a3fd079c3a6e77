"""`kdamesh bench serve`'s result JSON (vLLM's field names), its file name, summary and flags."""

from __future__ import annotations

import json
import math

import pytest

from servebench import results
from servebench.cli import build_parser
from servebench.metrics import calculate_metrics

# The documented field names of `vllm bench serve --save-result` (vllm/benchmarks/serve.py), for the default
# --percentile-metrics ttft,tpot,itl and --metric-percentiles 99.
VLLM_RUN_FIELDS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                   "request_rate", "burstiness", "max_concurrency"}
VLLM_TOTAL_FIELDS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                     "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                     "max_output_tokens_per_s", "max_concurrent_requests"}
KDAMESH_TOTAL_FIELDS = {"prefix_cache_hit_rate", "prefix_cache_cached_tokens", "prefix_cache_prompt_tokens"}
VLLM_DETAILED_FIELDS = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                        "generated_texts", "errors"}
VLLM_PERCENTILE_FIELDS = {f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl")
                          for stat in ("mean", "median", "std", "p99")}


def _result(timeline, **kw):
    args = dict(goodput={"ttft": 250}, selected_metrics=["ttft", "tpot", "itl"], percentiles=[99.0],
                max_concurrency=None, request_rate=math.inf)
    args.update(kw)
    m, lens = calculate_metrics(timeline, 2.0, args["percentiles"], args["goodput"])
    measured = results.benchmark_result(m, timeline, lens, 2.0, **args)
    header = results.run_header(backend="openai", label=None, model_id="tiny-k3", tokenizer_id="/ckpt",
                                num_prompts=4, request_rate=args["request_rate"], burstiness=1.0,
                                max_concurrency=args["max_concurrency"])
    return {**header, **measured}


def test_result_fields_are_vllms(timeline, tmp_path):
    result = _result(timeline)
    totals = VLLM_TOTAL_FIELDS | KDAMESH_TOTAL_FIELDS
    assert set(result) == VLLM_RUN_FIELDS | totals | VLLM_DETAILED_FIELDS | VLLM_PERCENTILE_FIELDS
    assert set(results.strip_detailed(result)) == VLLM_RUN_FIELDS | totals | VLLM_PERCENTILE_FIELDS
    assert result["request_rate"] == "inf" and result["max_concurrency"] is None
    assert result["request_goodput"] == pytest.approx(1.0)
    assert result["output_lens"] == [4, 1, 0, 3] and result["errors"][2] == "boom"
    assert result["itls"][0] == [0.02, 0.03, 0.05]
    path = tmp_path / "r.json"
    results.save(result, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    text = results.summary(result, ["ttft", "tpot", "itl"], None, math.inf, True)
    assert "Successful requests:                     3" in text and "P99 TTFT (ms):" in text


def test_result_fields_with_more_metrics(timeline):
    result = _result(timeline, goodput={}, selected_metrics=["ttft", "e2el", "client_queue_time",
                                                             "e2el_including_client_queue"],
                     percentiles=[50.0, 99.9], max_concurrency=2, request_rate=4.0)
    assert result["request_goodput"] is None and result["request_rate"] == 4.0 and result["max_concurrency"] == 2
    for m in ("ttft", "e2el", "client_queue_time", "e2el_including_client_queue"):
        assert {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p99.9_{m}_ms"} <= set(result)
    assert "mean_tpot_ms" not in result and "p99_ttft_ms" not in result


def test_result_filename(tmp_path):
    name = results.result_filename(result_filename=None, result_dir=str(tmp_path / "d"), label="openai",
                                   request_rate=math.inf, max_concurrency=4, model_id="/ckpt/tiny-k3",
                                   date="20260101-000000")
    assert name == str(tmp_path / "d" / "openai-infqps-concurrency4-tiny-k3-20260101-000000.json")
    assert (tmp_path / "d").is_dir()


def test_cli_flags_are_vllms():
    args = build_parser().parse_args([
        "--base-url", "http://h:1", "--model", "m", "--endpoint", "/v1/chat/completions", "--backend", "openai-chat",
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
        "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "4", "--request-rate", "inf", "--burstiness", "0.5",
        "--max-concurrency", "4", "--num-prompts", "8", "--seed", "1", "--ignore-eos", "--percentile-metrics",
        "ttft,e2el", "--metric-percentiles", "50,99", "--goodput", "ttft:500", "tpot:50", "--save-result",
        "--result-dir", "d", "--result-filename", "f.json", "--disable-tqdm", "--tokenizer", "t",
        "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.1",
        "--random-prefix-len", "4"])
    assert math.isinf(args.request_rate) and args.goodput == ["ttft:500", "tpot:50"]
    assert args.prefix_repetition_prefix_len == 64 and args.max_concurrency == 4
    defaults = build_parser().parse_args([])
    assert (defaults.endpoint, defaults.backend, defaults.dataset_name, defaults.num_prompts) == \
        ("/v1/completions", "openai", "random", 1000)
    assert (defaults.random_input_len, defaults.random_output_len, defaults.metric_percentiles) == (1024, 128, "99")


def test_kdamesh_cli_has_bench_serve():
    from deploy.cli import build_parser as kdamesh_parser

    args = kdamesh_parser().parse_args(["bench", "serve", "--num-prompts", "3", "--port", "1"])
    assert args.command == "bench" and args.bench_command == "serve" and args.num_prompts == 3
    assert args.func.__name__ == "_bench_serve"
