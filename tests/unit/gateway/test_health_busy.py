"""gateway/worker_pool.py health over real gRPC health servers: busy is not dead.

- A connected worker whose health answer comes after the check's deadline is busy: it stays in the pool (no
  transition, `busy` counts it) — and with `busy_grace_s` 0 the same late answer drops it (negative control); a
  worker late for longer than `busy_grace_s` since it last answered SERVING leaves the pool, and comes back on its
  next SERVING answer.
- NOT_SERVING, a stopped server and an address nobody listens on drop the worker at the first check.
- `health_verdict` as a table.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.routing import RouterConfig
from gateway.worker_pool import LATE, NOT_SERVING, SERVING, UNREACHABLE, WorkerPool, health_verdict


def run_bounded(coro, timeout_s: float):
    async def bounded():
        async with asyncio.timeout(timeout_s):  # nothing may hang
            return await coro
    return asyncio.run(bounded())


class SlowHealth(health.aio.HealthServicer):
    """The standard health servicer, answering after `delay` seconds."""

    def __init__(self):
        super().__init__()
        self.delay = 0.0

    async def Check(self, request, context):  # noqa: N802 (the gRPC method name)
        await asyncio.sleep(self.delay)
        return await super().Check(request, context)


async def _server() -> tuple[grpc.aio.Server, SlowHealth, str]:
    server = grpc.aio.server()
    servicer = SlowHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _pool(address: str, grace: float, changes: list) -> WorkerPool:
    pool = WorkerPool([address], router_config=RouterConfig(busy_grace_s=grace),
                      on_health_change=lambda a, ok: changes.append(ok))
    assert await pool.check_health(timeout_s=2.0) == {address: True}
    return pool


def test_a_late_answer_is_busy_not_dead():
    async def main():
        server, servicer, address = await _server()
        changes, strict_changes = [], []
        pool, strict = await _pool(address, 30.0, changes), await _pool(address, 0.0, strict_changes)
        servicer.delay = 1.0
        assert await pool.check_health(timeout_s=0.2) == {address: True}
        assert pool.decode_router.is_healthy(address) and pool.busy[address] == 1 and changes == []
        await asyncio.sleep(0.05)
        assert await strict.check_health(timeout_s=0.2) == {address: False}  # negative control: no grace
        assert strict_changes == [False] and not strict.decode_router.is_healthy(address)
        for p in (pool, strict):
            await p.close()
        await server.stop(0)

    run_bounded(main(), 30)


def test_late_past_the_grace_leaves_and_serving_returns():
    async def main():
        server, servicer, address = await _server()
        changes = []
        pool = await _pool(address, 0.5, changes)
        servicer.delay = 1.0
        assert (await pool.check_health(timeout_s=0.2))[address] is True  # 0.2 s since SERVING: busy
        await asyncio.sleep(0.5)
        assert (await pool.check_health(timeout_s=0.2))[address] is False  # 0.9 s: past the grace
        servicer.delay = 0.0
        await asyncio.sleep(1.0)  # the late handlers finish
        assert (await pool.check_health(timeout_s=2.0))[address] is True
        assert changes == [False, True]
        await pool.close()
        await server.stop(0)

    run_bounded(main(), 30)


def test_not_serving_stopped_and_absent_workers_leave_at_once():
    async def main():
        server, servicer, address = await _server()
        absent = f"127.0.0.1:{_free_port()}"
        changes = []
        pool = WorkerPool([address, absent], router_config=RouterConfig(busy_grace_s=30.0),
                          on_health_change=lambda a, ok: changes.append((a, ok)))
        assert await pool.check_health(timeout_s=1.0) == {address: True, absent: False}
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await pool.check_health(timeout_s=1.0))[address] is False
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert (await pool.check_health(timeout_s=1.0))[address] is True
        await server.stop(0)
        assert (await pool.check_health(timeout_s=1.0))[address] is False  # stopped: dead, though 30 s of grace
        assert changes == [(absent, False), (address, False), (address, True), (address, False)]
        await pool.close()

    run_bounded(main(), 30)


def test_health_verdict_table():
    assert health_verdict(SERVING, False, 100.0, 0.0)
    assert health_verdict(LATE, True, 5.0, 10.0) and not health_verdict(LATE, True, 11.0, 10.0)
    assert not health_verdict(LATE, False, 0.0, 10.0)  # an unhealthy worker comes back only by answering
    assert not health_verdict(NOT_SERVING, True, 0.0, 10.0) and not health_verdict(UNREACHABLE, True, 0.0, 10.0)
