"""Speculative decoding in `kdamesh bench serve`'s results: vLLM's rule, scrape `/metrics` before and after the run.

Contract:
- Where: the `/metrics` URLs of `--metrics-url` (repeatable: one per worker; `kdamesh up` prints them on its
  `metrics {...}` line), else `{base_url}/metrics` (vLLM's default). A kdamesh gateway's /metrics carries its
  workers' engine series too (gateway/worker_metrics.py, labelled by worker), so the default works against a mesh;
  do not pass the gateway's and the workers' URLs together (each worker would count twice). The counters of every
  URL are summed.
- What: vLLM's counters `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position}` (summed over their other
  labels); `parse_counters` returns None for a text without them (the server does not speculate).
- The run's numbers are the deltas after − before (`SpecDecodeCounters.minus`); `spec_decode_result` turns them into
  vLLM's result fields: `spec_decode_acceptance_rate` (accepted / draft tokens, in %), `spec_decode_acceptance_length`
  (1 + accepted / drafts: the bonus token counts; 1.0 when nothing was drafted: every step made one token),
  `spec_decode_num_drafts`, `spec_decode_draft_tokens`, `spec_decode_accepted_tokens` and
  `spec_decode_per_position_acceptance_rates` (accepted at position i / drafts, fractions).
- Failures: an explicit `--metrics-url` that does not answer 200 raises RuntimeError naming it (the flag works or the
  run is refused); the default URL failing means "no speculative metrics", as in vLLM. The result has the
  `spec_decode_*` fields only when some URL exposed the series both before and after.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from telemetry.vllm import SPEC_DECODE_SERIES

DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = SPEC_DECODE_SERIES
SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's cumulative speculative decoding counters (of one server, or summed over several)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()  # accepted drafts at position 0..k-1

    def plus(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """Summed counter by counter (per position: the longer k wins, missing positions count 0)."""
        return SpecDecodeCounters(self.num_drafts + other.num_drafts,
                                  self.num_draft_tokens + other.num_draft_tokens,
                                  self.num_accepted_tokens + other.num_accepted_tokens,
                                  _zip_with(self.accepted_per_pos, other.accepted_per_pos, 1))

    def minus(self, before: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """What was counted since `before` (counters only grow; a restarted worker would show a negative delta)."""
        delta = SpecDecodeCounters(self.num_drafts - before.num_drafts,
                                   self.num_draft_tokens - before.num_draft_tokens,
                                   self.num_accepted_tokens - before.num_accepted_tokens,
                                   _zip_with(self.accepted_per_pos, before.accepted_per_pos, -1))
        if min(delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens, *delta.accepted_per_pos, 0) < 0:
            raise RuntimeError("speculative decoding counters went down during the run (a worker restarted?)")
        return delta


def _zip_with(a: tuple[int, ...], b: tuple[int, ...], sign: int) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return tuple(x + sign * y for x, y in zip(a, b))


def parse_counters(text: str) -> SpecDecodeCounters | None:
    """The spec counters of one Prometheus exposition text; None when it has none of them."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name not in SPEC_DECODE_SERIES:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the `_created` timestamps
            found = True
            if family.name == PER_POS:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            else:
                totals[family.name] += sample.value
    if not found:
        return None
    positions = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeCounters(int(totals[DRAFTS]), int(totals[DRAFT_TOKENS]), int(totals[ACCEPTED]), positions)


async def scrape(client: httpx.AsyncClient, urls: list[str], explicit: bool,
                 headers: dict[str, str] | None) -> SpecDecodeCounters | None:
    """The counters summed over `urls` (None when none exposes them). `explicit`: the URLs came from
    `--metrics-url`, so one that fails is an error rather than "no metrics"."""
    total: SpecDecodeCounters | None = None
    for url in urls:
        try:
            response = await client.get(url, headers=headers, timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
            counters = parse_counters(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            if explicit:
                raise RuntimeError(f"--metrics-url {url}: {exc}") from exc
            return None
        if counters is not None:
            total = counters if total is None else total.plus(counters)
    return total


def spec_decode_result(delta: SpecDecodeCounters) -> dict[str, object]:
    """vLLM's `spec_decode_*` result fields from the run's deltas."""
    drafts, draft_tokens, accepted = delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": draft_tokens,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_per_position_acceptance_rates": [n / drafts if drafts else 0.0 for n in delta.accepted_per_pos],
    }


def summary_lines(result: dict[str, object]) -> list[str]:
    """vLLM's "Speculative Decoding" block of the printed summary (empty without the fields)."""
    if "spec_decode_acceptance_length" not in result:
        return []
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-")]
    for name, key, fmt in (("Acceptance rate (%):", "spec_decode_acceptance_rate", ".2f"),
                           ("Acceptance length:", "spec_decode_acceptance_length", ".2f"),
                           ("Drafts:", "spec_decode_num_drafts", ""),
                           ("Draft tokens:", "spec_decode_draft_tokens", ""),
                           ("Accepted tokens:", "spec_decode_accepted_tokens", "")):
        lines.append("{:<40} {:<10{}}".format(name, result[key], fmt))
    lines.append("Per-position acceptance (%):")
    for pos, rate in enumerate(result["spec_decode_per_position_acceptance_rates"]):
        lines.append("{:<40} {:<10.2f}".format(f"  Position {pos}:", 100 * rate))
    return lines


class RunScrape:
    """The two scrapes of one run: `before()` (the runner's `before_main`), then `delta()` after the last response:
    the run's counters, or None when the series were not there both times."""

    def __init__(self, client: httpx.AsyncClient, urls: list[str], explicit: bool, headers: dict[str, str] | None):
        self._client, self._urls, self._explicit, self._headers = client, urls, explicit, headers
        self._before: SpecDecodeCounters | None = None

    async def before(self) -> None:
        self._before = await scrape(self._client, self._urls, self._explicit, self._headers)

    async def delta(self) -> SpecDecodeCounters | None:
        after = await scrape(self._client, self._urls, self._explicit, self._headers)
        if self._before is None or after is None:
            return None
        return after.minus(self._before)
