"""The workers' Prometheus series on the gateway's own `/metrics`, so a dashboard or a benchmark client that knows only
the API URL sees the engine series (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, the prefix cache
counters, the phase histograms, ... and whatever series a worker adds later: nothing here names them).

Contract:
- `WorkerSeries(settings)`. `await refresh(pools)` scrapes every worker of `pools` (`{"decode"|"prefill": {address:
  grpc.aio.Channel}}`) through `MetricsService.Scrape` (protos/metrics.proto) concurrently, each within
  `scrape_timeout_s`; a worker scraped less than `min_interval_s` ago is not asked again (frequent scrapes of the
  gateway do not multiply onto the workers). A worker that fails or times out keeps its last answer for
  `stale_after_s`, then drops out; one that left its pool is forgotten. So `/metrics` waits at most
  `scrape_timeout_s` for a dead worker, never longer.
- `render(exclude)` -> the exposition text of every worker's families, merged by name (one HELP/TYPE per family), each
  sample labelled `pool` and `worker` (the worker's gRPC address): sum over `worker` for the mesh's totals, as over
  pods. Families named in `exclude` (the gateway's own) are left out, so no name is exposed twice.
- `up` -> `{address: bool}`: whether the latest scrape of each known worker succeeded (the gateway exposes it as
  `kdamesh_gateway_worker_scrape_up{pool, address}`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from protos import metrics_pb2, metrics_pb2_grpc

log = logging.getLogger(__name__)

Pools = Mapping[str, Mapping[str, grpc.aio.Channel]]


@dataclass(frozen=True)
class ScrapeSettings:
    scrape_timeout_s: float = 1.0
    min_interval_s: float = 1.0
    stale_after_s: float = 30.0


@dataclass
class _Scraped:
    pool: str
    families: list[Metric]
    at: float  # time.monotonic() of the answer
    up: bool = True


class WorkerSeries:
    """The latest answer of each worker (see the module docstring)."""

    def __init__(self, settings: ScrapeSettings = ScrapeSettings()):
        self.settings = settings
        self._scraped: dict[str, _Scraped] = {}

    @property
    def up(self) -> dict[str, bool]:
        return {address: s.up for address, s in self._scraped.items()}

    def pool_of(self, address: str) -> str:
        return self._scraped[address].pool

    async def refresh(self, pools: Pools) -> None:
        members = {address: (pool, channel) for pool, workers in pools.items() for address, channel in workers.items()}
        for gone in set(self._scraped) - set(members):
            del self._scraped[gone]
        now = time.monotonic()
        due = [(address, pool, channel) for address, (pool, channel) in members.items()
               if address not in self._scraped or now - self._scraped[address].at >= self.settings.min_interval_s
               or not self._scraped[address].up]
        await asyncio.gather(*(self._scrape(address, pool, channel) for address, pool, channel in due))

    async def _scrape(self, address: str, pool: str, channel: grpc.aio.Channel) -> None:
        try:
            reply = await metrics_pb2_grpc.MetricsServiceStub(channel).Scrape(
                metrics_pb2.ScrapeRequest(), timeout=self.settings.scrape_timeout_s)
            families = list(text_string_to_metric_families(reply.text.decode("utf-8")))
        except (grpc.RpcError, ValueError) as exc:
            self._failed(address, pool, exc)
            return
        self._scraped[address] = _Scraped(pool, families, time.monotonic())

    def _failed(self, address: str, pool: str, exc: Exception) -> None:
        last = self._scraped.get(address)
        detail = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
        log.debug("metrics scrape of %s worker %s failed: %s", pool, address, detail)
        if last is None or time.monotonic() - last.at > self.settings.stale_after_s:
            self._scraped[address] = _Scraped(pool, [], last.at if last else 0.0, up=False)
        else:
            last.up = False

    def render(self, exclude: Iterable[str] = ()) -> bytes:
        return generate_latest(_Merged(self._scraped, set(exclude)))


class _Merged:
    """The families of every worker merged by name, samples labelled by pool and worker (what `generate_latest`
    reads: an object with `collect()`)."""

    def __init__(self, scraped: Mapping[str, _Scraped], exclude: set[str]):
        self._scraped = scraped
        self._exclude = exclude

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for address, scraped in sorted(self._scraped.items()):
            for family in scraped.families:
                if family.name in self._exclude:
                    continue
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                          family.unit)
                target.samples += [Sample(s.name, {**s.labels, "pool": scraped.pool, "worker": address}, s.value,
                                          s.timestamp, s.exemplar) for s in family.samples]
        return list(merged.values())
