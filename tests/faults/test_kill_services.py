"""kill -9 of each mesh service (issue 16 item 7), against real subprocesses (`python -m deploy.cli serve --role
...`, tiny K3 checkpoint, a mesh token) and the gateway's `MeshClient` in this process:

- decode killed mid-stream: the stream ends with a terminal `MeshError` within its deadline; restarted, it serves
  the same tokens as before;
- prefill killed: the request falls back to the decode worker and gets the same tokens; restarted, remote again;
- cache killed mid-stream: the running stream finishes with the same tokens (its handoff was already loaded); new
  requests fall back while it is gone; restarted (empty), remote again.
Afterwards the decode worker's gauges say nothing leaked: no running or waiting request, no KV block owned, no gRPC
call in flight. `ServiceProcess.restart` stands in for a supervisor; a launcher that restarts services can take its
place behind the same calls.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest

from engine.model.checkpoint import make_checkpoint
from gateway.mesh_client import MeshClient, MeshError, MeshRequest, PDDecider
from protos import common_pb2
from telemetry.mesh_auth import MESH_TOKEN_ENV, new_mesh_token
from tests.faults.conftest import free_port
from tests.faults.procs import ServiceProcess

pytestmark = pytest.mark.slow
TOKEN = new_mesh_token()
PROMPT = tuple(range(3, 60))
DEADLINE_S = 15.0  # a killed worker's stream must end within this


def _engine(model: str) -> list[str]:
    return ["--model", str(model), "--kv-cache-memory", "8MiB", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--torch-threads", "1", "--grace-s", "0.5"]


def _service(role: str, args: list[str]) -> ServiceProcess:
    return ServiceProcess("deploy.cli", ["--log-level", "WARNING", "serve", "--role", role, *args],
                          env={MESH_TOKEN_ENV: TOKEN}, start_timeout_s=120)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=3)
    ports = {role: free_port() for role in ("cache", "prefill", "decode", "metrics")}
    cache_address = f"127.0.0.1:{ports['cache']}"
    procs = {
        "cache": _service("cache", ["--address", cache_address, "--shm-dir", str(tmp_path_factory.mktemp("shm")),
                                    "--byte-budget", "64MiB"]),
        "prefill": _service("prefill", ["--address", f"127.0.0.1:{ports['prefill']}", "--cache-address",
                                        cache_address, *_engine(model)]),
        "decode": _service("decode", ["--address", f"127.0.0.1:{ports['decode']}", "--cache-address",
                                      cache_address, "--metrics-port", str(ports["metrics"]), *_engine(model)]),
    }
    try:
        for proc in procs.values():
            proc.start()
        yield procs, ports
    finally:
        for proc in procs.values():
            proc.kill()


async def _generate(client: MeshClient, request_id: str, max_tokens: int, on_event=None) -> tuple[list[int], str]:
    request = MeshRequest(request_id=request_id, prompt_token_ids=PROMPT, timeout_s=60,
                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, route = [], ""
    async for event in client.generate(request):
        tokens.extend(event.token_ids)
        route = event.route or route
        if on_event is not None:
            await on_event(len(tokens))
    return tokens, route


def _client(ports) -> MeshClient:
    return MeshClient([f"127.0.0.1:{ports['decode']}"], [f"127.0.0.1:{ports['prefill']}"],
                      PDDecider(min_uncached_tokens=0), mesh_token=TOKEN)


def _gauges(ports) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)} | {
        m[1] + "{" + m[2] + "}": float(m[3]) for m in re.finditer(r"^(\S+)\{(.*)\} (\S+)$", text, re.M)}


def _assert_decode_idle(ports) -> None:
    for _ in range(50):
        g = _gauges(ports)
        in_flight = sum(v for k, v in g.items() if k.startswith("kdamesh_decode_requests_in_flight"))
        if (g.get("kdamesh_decode_running_requests"), g.get("kdamesh_decode_queue_depth"), in_flight) == (0, 0, 0):
            break
        time.sleep(0.1)
    assert g["kdamesh_decode_running_requests"] == 0 and g["kdamesh_decode_queue_depth"] == 0
    assert in_flight == 0, "a gRPC call is still in flight"
    assert g["kdamesh_decode_kv_block_usage_ratio"] == 0, "a request kept KV blocks"


def test_kill_each_service(mesh):
    procs, ports = mesh

    async def body():
        client = _client(ports)
        try:
            reference, route = await _generate(client, "reference", 24)
            assert route == "remote" and len(reference) == 24
            await _kill_decode_mid_stream(client, procs["decode"])
            assert await _generate(client, "after-decode", 24) == (reference, "remote")
            procs["prefill"].kill()
            assert await _generate(client, "no-prefill", 24) == (reference, "fallback")
            await asyncio.to_thread(procs["prefill"].restart)
            await _until_remote(client, "after-prefill", reference)
            await _kill_cache_mid_stream(client, procs["cache"], reference)
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(body(), 400))
    _assert_decode_idle(ports)


async def _kill_decode_mid_stream(client: MeshClient, decode: ServiceProcess) -> None:
    async def kill_after_first_tokens(count: int) -> None:
        if count and decode.proc.poll() is None:
            await asyncio.to_thread(decode.kill)

    t0 = time.monotonic()
    with pytest.raises(MeshError):
        await _generate(client, "decode-killed", 4000, kill_after_first_tokens)
    assert time.monotonic() - t0 < DEADLINE_S
    await asyncio.to_thread(decode.start)
    await client.check_health()


async def _kill_cache_mid_stream(client: MeshClient, cache: ServiceProcess, reference: list[int]) -> None:
    async def kill_after_first_tokens(count: int) -> None:
        if count and cache.proc.poll() is None:
            await asyncio.to_thread(cache.kill)

    tokens, route = await _generate(client, "cache-killed", 24, kill_after_first_tokens)
    assert (tokens, route) == (reference, "remote")  # the stream did not need the cache any more
    assert await _generate(client, "no-cache", 24) == (reference, "fallback")
    await asyncio.to_thread(cache.restart)
    await _until_remote(client, "after-cache", reference)


async def _until_remote(client: MeshClient, request_id: str, reference: list[int], within_s: float = 8.0) -> None:
    """Requests (each with the reference tokens) until one goes remote again: the workers' cache channels reconnect
    within their capped backoff (2 s) and their data plane is rediscovered."""
    t0 = time.monotonic()
    while True:
        tokens, route = await _generate(client, request_id, 24)
        assert tokens == reference
        if route == "remote":
            return
        assert time.monotonic() - t0 < within_s, "the mesh did not use the restarted service again"
        await asyncio.sleep(0.2)
