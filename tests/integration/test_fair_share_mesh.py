"""Fair share of a worker's running slots through the running mesh (issue 27): a colocated decode worker with 64
slots (tiny-k3 on CPU) behind the gateway, whose API keys name the tenants (official openai client).

Tenant A fills all 64 slots with long requests; tenant B's short requests, sent through the gateway while they run,
finish within 2 s and within 5x their time on the idle mesh, because the worker preempts A's newest request to give
B its share; A's outputs equal those of the same flood without B (greedy), the lone flood filled the whole batch,
and the worker's /metrics show each tenant's running and waiting requests under the tenant's configured name (the
weight B's key entry sets reaches the engine). The negative control sends the same short request under A's key: it
waits for one of A's slots, far longer.

A's flood goes through the gateway's `MeshClient` with the `TenantShare` the gateway sends for key-a, not through
REST: in this one-process harness the gateway's handling of 64 token streams shares the event loop and the GIL with
the worker and the test, and it alone held a new request for ~14 engine steps on a loaded 2-core box — the claim
under test is the worker's scheduling, which a gateway process of its own does not slow down.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from contextlib import aclosing

import openai
import pytest
from prometheus_client import generate_latest

from gateway.mesh_client import MeshClient, MeshRequest
from protos import common_pb2
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import VOCAB, Mesh, greedy

MODEL = "tiny-k3"
SLOTS = 64
FLOOD_TOKENS = 128
SHORT_TOKENS = 8
SHORT_PROMPT = "Name three lighthouses."
ENGINE = dict(max_num_seqs=SLOTS, kv_cache_memory=96 << 20, max_num_batched_tokens=1024)

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": "tenant-a", "key-b": {"tenant": "tenant-b", "weight": 2}}))
    return str(path)


def _client(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=120)


async def _short(gw, key: str) -> float:
    """One short chat completion under `key` -> its seconds."""
    start = time.monotonic()
    reply = await _client(gw, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=SHORT_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == SHORT_TOKENS
    return time.monotonic() - start


async def _flood_one(client: MeshClient, i: int, prompt: list[int]) -> list[int]:
    request = MeshRequest(request_id=f"flood-{i}-{random.getrandbits(32):x}", prompt_token_ids=tuple(prompt),
                          sampling=greedy(FLOOD_TOKENS), tenant=common_pb2.TenantShare(name="tenant-a"),
                          timeout_s=240)
    tokens = []
    async with aclosing(client.generate(request)) as events:
        async for event in events:
            tokens += event.token_ids
    assert len(tokens) == FLOOD_TOKENS
    return tokens


async def _flood(mesh, during=None):
    """Tenant A's 64 requests; once all of them run, `await during()` (None: nothing) -> (A's outputs, what
    `during` returned, the most requests that ran at once)."""
    engine = mesh.decode_server.engine
    rng = random.Random(5)
    client = MeshClient([mesh.decode_address])
    try:
        flood = [asyncio.create_task(_flood_one(client, i, [rng.randrange(VOCAB) for _ in range(12)]))
                 for i in range(SLOTS)]
        widest = 0
        while widest < SLOTS:
            assert not any(t.done() for t in flood), "the flood ended before it filled the batch"
            widest = max(widest, engine.stats_snapshot().num_running)
            await asyncio.sleep(0.01)
        result = await during() if during is not None else None
        assert during is None or not all(t.done() for t in flood), "the flood ended before the checks did"
        return await asyncio.gather(*flood), result, widest
    finally:
        await client.close()


async def _watched(mesh, coro) -> tuple[float, dict]:
    """Runs `coro` (a short request) -> (its seconds, the worker's /metrics text and tenant B's engine weight the
    first time the gauges showed tenant B running)."""
    task, seen = asyncio.create_task(coro), {}
    while not task.done():
        text = generate_latest(mesh.decode_server.metrics.registry).decode()
        if not seen and 'tenant_running_requests{tenant="tenant-b"}' in text:
            seen = {"gauges": text, "weight": mesh.decode_server.engine.core.scheduler.fair.weights.get("tenant-b")}
        await asyncio.sleep(0.02)
    return await task, seen


def _gauge(text: str, name: str, tenant: str) -> float:
    prefix = f'kdamesh_decode_{name}{{tenant="{tenant}"}} '
    return next(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def test_a_flooding_tenant_cannot_hold_another_tenants_short_request(tiny_k3, keys_file):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False, engine=ENGINE) as mesh, \
                running_gateway(mesh, tiny_k3, api_keys_file=keys_file, colocated=True) as gw:
            await _short(gw, "key-b")  # warm-up
            idle = [await _short(gw, "key-b") for _ in range(3)]
            alone, _, widest = await _flood(mesh)
            assert widest == SLOTS  # a lone tenant gets the whole engine

            async def during():
                first = await _watched(mesh, _short(gw, "key-b"))
                fair = [first[0]] + [await _short(gw, "key-b") for _ in range(2)]
                held = await _short(gw, "key-a")  # negative control: the same request as tenant A
                return fair, first[1], held
            flooded, (fair, seen, held), _ = await _flood(mesh, during)
            idle += [await _short(gw, "key-b") for _ in range(3)]
            fair_s, idle_s = statistics.median(fair), min(idle)
            assert fair_s < 2.0 and fair_s < 5 * idle_s, (fair, idle)
            assert held > 5 * idle_s and held > 3 * fair_s, (held, fair, idle)
            assert flooded == alone  # A's preempted requests continued with exactly the same output
            stats = await mesh.decode_server.engine.stats()
            assert stats.num_fair_preemptions >= 1
            gauges = seen["gauges"]
            assert _gauge(gauges, "tenant_running_requests", "tenant-b") == 1
            assert _gauge(gauges, "tenant_running_requests", "tenant-a") == SLOTS - 1
            assert _gauge(gauges, "tenant_waiting_requests", "tenant-a") == 1
            assert "key-a" not in gauges and "key-b" not in gauges
            assert seen["weight"] == 2.0  # the key entry's weight travelled gateway -> worker -> engine
            print(f"fair-share mesh: B idle {min(idle):.3f}s, B during the flood {fair}, as tenant A {held:.2f}s")
    run(main(), timeout_s=300)
