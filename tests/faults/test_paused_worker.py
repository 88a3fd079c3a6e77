"""A paused worker (SIGSTOP: its process and connections stay up, it just says nothing) is not waited on for the
whole request deadline (issue 27 point 4; gateway/stall.py).

Against a real decode worker subprocess (`python -m deploy.cli serve --role decode`, tiny K3) and an in-process
gateway (REST, uvicorn) with `--stall-timeout-s 2` and `--sse-keepalive-s 0.5`:
- a stream whose decode worker is paused mid-generation carries `: keep-alive` comments while it waits, then ends
  with a 503 `worker_stalled` error event and `[DONE]` within the stall deadline of its last output (the request
  deadline is 600 s); a non-streamed request to the paused worker ends the same way, as an HTTP 503;
- resumed (SIGCONT), the worker serves the next request.
Negative control: with a stall deadline longer than the pause, the same stream simply waits and completes once the
worker resumes — the error above is the stall deadline's doing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from engine.model.checkpoint import make_checkpoint
from tests.faults.conftest import free_port
from tests.faults.procs import ServiceProcess
from tests.integration.gateway_harness import running_gateway

pytestmark = pytest.mark.slow
MODEL = "tiny-k3"
STALL_S = 2.0
SLACK_S = 3.0  # a loaded machine: the error may come this much after the deadline


@pytest.fixture(scope="module")
def decode_worker(tmp_path_factory):
    model = make_checkpoint("tiny-k3", tmp_path_factory.mktemp("paused") / MODEL, seed=3)
    port = free_port()
    worker = ServiceProcess("deploy.cli", ["--log-level", "WARNING", "serve", "--role", "decode", "--address",
                                           f"127.0.0.1:{port}", "--model", str(model), "--kv-cache-memory", "8MiB",
                                           "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                                           "--torch-threads", "1", "--grace-s", "0.5"], start_timeout_s=120)
    worker.start()
    try:
        yield model, worker
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


def _body(stream: bool, max_tokens: int = 3000) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "count for a long time"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": stream}


async def _stream_with_pause(gw, worker: ServiceProcess, pause_s: float | None) -> dict:
    """Streams a long generation, pausing the worker after the first output (for `pause_s`, or until the stream
    ends when None). Returns what the stream carried and when."""
    seen = {"keepalives": 0, "error": None, "done": False, "last_data_at": None, "end_at": None, "chunks": 0}
    paused_at = None
    async with gw.http.stream("POST", "/v1/chat/completions", json=_body(True), timeout=60) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            now = time.monotonic()
            if line.startswith(": keep-alive"):
                seen["keepalives"] += 1
            elif line == "data: [DONE]":
                seen["done"], seen["end_at"] = True, now
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
                if "error" in payload:
                    seen["error"] = payload["error"]
                else:
                    seen["chunks"] += 1
                    seen["last_data_at"] = now
            if paused_at is None and seen["chunks"] >= 2:
                os.kill(worker.pid, signal.SIGSTOP)
                paused_at = now
                if pause_s is not None:
                    asyncio.get_running_loop().call_later(pause_s, os.kill, worker.pid, signal.SIGCONT)
    os.kill(worker.pid, signal.SIGCONT)
    return seen


async def _until_served(gw) -> None:
    for _ in range(100):
        response = await gw.http.post("/v1/chat/completions", json=_body(False, 4), timeout=30)
        if response.status_code == 200:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the resumed worker never served: {response.text}")


def test_a_paused_decode_worker_ends_its_requests_within_the_stall_deadline(decode_worker):
    model, worker = decode_worker

    async def body():
        async with running_gateway(None, model, colocated=True, parsers=False, decode_addresses=(worker.address,),
                                   stall_timeout_s=STALL_S, sse_keepalive_s=0.5,
                                   health_check_interval_s=0.5) as gw:
            seen = await _stream_with_pause(gw, worker, None)
            await _until_served(gw)
            os.kill(worker.pid, signal.SIGSTOP)
            start = time.monotonic()
            try:
                whole = await gw.http.post("/v1/chat/completions", json=_body(False, 8), timeout=60)
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            took = time.monotonic() - start
            await _until_served(gw)
            return seen, whole, took

    seen, whole, took = asyncio.run(asyncio.wait_for(body(), 120))
    assert seen["error"] is not None and seen["error"]["code"] == "worker_stalled", seen
    assert "no output for 2.0 s" in seen["error"]["message"], seen["error"]
    assert seen["done"] and seen["keepalives"] >= 1, seen
    assert seen["end_at"] - seen["last_data_at"] < STALL_S + SLACK_S, seen
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "worker_stalled", whole.text
    assert whole.headers["Retry-After"]
    assert took < STALL_S + SLACK_S + 2.0, took  # + the short prompt's expected prefill time and a handshake


def test_negative_control_a_longer_stall_deadline_waits_out_the_pause(decode_worker):
    model, worker = decode_worker

    async def body():
        async with running_gateway(None, model, colocated=True, parsers=False, decode_addresses=(worker.address,),
                                   stall_timeout_s=30.0, sse_keepalive_s=0.5) as gw:
            return await _stream_with_pause(gw, worker, 4.0)

    seen = asyncio.run(asyncio.wait_for(body(), 120))
    assert seen["error"] is None and seen["done"], seen
    assert seen["keepalives"] >= 2, seen  # the pause was felt: keep-alives kept the stream alive meanwhile
