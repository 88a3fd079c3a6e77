"""The decode worker's graceful drain: on stop (what SIGTERM runs) it reports NOT_SERVING, refuses new streams
UNAVAILABLE, finishes the running ones and returns as soon as they end; streams still running after the grace
period end with a clean UNAVAILABLE; a `kdamesh serve --role decode` process drains its stream on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.launcher import free_port
from protos import common_pb2, decode_pb2_grpc
from tests.integration.observability.harness import local_request, read_rest, run, start_decode

ROOT = Path(__file__).resolve().parents[3]


async def _health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return reply.status


async def _expect_not_serving_and_refusal(channel) -> None:
    """Health says NOT_SERVING and a new Decode is refused UNAVAILABLE with a reason."""
    deadline = time.monotonic() + 10
    while await _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health never reported NOT_SERVING"
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("late", 4), timeout=5).read()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()


def test_stopping_decode_finishes_running_streams_and_refuses_new_ones(tiny_k3):
    async def go():
        server, port = await start_decode(tiny_k3, kv_cache_memory=16 << 20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("running", 300), timeout=30)
            first = await call.read()
            stopping = asyncio.create_task(server.stop(30.0))  # what SIGTERM runs
            await _expect_not_serving_and_refusal(channel)
            rest = await read_rest(call)
            started = time.monotonic()
            await stopping
            return [first, *rest], time.monotonic() - started

    chunks, stop_wait = run(go())
    assert sum(len(c.token_ids) for c in chunks) == 300  # the full output
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stop_wait < 5, "stop returned soon after the last stream ended (it did not sit out the grace period)"


def test_streams_still_running_after_the_grace_period_end_with_a_clean_error(tiny_k3):
    async def go():
        server, port = await start_decode(tiny_k3, kv_cache_memory=32 << 20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("long", 3000), timeout=60)
            received = len((await call.read()).token_ids)
            started = time.monotonic()
            stopping = asyncio.create_task(server.stop(0.3))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    received += len(chunk.token_ids)
            await stopping
            return received, ended.value, time.monotonic() - started

    received, error, took = run(go())
    assert 0 < received < 3000
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "grace period" in error.details()
    assert took < 10


def test_sigterm_to_a_decode_process_drains_its_stream(tiny_k3, tmp_path):
    port = free_port()
    stderr_path = tmp_path / "decode.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "--log-format", "json", "serve", "--role",
                                 "decode", "--model", str(tiny_k3), "--address", f"127.0.0.1:{port}",
                                 "--kv-cache-memory", "16MiB", "--max-num-seqs", "4", "--torch-threads", "1",
                                 "--grace-s", "30"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
    try:
        line = proc.stdout.readline()  # printed once the model is loaded
        assert "listening" in line, f"decode did not start: {line!r}\n{stderr_path.read_text()[-3000:]}"

        async def go():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("sigterm", 300), timeout=30)
                chunks = [await call.read()]
                proc.send_signal(signal.SIGTERM)
                await _expect_not_serving_and_refusal(channel)
                chunks += await read_rest(call)
                return chunks

        chunks = run(go(), timeout_s=40)
        assert sum(len(c.token_ids) for c in chunks) == 300
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    json_lines = [json.loads(x) for x in stderr_path.read_text().splitlines() if x.startswith("{")]
    assert json_lines and all(x["service"] == "kdamesh-decode" for x in json_lines)
    assert any(x["logger"] == "kdamesh.rpc" and x["rpc"]["method"] == "Decode" and x["request_id"] == "sigterm"
               for x in json_lines)
