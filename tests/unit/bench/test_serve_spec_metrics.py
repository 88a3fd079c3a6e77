"""`kdamesh bench serve`'s speculative decoding fields: the counters parsed from the exposition the workers really
emit (telemetry.vllm.VllmEngineCollector), summed over workers, the run's deltas and vLLM's result fields; the
summary block; the scrape's handling of a failing `--metrics-url`."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from servebench import results
from servebench.spec_metrics import RunScrape, SpecDecodeCounters, parse_counters, scrape, spec_decode_result
from telemetry.metrics import EngineGauges
from telemetry.vllm import VllmEngineCollector


def exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...], model="tiny") -> str:
    gauges = EngineGauges(running=0, waiting=0, kv_blocks_total=8, kv_blocks_free=8, kv_blocks_cached=0, kv_usage=0.0,
                          state_groups_total=1, state_groups_free=1, snapshots=0, snapshot_slots=0,
                          prefix_lookup_tokens=0, prefix_hit_tokens=0, preemptions=0, spec_num_drafts=drafts,
                          spec_num_draft_tokens=draft_tokens, spec_num_accepted_tokens=accepted,
                          spec_accepted_per_pos=per_pos)
    registry = CollectorRegistry()
    registry.register(VllmEngineCollector(model, lambda: gauges))
    return generate_latest(registry).decode()


def test_parse_the_workers_exposition():
    assert parse_counters(exposition(10, 30, 12, (7, 4, 1))) == SpecDecodeCounters(10, 30, 12, (7, 4, 1))
    assert parse_counters(exposition(0, 0, 0, ())) is None  # a worker that does not speculate has no series
    assert parse_counters("# nothing here\n") is None


def test_sum_over_workers_and_delta():
    a, b = SpecDecodeCounters(10, 30, 12, (7, 4, 1)), SpecDecodeCounters(2, 10, 3, (2, 1, 0, 0, 0))
    assert a.plus(b) == SpecDecodeCounters(12, 40, 15, (9, 5, 1, 0, 0))
    before, after = SpecDecodeCounters(4, 12, 5, (3, 2, 0)), SpecDecodeCounters(14, 42, 17, (10, 6, 1))
    assert after.minus(before) == SpecDecodeCounters(10, 30, 12, (7, 4, 1))
    with pytest.raises(RuntimeError, match="went down"):
        before.minus(after)


def test_result_fields_are_vllms_math():
    got = spec_decode_result(SpecDecodeCounters(10, 30, 12, (7, 4, 1)))
    assert got == {"spec_decode_acceptance_rate": pytest.approx(40.0),  # 12 of 30 draft tokens, in %
                   "spec_decode_acceptance_length": pytest.approx(2.2),  # 1 + 12 / 10: the bonus token counts
                   "spec_decode_num_drafts": 10, "spec_decode_draft_tokens": 30, "spec_decode_accepted_tokens": 12,
                   "spec_decode_per_position_acceptance_rates": [pytest.approx(0.7), pytest.approx(0.4),
                                                                 pytest.approx(0.1)]}
    # consistency the fields must keep: per-position rates sum to accepted / drafts
    assert sum(got["spec_decode_per_position_acceptance_rates"]) == pytest.approx(12 / 10)
    idle = spec_decode_result(SpecDecodeCounters(0, 0, 0, (0, 0)))
    assert idle["spec_decode_acceptance_length"] == 1.0 and idle["spec_decode_acceptance_rate"] == 0.0
    assert idle["spec_decode_per_position_acceptance_rates"] == [0.0, 0.0]


def test_summary_prints_the_block_only_with_the_fields(timeline):
    from servebench.metrics import calculate_metrics

    m, lens = calculate_metrics(timeline, 2.0, [99.0], None)
    measured = results.benchmark_result(m, timeline, lens, 2.0, None, ["ttft"], [99.0], None, math.inf)
    assert "Speculative Decoding" not in results.summary(measured, ["ttft"], None, math.inf, False)
    measured.update(spec_decode_result(SpecDecodeCounters(10, 30, 12, (7, 4, 1))))
    text = results.summary(measured, ["ttft"], None, math.inf, False)
    assert "Acceptance length:                       2.20" in text
    assert "Acceptance rate (%):                     40.00" in text
    assert "  Position 2:                            10.00" in text


def _client(pages: dict[str, tuple[int, str]]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        status, text = pages.get(str(request.url), (404, "no"))
        return httpx.Response(status, text=text)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_scrape_sums_urls_and_refuses_a_failing_explicit_url():
    pages = {"http://d1/metrics": (200, exposition(3, 9, 4, (3, 1, 0))),
             "http://d2/metrics": (200, exposition(1, 3, 3, (1, 1, 1))),
             "http://plain/metrics": (200, exposition(0, 0, 0, ()))}

    async def main():
        async with _client(pages) as client:
            both = await scrape(client, ["http://d1/metrics", "http://d2/metrics", "http://plain/metrics"], True, None)
            assert both == SpecDecodeCounters(4, 12, 7, (4, 2, 1))
            assert await scrape(client, ["http://plain/metrics"], True, None) is None
            assert await scrape(client, ["http://gone/metrics"], False, None) is None  # the default URL: no metrics
            with pytest.raises(RuntimeError, match="--metrics-url http://gone/metrics"):
                await scrape(client, ["http://gone/metrics"], True, None)
            run = RunScrape(client, ["http://d1/metrics"], True, None)
            await run.before()
            pages["http://d1/metrics"] = (200, exposition(5, 15, 6, (4, 2, 0)))
            assert await run.delta() == SpecDecodeCounters(2, 6, 2, (1, 1, 0))

    asyncio.run(main())
