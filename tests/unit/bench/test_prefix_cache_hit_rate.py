"""`kdamesh bench serve`'s prefix-cache hit rate: cached prompt tokens (usage.prompt_tokens_details.cached_tokens) /
prompt tokens, over successful requests; in the result JSON with its two sums and in the printed summary."""

from __future__ import annotations

import dataclasses
import math

import pytest

from servebench import results
from servebench.metrics import calculate_metrics, prefix_cache_hit_rate
from tests.unit.bench.timelines import failed, ok


def _outputs():
    a = dataclasses.replace(ok(0.0, 0.1, [0.02], 2, prompt_len=100), cached_tokens=64)
    b = dataclasses.replace(ok(0.1, 0.1, [0.02], 2, prompt_len=50), cached_tokens=0)
    c = ok(0.2, 0.1, [0.02], 2, prompt_len=50)  # the server sent no cached count: 0 cached
    d = dataclasses.replace(failed(prompt_len=1000), cached_tokens=999)  # failed: not counted
    return [a, b, c, d]


def test_hit_rate_is_cached_over_prompt_tokens_of_successful_requests():
    metrics, lens = calculate_metrics(_outputs(), 1.0, [99.0])
    assert (metrics.total_cached, metrics.total_input) == (64, 200)
    assert metrics.prefix_cache_hit_rate == pytest.approx(0.32)
    measured = results.benchmark_result(metrics, _outputs(), lens, 1.0, None, ["ttft"], [99.0], None, math.inf)
    assert (measured["prefix_cache_hit_rate"], measured["prefix_cache_cached_tokens"],
            measured["prefix_cache_prompt_tokens"]) == (pytest.approx(0.32), 64, 200)
    text = results.summary(measured, ["ttft"], None, math.inf, False)
    assert "Prefix cache hit rate (%):               32.00" in text


def test_hit_rate_without_prompt_tokens_is_zero():
    assert prefix_cache_hit_rate(0, 0) == 0.0
    with pytest.warns(UserWarning, match="All requests failed"):
        metrics, _ = calculate_metrics([failed()], 1.0, [99.0])
    assert metrics.prefix_cache_hit_rate == 0.0
