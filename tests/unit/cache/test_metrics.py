"""Metrics live in the registry they are given and follow the store."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.memory_store import MemoryStore
from cache_service.metrics import CacheMetrics, StoreCollector
from cache_service.objects import Checksum, Status
from cache_service.store import PutItem, StoreUnavailableError


def samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_store_series_follow_the_store():
    store = MemoryStore(1000)
    metrics = CacheMetrics()
    metrics.watch(store)
    store.put_many([PutItem(b"a", b"x" * 10, Checksum.of(b"x" * 10))])
    store.get_many([b"a", b"b"])
    metrics.transfer("get", 10, 0.5)
    metrics.key_results("BatchGet", [Status.FOUND, Status.MISSING, Status.MISSING])
    got = samples(metrics.registry)
    assert got["kdamesh_cache_objects[]"] == 1 and got["kdamesh_cache_stored_bytes[]"] == 10
    assert got["kdamesh_cache_hits_total[]"] == 1 and got["kdamesh_cache_misses_total[]"] == 1
    assert got["kdamesh_cache_backend_up[('backend', 'memory')]"] == 1
    assert got["kdamesh_cache_transfer_bytes_total[('direction', 'get')]"] == 10
    assert got["kdamesh_cache_keys_total[('method', 'BatchGet'), ('status', 'MISSING')]"] == 2


def test_registries_are_not_shared():
    a, b = CacheMetrics(), CacheMetrics()
    a.transfer("put", 5, 0.1)
    assert a.registry is not b.registry
    assert "kdamesh_cache_transfer_bytes_total[('direction', 'put')]" not in samples(b.registry)


def test_an_unreachable_store_reports_backend_down():
    class DownStore(MemoryStore):
        def stats(self):
            raise StoreUnavailableError("down")

    registry = CollectorRegistry()
    registry.register(StoreCollector(DownStore(10)))
    assert samples(registry) == {"kdamesh_cache_backend_up[('backend', 'memory')]": 0}
