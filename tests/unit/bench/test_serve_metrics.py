"""`kdamesh bench serve`'s metrics on synthetic timelines with known answers (TTFT, TPOT, ITL, goodput) and its
arrival schedules."""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
import pytest

from servebench.metrics import calculate_metrics, parse_goodput, percentile_key, tpot_of
from servebench.runner import arrival_times
from tests.unit.bench.timelines import failed, ok


def test_metrics_on_a_known_timeline(timeline):
    m, lens = calculate_metrics(timeline, dur_s=2.0, selected_percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert lens == [4, 1, 0, 3]  # failed: 0; D: 3 chunks (no usage)
    assert m.total_input == 10 + 20 + 40  # failed requests' prompts are not counted
    assert m.total_output == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx((70 + 8) / 2.0)
    # TTFT over successful requests: 100, 200, 300 ms
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.std == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))  # population std
    assert dict(m.ttft_ms.percentiles) == pytest.approx({50: 200.0, 99: 298.0})  # linear interpolation
    # TPOT = (E2EL - TTFT) / (output - 1): A (0.2-0.1)/3, D (0.32-0.3)/2; B (single token) has none
    tpots = [(0.2 - 0.1) / 3 * 1e3, (0.32 - 0.3) / 2 * 1e3]
    assert m.tpot_ms.mean == pytest.approx(statistics.mean(tpots))
    assert m.tpot_ms.median == pytest.approx(statistics.median(tpots))
    assert m.tpot_ms.std == pytest.approx(statistics.pstdev(tpots))
    # ITL pooled over all chunks of all requests
    itls = [20.0, 30.0, 50.0, 10.0, 10.0]
    assert m.itl_ms.mean == pytest.approx(24.0)
    assert m.itl_ms.median == pytest.approx(20.0)
    assert dict(m.itl_ms.percentiles)[99] == pytest.approx(np.percentile(itls, 99))
    assert m.e2el_ms.mean == pytest.approx((200 + 200 + 320) / 3)
    assert m.e2el_ms.median == pytest.approx(200.0)
    # all 8 chunks fall in the first second; A and B overlap, D starts exactly when A ends (half-open)
    assert m.max_output_tokens_per_s == 8
    assert m.max_concurrent_requests == 2


def test_tpot_excludes_single_token_outputs():
    only_single = [ok(0.0, 0.1, [], 1), ok(0.0, 0.3, [], 1)]
    m, lens = calculate_metrics(only_single, dur_s=1.0, selected_percentiles=[99])
    assert lens == [1, 1]
    assert m.tpot_ms.mean == m.tpot_ms.median == m.tpot_ms.std == 0.0  # no TPOT sample: zeros, as vLLM
    assert m.itl_ms.mean == 0.0
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert tpot_of(only_single[0], 1) is None
    assert tpot_of(ok(0, 0.1, [0.1, 0.1], 3), 3) == pytest.approx(0.1)


def test_usage_count_beats_chunk_count_for_tpot():
    """A chunk may carry several tokens: TPOT divides by the server's token count, ITL stays per chunk."""
    bundled = ok(0.0, 0.1, [0.2], output_tokens=5, latency=0.3)  # 2 chunks, 5 tokens
    m, lens = calculate_metrics([bundled], dur_s=1.0, selected_percentiles=[99])
    assert lens == [5]
    assert m.tpot_ms.mean == pytest.approx(0.2 / 4 * 1e3)
    assert m.itl_ms.mean == pytest.approx(200.0)


def test_all_requests_failed():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, lens = calculate_metrics([failed(), failed()], dur_s=1.0, selected_percentiles=[99])
    assert any("All requests failed" in str(w.message) for w in caught)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (0, 2, 0, 0)
    assert lens == [0, 0]
    assert m.request_throughput == m.ttft_ms.mean == m.max_output_tokens_per_s == 0.0
    assert m.max_concurrent_requests == 0


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 250}, 2),  # A (100), B (200) meet; D (300) does not
    ({"tpot": 20}, 2),  # A's 33.3 ms misses; B (single token: TPOT 0) and D (10 ms) meet
    ({"ttft": 250, "tpot": 20}, 1),  # only B meets both
    ({"e2el": 200}, 2),  # equal to the SLO meets it: A and B (200 ms), not D (320)
    ({"ttft": 50}, 0),
])
def test_goodput(timeline, slo, good):
    m, _ = calculate_metrics(timeline, dur_s=2.0, selected_percentiles=[99], goodput_config=slo)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_parse_goodput_and_percentile_names():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert [percentile_key(p) for p in (99, 50.0, 99.9)] == ["p99", "p50", "p99.9"]


# -- arrivals ------------------------------------------------------------------------------------------------------


def test_arrivals_infinite_rate_all_at_once():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_times(5, math.inf, 0.5, seed=0) == [0.0] * 5


def test_arrivals_are_seeded_and_end_at_n_over_rate():
    a = arrival_times(50, 4.0, 1.0, seed=7)
    assert a == arrival_times(50, 4.0, 1.0, seed=7)
    assert a != arrival_times(50, 4.0, 1.0, seed=8)
    assert a[-1] == pytest.approx(50 / 4.0)  # rescaled, as vLLM: the offered rate does not depend on the seed
    assert all(0 < x < y for x, y in zip(a, a[1:]))
    assert arrival_times(4, 2.0, math.inf, seed=0) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # evenly spaced


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness):
    """Gaps are gamma(shape=b, mean=1/rate): coefficient of variation 1/sqrt(b) (1: Poisson)."""
    times = np.array(arrival_times(20000, 10.0, burstiness, seed=1))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_arguments_are_checked():
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, b)
