"""End to end: `kdamesh bench serve` against `kdamesh up` (tiny-k3, disaggregated, every request remote) — a short
run completes with zero failures and writes a result file with `vllm bench serve`'s field names."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.launched import kdamesh, launch, stop

# `vllm bench serve --save-result` field names (vllm/benchmarks/serve.py) for the flags used below.
RUN_FIELDS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
              "burstiness", "max_concurrency"}
TOTAL_FIELDS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "prefix_cache_hit_rate", "prefix_cache_cached_tokens",
                "prefix_cache_prompt_tokens"}
DETAILED_FIELDS = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                   "generated_texts", "errors"}


def percentile_fields(metrics, percentiles):
    return {f"{s}_{m}_ms" for m in metrics for s in ("mean", "median", "std", *(f"p{p}" for p in percentiles))}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("bench-e2e"), "endpoints ")
    yield {"port": launched.port, "model": launched.model, "root": launched.root}
    stop(launched.proc)


def bench(mesh, *flags, timeout=300):
    cmd = [*kdamesh(), "bench", "serve", "--base-url", f"http://127.0.0.1:{mesh['port']}", "--disable-tqdm",
           "--save-result", "--result-dir", str(mesh["root"] / "results"), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=mesh["root"])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_short_random_run_writes_vllm_fields(mesh):
    out = bench(mesh, "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "16",
                "--random-output-len", "8", "--max-concurrency", "4", "--save-detailed", "--goodput", "ttft:60000",
                "--result-filename", "random.json")
    assert "Serving Benchmark Result" in out and "Successful requests:                     8" in out
    result = json.loads((mesh["root"] / "results" / "random.json").read_text())
    assert set(result) == RUN_FIELDS | TOTAL_FIELDS | DETAILED_FIELDS | percentile_fields(("ttft", "tpot", "itl"),
                                                                                          (99,))
    assert result["completed"] == 8 and result["failed"] == 0 and result["errors"] == [""] * 8
    assert result["model_id"] == str(mesh["model"]) and result["tokenizer_id"] == str(mesh["model"])
    assert result["input_lens"] == [16] * 8  # text prompts of exactly 16 tokens, as the server counted them
    assert result["output_lens"] == [8] * 8 and result["total_output_tokens"] == 64  # ignore_eos (random dataset)
    assert result["total_input_tokens"] == 128
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    assert 1 <= result["max_concurrent_requests"] <= 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert all(t > 0 for t in result["ttfts"]) and all(len(itl) >= 1 for itl in result["itls"])
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] > 0


def test_prefix_repetition_at_a_request_rate(mesh):
    bench(mesh, "--dataset-name", "prefix_repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len", "48",
          "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
          "--prefix-repetition-output-len", "4", "--prompt-token-ids", "--ignore-eos", "--request-rate", "20",
          "--burstiness", "0.5", "--seed", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
          "--metric-percentiles", "50,90", "--result-filename", "prefix.json")
    result = json.loads((mesh["root"] / "results" / "prefix.json").read_text())
    assert set(result) == RUN_FIELDS | TOTAL_FIELDS | percentile_fields(("ttft", "tpot", "itl", "e2el"), (50, 90))
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 56 and result["total_output_tokens"] == 6 * 4
    assert result["request_rate"] == 20.0 and result["burstiness"] == 0.5 and result["request_goodput"] is None


def test_chat_endpoint(mesh):
    bench(mesh, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--num-prompts", "4",
          "--random-input-len", "24", "--random-output-len", "6", "--max-concurrency", "2", "--save-detailed",
          "--result-filename", "chat.json")
    result = json.loads((mesh["root"] / "results" / "chat.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["backend"] == "openai-chat"
    assert result["output_lens"] == [6] * 4
    assert all(n > 24 for n in result["input_lens"])  # the server's count: the prompt inside the chat format
