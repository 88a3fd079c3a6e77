"""gateway/worker_pool.py: the pool's context length is the smallest its current, healthy members reported; a worker
that turns unhealthy or leaves is forgotten (it may come back another engine) and asked again when it returns."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from gateway.worker_pool import WorkerPool
from protos import worker_pb2

DECODE, PREFILL, NEW = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


class _Info:
    def __init__(self, limit: int | None):
        self.limit, self.calls = limit, 0

    async def Info(self, request, timeout=None):  # noqa: N802 (the gRPC method name)
        self.calls += 1
        if self.limit is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "loading")
        return worker_pb2.WorkerInfo(role="decode", max_model_len=self.limit, block_size=16, tensor_parallel_size=1)


class _Health:
    def __init__(self):
        self.serving = True

    async def Check(self, request, timeout=None):  # noqa: N802
        status = health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


def _fake(pool: WorkerPool, address: str, limit: int | None) -> tuple[_Info, _Health]:
    worker = {**pool.decoders, **pool.prefillers}[address]
    worker.info, worker.health = _Info(limit), _Health()
    return worker.info, worker.health


def test_the_smallest_reported_limit_of_the_current_healthy_members():
    async def run():
        pool = WorkerPool([DECODE], [PREFILL])
        assert pool.max_model_len() is None  # nobody asked yet: unknown, not guessed
        decode_info, decode_health = _fake(pool, DECODE, 5000)
        prefill_info, _ = _fake(pool, PREFILL, None)  # still loading
        await pool.refresh_info()
        assert pool.max_model_len() == 5000
        prefill_info.limit = 4000
        await pool.check_health()  # the next round asks the one that did not answer
        assert pool.max_model_len() == 4000 and decode_info.calls == 1  # a known worker is not asked again
        decode_health.serving = False
        decode_info.limit = 3000  # restarted with another engine
        await pool.check_health()
        assert pool.max_model_len() == 4000 and DECODE not in pool.info  # forgotten while unhealthy
        decode_health.serving = True
        await pool.check_health()
        assert pool.max_model_len() == 3000  # asked again when it came back
        await pool.set_worker_addresses("prefill", [PREFILL, NEW])
        assert NEW in pool.prefillers
        await pool.set_worker_addresses("prefill", [NEW])
        assert PREFILL not in pool.info and pool.max_model_len() == 3000  # the leaver is forgotten
        await pool.close()
    asyncio.run(run())
