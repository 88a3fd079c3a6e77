"""End to end: `kdamesh bench serve` against `kdamesh up` (tiny-k3, disaggregated, every request remote, n-gram
speculation on the workers) — a short run completes with zero failures and writes a result file with `vllm bench
serve`'s field names and vLLM's `spec_decode_*` fields — from the gateway's /metrics by default (it carries the
workers' counters), or with `--metrics-url` of the workers, equal to the workers' own counters over the run."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from servebench.spec_metrics import parse_counters, spec_decode_result
from tests.e2e.launched import kdamesh, launch, stop

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SPEC_FIELDS = {"spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
               "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"}

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
    launched = launch(tmp_path_factory.mktemp("bench-e2e"), "endpoints ", up_flags=["--speculative-config", NGRAM])
    line = next(x for x in launched.log.read_text().splitlines() if x.startswith("metrics "))
    yield {"port": launched.port, "model": launched.model, "root": launched.root,
           "metrics": json.loads(line[len("metrics "):])}
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
    assert set(result) == RUN_FIELDS | TOTAL_FIELDS | DETAILED_FIELDS | SPEC_FIELDS | percentile_fields(
        ("ttft", "tpot", "itl"), (99,))
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
    assert set(result) == RUN_FIELDS | TOTAL_FIELDS | SPEC_FIELDS | percentile_fields(("ttft", "tpot", "itl", "e2el"),
                                                                                      (50, 90))
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


def test_speculative_decoding_fields_from_the_workers(mesh):
    workers = [mesh["metrics"]["prefill"], mesh["metrics"]["decode"]]

    def counters():
        found = [parse_counters(httpx.get(url, timeout=10).text) for url in workers]
        assert found[1] is not None  # the decode worker speculates
        return [c for c in found if c is not None]

    before = counters()
    flags = [x for url in workers for x in ("--metrics-url", url)]
    # frequency_penalty -2 makes the untrained model's greedy output fall into loops, which prompt lookup predicts
    out = bench(mesh, "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "24",
                "--random-output-len", "32", "--max-concurrency", "3", "--temperature", "0", "--frequency-penalty", "-2",
                "--result-filename", "spec.json", *flags)
    after = counters()
    result = json.loads((mesh["root"] / "results" / "spec.json").read_text())
    assert SPEC_FIELDS <= set(result) and result["completed"] == 6
    delta = after[0].minus(before[0])
    for a, b in zip(after[1:], before[1:]):
        delta = delta.plus(a.minus(b))
    want = spec_decode_result(delta)
    rates = result.pop("spec_decode_per_position_acceptance_rates")
    assert rates == pytest.approx(want.pop("spec_decode_per_position_acceptance_rates")) and len(rates) == 3
    assert {k: result[k] for k in want} == pytest.approx(want)
    assert result["spec_decode_accepted_tokens"] > 0 and result["spec_decode_acceptance_length"] > 1
    assert result["spec_decode_draft_tokens"] <= 3 * result["spec_decode_num_drafts"]  # a lookup may draft fewer
    assert sum(rates) * result["spec_decode_num_drafts"] == pytest.approx(result["spec_decode_accepted_tokens"])
    assert "Speculative Decoding" in out and "Acceptance length:" in out
