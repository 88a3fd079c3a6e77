"""The result of a run: `vllm bench serve`'s printed summary and its JSON, field for field.

JSON (`--save-result`), in this order:
- the run: `date` (%Y%m%d-%H%M%S), `endpoint_type`, `backend`, `label`, `model_id`, `tokenizer_id`, `num_prompts`,
  `request_rate` (a number, or "inf"), `burstiness`, `max_concurrency` (null when unlimited), then any
  `--metadata KEY=VALUE` pairs;
- the totals: `duration` (s), `completed`, `failed`, `total_input_tokens`, `total_output_tokens`,
  `request_throughput` (req/s), `request_goodput` (req/s, null without `--goodput`), `output_throughput` and
  `total_token_throughput` (tok/s), `max_output_tokens_per_s`, `max_concurrent_requests`; then kdamesh's
  `prefix_cache_hit_rate` with its two sums, `prefix_cache_cached_tokens` and `prefix_cache_prompt_tokens`;
- when the scraped `/metrics` expose speculative decoding counters (servebench/spec_metrics.py: `--metrics-url`, else
  the base URL's), vLLM's `spec_decode_acceptance_rate` (%), `spec_decode_acceptance_length`,
  `spec_decode_num_drafts`, `spec_decode_draft_tokens`, `spec_decode_accepted_tokens` and
  `spec_decode_per_position_acceptance_rates` (fractions), all over the timed run;
- per request, only with `--save-detailed` (as vLLM): `input_lens`, `output_lens`, `ttfts` (s), `itls` (s, a list per
  request), `latencies` (s), `start_times`, `queue_times`, `generated_texts`, `errors`;
- per metric chosen by `--percentile-metrics` (default `ttft,tpot,itl`; also `e2el`, `client_queue_time`,
  `e2el_including_client_queue`): `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<P>_<m>_ms` for each
  `--metric-percentiles` P (default 99; `p99.9` for 99.9).
File name: `--result-filename`, else `{label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json`, inside
`--result-dir` when given; `--append-result` appends one JSON object per line.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from typing import Any

import numpy as np

from servebench.metrics import BenchmarkMetrics, RequestOutput, percentile_key, stats_ms
from servebench.spec_metrics import summary_lines as spec_summary_lines

DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                   "generated_texts", "errors")
HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
           "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
           "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency")}


def benchmark_result(metrics: BenchmarkMetrics, outputs: list[RequestOutput], output_lens: list[int],
                     duration: float, goodput: dict[str, float] | None, selected_metrics: list[str],
                     percentiles: list[float], max_concurrency: int | None, request_rate: float) -> dict[str, Any]:
    """The measured part of the JSON (everything but the run's description)."""
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "prefix_cache_hit_rate": metrics.prefix_cache_hit_rate,
        "prefix_cache_cached_tokens": metrics.total_cached,
        "prefix_cache_prompt_tokens": metrics.total_input,
    }
    extra: dict[str, list[float]] = {}
    if max_concurrency is not None:
        extra["client_queue_time"] = [o.client_queue_time for o in outputs if o.success]
        if not math.isinf(request_rate):
            extra["e2el_including_client_queue"] = [o.latency + o.client_queue_time for o in outputs if o.success]
    for name in selected_metrics:
        if name in ("ttft", "tpot", "itl", "e2el"):
            stats = getattr(metrics, f"{name}_ms")
        elif name in extra:
            stats = stats_ms(extra[name], percentiles)
        else:
            continue
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"{percentile_key(p)}_{name}_ms"] = value
    return result


def run_header(*, backend: str, label: str | None, model_id: str, tokenizer_id: str | None, num_prompts: int,
               request_rate: float, burstiness: float, max_concurrency: int | None,
               metadata: list[str] | None = None, date: str | None = None) -> dict[str, Any]:
    header: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
    }
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"invalid --metadata {item!r}: use KEY=VALUE")
        header[key.strip()] = value.strip()
    header["request_rate"] = request_rate if request_rate < math.inf else "inf"
    header["burstiness"] = burstiness
    header["max_concurrency"] = max_concurrency
    return header


def strip_detailed(result: dict[str, Any]) -> dict[str, Any]:
    """The result without the per-request lists (what is saved without --save-detailed)."""
    return {k: v for k, v in result.items() if k not in DETAILED_FIELDS}


def result_filename(*, result_filename: str | None, result_dir: str | None, label: str, request_rate: float,
                    max_concurrency: int | None, model_id: str, date: str) -> str:
    name = result_filename
    if not name:
        concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
        name = f"{label}-{request_rate}qps{concurrency}-{model_id.rstrip('/').split('/')[-1]}-{date}.json"
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        name = os.path.join(result_dir, name)
    return name


def save(result: dict[str, Any], path: str, append: bool = False) -> None:
    with open(path, "a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell() != 0:
            f.write("\n")
        json.dump(result, f, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def summary(result: dict[str, Any], selected_metrics: list[str], max_concurrency: int | None,
            request_rate: float, goodput: bool) -> str:
    """vLLM's printed table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{}}".format(name, value, fmt))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if goodput:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    if "prefix_cache_hit_rate" in result:
        row("Prefix cache hit rate (%):", 100 * result["prefix_cache_hit_rate"], ".2f")
    lines += spec_summary_lines(result)
    for name in selected_metrics:
        if f"mean_{name}_ms" not in result:
            continue
        short, header = HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for key in [k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")]:
            pct = key[1:-len(f"_{name}_ms")]
            try:
                float(pct)
            except ValueError:
                continue
            row(f"P{pct} {short} (ms):", result[key], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
