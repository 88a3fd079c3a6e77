"""Gateway robustness through a running gateway over the in-process tiny-k3 mesh: a client that disconnects cancels
its request (streaming or not) and releases everything exactly once; integers out of protobuf's range, deep JSON
and lax types are 400s (never a 500); per-request caps refuse oversized requests; docs and metrics need a key when
keys are configured; errors never carry worker addresses."""

from __future__ import annotations

import asyncio

import httpx

from tests.integration.gateway_harness import check_released, checkpoint_fixture, run, running_gateway, wait_idle
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
MSG = [{"role": "user", "content": "x"}]
LONG = {"model": MODEL, "messages": MSG, "max_tokens": 1500, "ignore_eos": True}

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _running(gw) -> float:
    return gw.core.metrics.running.labels("rest")._value.get()


async def _gone_after_chunks(gw, path: str, body: dict, chunks: int) -> None:
    """Streams `body` and closes the connection after `chunks` SSE events."""
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http:
        async with http.stream("POST", path, json=body) as reply:
            assert reply.status_code == 200
            seen = 0
            async for line in reply.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= chunks:
                    break


async def _gone_before_reply(gw, path: str, body: dict) -> None:
    """Sends a non-streaming request and closes the connection before its answer."""
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=0.5) as http:
        try:
            await http.post(path, json=body)
        except httpx.TimeoutException:
            pass


async def _settled(gw, mesh) -> None:
    """Every run closed (gauge 0), the engine idle and its blocks free."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while _running(gw) != 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert _running(gw) == 0
    await wait_idle(mesh.decode_worker.engine, timeout_s=5)
    await check_released(mesh, mesh.decode_worker.engine)


def test_a_disconnect_cancels_the_request_and_releases_it_once(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, tenant_max_concurrency=1) as gw:
            for _ in range(3):
                await _gone_after_chunks(gw, "/v1/chat/completions", {**LONG, "stream": True}, 5)
                await _gone_after_chunks(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1500,
                                                                 "ignore_eos": True, "stream": True}, 5)
                await _gone_before_reply(gw, "/v1/chat/completions", LONG)
            await _settled(gw, mesh)
            # the tenant's concurrency slot came back: a request is admitted, and the gauge never went negative
            reply = await gw.http.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert _running(gw) == 0

    run(main(), timeout_s=120)
