"""Prometheus metrics of the cache service, in a registry the caller owns (a fresh `CollectorRegistry` by default).

Series (all prefixed `kdamesh_cache_`):
- from the store, read at scrape time: `objects`, `stored_bytes`, `capacity_bytes`, `leased_objects`,
  `active_leases` (gauges); `hits_total`, `misses_total`, `corrupt_reads_total`, `evictions_total`,
  `expirations_total`, `puts_total`, `removes_total`, `errors_total` (counters); `backend_up` (1 when the store
  answered the scrape, else 0 and the store series are absent).
- from the servicer: `transfer_bytes_total{direction="put"|"get"}` (payload bytes through BatchPut / BatchGet, and
  through the shared-memory plane: committed, located), `transfer_seconds_total{direction}` (wall time of the calls
  that moved them; the shm plane's client-side copies are not in it; the direct Redis plane is in neither),
  `keys_total{method, status}` (per-key results), `rpc_seconds{method}` (histogram of every handler's latency).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_service.objects import Status
from cache_service.store import Store, StoreUnavailableError

PREFIX = "kdamesh_cache"
_GAUGES = ("objects", "stored_bytes", "capacity_bytes", "leased_objects", "active_leases")
_COUNTERS = ("hits", "misses", "corrupt_reads", "evictions", "expirations", "puts", "removes", "errors")
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector(Collector):
    """Exposes a store's `stats()` at scrape time."""

    def __init__(self, store: Store):
        self._store = store

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_backend_up", "1 when the store answered this scrape", labels=["backend"])
        try:
            stats = self._store.stats()
        except StoreUnavailableError:
            up.add_metric([self._store.backend], 0)
            yield up
            return
        up.add_metric([stats.backend], 1)
        yield up
        for name in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", f"Cache store {name.replace('_', ' ')}",
                                    value=getattr(stats, name))
        for name in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", f"Cache store {name.replace('_', ' ')}",
                                      value=getattr(stats.counters, name))


class CacheMetrics:
    """The servicer's metrics. `watch(store)` adds the store's series to the same registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.transfer_bytes = Counter(f"{PREFIX}_transfer_bytes", "Payload bytes moved through the cache service",
                                      ["direction"], registry=self.registry)
        self.transfer_seconds = Counter(f"{PREFIX}_transfer_seconds", "Wall time of the streams moving payloads",
                                        ["direction"], registry=self.registry)
        self.keys = Counter(f"{PREFIX}_keys", "Per-key results of cache calls", ["method", "status"],
                            registry=self.registry)
        self.rpc_seconds = Histogram(f"{PREFIX}_rpc_seconds", "Cache service handler latency", ["method"],
                                     buckets=_RPC_BUCKETS, registry=self.registry)

    def watch(self, store: Store) -> None:
        self.registry.register(StoreCollector(store))

    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction).inc(nbytes)
        self.transfer_seconds.labels(direction).inc(seconds)

    def key_results(self, method: str, statuses: list[Status]) -> None:
        for status in set(statuses):
            self.keys.labels(method, status.name).inc(statuses.count(status))
