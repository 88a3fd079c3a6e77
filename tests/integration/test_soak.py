"""Soak: 200 concurrent REST streams × 3 rounds through the in-process tiny-k3 mesh, a fifth of the clients going
away at a random point. Every stream that is read to its end ends with `[DONE]` (after its last chunk, or after an
error event), the gateway's running gauge and the engine return to idle after each round, the engine's pools are
intact, and the process's memory stays flat from the first round to the last."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random

import httpx
import pytest

from tests.integration.gateway_harness import check_released, checkpoint_fixture, run, running_gateway, wait_idle
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
STREAMS = 200
ROUNDS = 3
LEAVING = 0.2

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _one(http: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One stream: "done" (ended with [DONE]), "error" (an error event, then [DONE]) or "left" (went away)."""
    leave_after = rng.randrange(0, 4) if rng.random() < LEAVING else None
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"soak {i}"}], "max_tokens": rng.randint(2, 8),
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if leave_after is not None and len(events) > leave_after:
                    return "left"  # leaving the block closes the connection mid-stream
    assert events and events[-1] == "[DONE]", events[-3:]
    return "error" if any("error" in json.loads(e) for e in events[:-1]) else "done"


async def _round(gw, mesh, rng: random.Random) -> dict[str, int]:
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=STREAMS + 10)
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=60, limits=limits) as http:
        outcomes = await asyncio.gather(*(_one(http, rng, i) for i in range(STREAMS)))
    engine = mesh.decode_worker.engine
    for _ in range(200):
        if gw.core.metrics.running.labels("rest")._value.get() == 0:
            break
        await asyncio.sleep(0.05)
    assert gw.core.metrics.running.labels("rest")._value.get() == 0
    assert gw.core.limiter.active("anonymous") == 0
    await wait_idle(mesh.prefill_worker.engine, timeout_s=10)
    await wait_idle(engine, timeout_s=10)
    await check_released(mesh, engine)
    return {kind: outcomes.count(kind) for kind in ("done", "error", "left")}


@pytest.mark.slow
def test_soak_of_streams_with_clients_leaving(tiny_k3):
    async def main():
        rng = random.Random(16)
        async with Mesh(tiny_k3, engine={"max_num_seqs": 64}) as mesh, running_gateway(mesh, tiny_k3) as gw:
            rss = []
            for _ in range(ROUNDS):
                counts = await _round(gw, mesh, rng)
                assert counts["left"] > 0 and counts["done"] > 0, counts
                gc.collect()
                rss.append(_rss_bytes())
            assert abs(rss[-1] - rss[0]) <= 0.05 * rss[0], rss

    run(main(), timeout_s=240)
