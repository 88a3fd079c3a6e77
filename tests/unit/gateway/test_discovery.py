"""Service discovery (gateway/discovery.py) with fake resolvers: a headless Service's every address reaches the
pool, a changed set replaces it, failures and empty answers keep the last set (decode) or empty it (prefill), a
failed worker wakes the watcher at once, start-up waits with a deadline, and stop cancels the tasks."""

import asyncio

import pytest

from gateway.config import GatewayConfig
from gateway.discovery import (Discovery, DiscoverySettings, DnsTarget, PoolWatcher, ResolveError, pool_target,
                               system_resolver)

FAST = DiscoverySettings(refresh_s=0.05, min_refresh_s=0.01, resolve_timeout_s=0.2, startup_timeout_s=0.5,
                         stop_timeout_s=1.0)
DECODE = "dns:///kdamesh-decode-headless:50054"
PREFILL = "dns:///kdamesh-prefill-headless:50052"


def run(coro, timeout_s: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class FakeDns:
    """Answers per name from `records` (a list: the answer, or an exception to raise); counts the questions."""

    def __init__(self, **records):
        self.records = {name.replace("_", "-"): answer for name, answer in records.items()}
        self.asked = 0

    async def __call__(self, host: str, port: int):
        self.asked += 1
        answer = self.records[host]
        if isinstance(answer, Exception):
            raise answer
        if answer == "hang":
            await asyncio.sleep(60)
        return [f"{ip}:{port}" for ip in answer]


class RecordingMesh:
    def __init__(self):
        self.sets: list[tuple[str, tuple[str, ...]]] = []

    async def set_worker_addresses(self, role, addresses):
        self.sets.append((role, tuple(addresses)))
        return (), ()


def config(**overrides) -> GatewayConfig:
    return GatewayConfig(model="/m", decode_addresses=(DECODE,), prefill_addresses=(PREFILL,), **overrides)


async def wait_for(predicate, timeout_s: float = 3.0):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_pool_flags_are_a_static_list_or_one_dns_target():
    assert pool_target(("a:1", "b:2"), "--decode-workers") is None
    assert pool_target((DECODE,), "--decode-workers") == DnsTarget("kdamesh-decode-headless", 50054)
    assert pool_target(("dns:svc.ns.svc.cluster.local:7",), "--x") == DnsTarget("svc.ns.svc.cluster.local", 7)
    for bad in ((DECODE, "a:1"), ("dns:///svc",), ("dns:///svc:0",), ("dns://authority/svc:1",)):
        with pytest.raises(ValueError, match="--decode-workers"):
            pool_target(bad, "--decode-workers")
    with pytest.raises(ValueError, match="only entry"):
        GatewayConfig(model="/m", decode_addresses=(DECODE, "a:1"), prefill_addresses=("p:1",))
    with pytest.raises(ValueError, match="positive"):
        config(discovery_refresh_s=0)


def test_the_system_resolver_returns_every_address_with_the_port():
    addresses = run(system_resolver("localhost", 50054))
    assert "127.0.0.1:50054" in addresses and addresses == tuple(sorted(set(addresses)))


def test_startup_takes_every_address_of_each_headless_service():
    dns = FakeDns(kdamesh_decode_headless=["10.0.0.3", "10.0.0.1", "10.0.0.2", "10.0.0.1"],
                  kdamesh_prefill_headless=["10.0.1.1", "fd00::7"])
    resolved = run(Discovery(config(), dns, FAST).resolve_config())
    assert resolved.decode_addresses == ("10.0.0.1:50054", "10.0.0.2:50054", "10.0.0.3:50054")
    assert resolved.prefill_addresses == ("10.0.1.1:50052", "fd00::7:50052")  # a fake answers as given
    static = GatewayConfig(model="/m", decode_addresses=("a:1",), mode="colocated")
    assert not Discovery(static, dns, FAST).active and run(Discovery(static, dns, FAST).resolve_config()) is static


def test_startup_waits_for_a_first_address_then_fails_naming_the_target():
    dns = FakeDns(kdamesh_decode_headless=[], kdamesh_prefill_headless=["10.0.1.1"])

    async def late_pods():
        discovery = Discovery(config(), dns, FAST)
        waiting = asyncio.create_task(discovery.resolve_config())
        await asyncio.sleep(0.1)
        dns.records["kdamesh-decode-headless"] = ["10.0.0.9"]
        return await waiting

    assert run(late_pods()).decode_addresses == ("10.0.0.9:50054",)
    dns.records["kdamesh-decode-headless"] = []
    with pytest.raises(RuntimeError, match="kdamesh-decode-headless:50054 resolved to no worker"):
        run(Discovery(config(), dns, FAST).resolve_config())


def test_a_changed_address_set_replaces_the_pool_and_an_unchanged_one_is_not_reapplied():
    dns = FakeDns(kdamesh_decode_headless=["10.0.0.1", "10.0.0.2"], kdamesh_prefill_headless=["10.0.1.1"])

    async def body():
        discovery, mesh = Discovery(config(), dns, FAST), RecordingMesh()
        await discovery.resolve_config()
        discovery.start(mesh)
        await asyncio.sleep(0.2)  # several refreshes, nothing changed
        assert mesh.sets == []
        dns.records["kdamesh-decode-headless"] = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]  # a scale-up and a restart
        await wait_for(lambda: mesh.sets)
        assert mesh.sets == [("decode", ("10.0.0.2:50054", "10.0.0.3:50054", "10.0.0.4:50054"))]
        dns.records["kdamesh-prefill-headless"] = []  # every prefill pod gone: the colocated path
        await wait_for(lambda: len(mesh.sets) == 2)
        assert mesh.sets[1] == ("prefill", ())
        await discovery.stop()
        assert all(t.done() for t in discovery._tasks) and discovery._tasks == []

    run(body())


def test_failures_and_an_empty_decode_answer_keep_the_last_set():
    dns = FakeDns(kdamesh_decode_headless=["10.0.0.1"])
    watcher = PoolWatcher("decode", DnsTarget("kdamesh-decode-headless", 1), dns, FAST)
    watcher.addresses = ("10.0.0.1:1",)
    for answer in (ResolveError("SERVFAIL"), OSError("network down"), "hang", []):
        dns.records["kdamesh-decode-headless"] = answer
        assert run(watcher.resolve()) is None and watcher.addresses == ("10.0.0.1:1",)
        assert watcher.last_error
    dns.records["kdamesh-decode-headless"] = ["10.0.0.5"]
    assert run(watcher.resolve()) == ("10.0.0.5:1",)


def test_a_failed_worker_wakes_its_pools_watcher_at_once():
    dns = FakeDns(kdamesh_decode_headless=["10.0.0.1", "10.0.0.2"], kdamesh_prefill_headless=["10.0.1.1"])
    slow = DiscoverySettings(refresh_s=30.0, min_refresh_s=0.01, resolve_timeout_s=0.2, startup_timeout_s=0.5)

    async def body():
        discovery, mesh = Discovery(config(), dns, slow), RecordingMesh()
        await discovery.resolve_config()
        discovery.start(mesh)
        dns.records["kdamesh-decode-headless"] = ["10.0.0.2", "10.0.0.7"]  # 10.0.0.1 was rescheduled
        discovery.notify_failure("10.0.9.9:50054")  # not a pod of any pool: nothing to do
        await asyncio.sleep(0.1)
        assert mesh.sets == []
        discovery.notify_failure("10.0.0.1:50054")  # its health check failed: re-resolve now, not in 30 s
        await wait_for(lambda: mesh.sets)
        assert mesh.sets == [("decode", ("10.0.0.2:50054", "10.0.0.7:50054"))]
        await discovery.stop()

    run(body())


def test_a_failed_apply_is_retried_on_the_next_round():
    dns = FakeDns(kdamesh_decode_headless=["10.0.0.1"], kdamesh_prefill_headless=["10.0.1.1"])

    class FlakyMesh(RecordingMesh):
        async def set_worker_addresses(self, role, addresses):
            if not self.sets:
                self.sets.append(("failed", ()))
                raise ValueError("the decode pool needs at least one worker address")
            return await super().set_worker_addresses(role, addresses)

    async def body():
        discovery, mesh = Discovery(config(mode="disaggregated"), dns, FAST), FlakyMesh()
        await discovery.resolve_config()
        dns.records["kdamesh-decode-headless"] = ["10.0.0.2"]
        discovery.start(mesh)
        await wait_for(lambda: len(mesh.sets) == 2)
        assert mesh.sets == [("failed", ()), ("decode", ("10.0.0.2:50054",))]
        await discovery.stop()

    run(body())
