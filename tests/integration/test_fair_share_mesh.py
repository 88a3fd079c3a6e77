"""Fair share of a worker's running slots through the in-process mesh: a colocated decode worker (16 slots, tiny-k3
on CPU) behind the gateway, whose API keys name the tenants (official openai client).

Tenant A fills every slot with long requests; tenant B's short requests, sent through the gateway while they run,
are admitted at once (the worker preempts A's newest request to give B its share) and finish far sooner than the
same request under A's key (the negative control, which waits for one of A's slots); A's outputs equal those of the
same flood without B (greedy), the lone flood filled the whole batch, and the worker's /metrics show each tenant's
running and waiting requests under the tenant's configured name, with the weight B's key entry sets. The 64-slot
flood with the issue's time bounds runs with every service in its own process: tests/e2e/test_fair_share_launched.py.

A's flood goes through the gateway's `MeshClient` with the `TenantShare` the gateway sends for key-a, not through
REST: in this one-process harness the gateway's handling of the flood's token streams shares the event loop and the
GIL with the worker and the test (with 64 streams it alone held a new request for ~14 engine steps on a loaded
2-core box); the claim under test is the worker's scheduling.
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
SLOTS = 16
FLOOD_TOKENS = 96
SHORT_TOKENS = 8
SHORT_PROMPT = "Name three lighthouses."
ENGINE = dict(max_num_seqs=SLOTS, kv_cache_memory=32 << 20, max_num_batched_tokens=512)

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": "tenant-a", "key-b": {"tenant": "tenant-b", "weight": 2}}))
    return str(path)


_CLIENTS: dict[tuple[str, str], openai.AsyncOpenAI] = {}


def _client(gw, key: str) -> openai.AsyncOpenAI:
    """One client per gateway and key, closed at the test's end (tests/e2e/test_fair_share_launched.py: clients left
    to the garbage collector left responses unread)."""
    if (gw.openai_base_url, key) not in _CLIENTS:
        _CLIENTS[gw.openai_base_url, key] = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key,
                                                               max_retries=0, timeout=120)
    return _CLIENTS[gw.openai_base_url, key]


async def _close_clients() -> None:
    while _CLIENTS:
        await _CLIENTS.popitem()[1].close()


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
    """Tenant A's SLOTS requests; once all of them run, `await during(their tasks)` (None: nothing) -> (A's
    outputs, what `during` returned, the most requests that ran at once)."""
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
        result = await during(flood) if during is not None else None
        assert during is None or not all(t.done() for t in flood), "the flood ended before the checks did"
        return await asyncio.gather(*flood), result, widest
    finally:
        await client.close()


async def _held(gw, flood: list[asyncio.Task]) -> tuple[float, bool]:
    """The short request under A's key -> (its seconds, whether one of A's flood requests had ended before it)."""
    seconds = await _short(gw, "key-a")
    return seconds, any(t.done() for t in flood)


async def _watched(mesh, coro) -> tuple[float, dict]:
    """Runs `coro` (a short request) -> (its seconds, the worker's /metrics text and tenant B's engine weight the
    first time the gauges showed tenant B running)."""
    task, seen = asyncio.create_task(coro), {}
    while not task.done():
        text = generate_latest(mesh.decode_server.metrics.registry).decode()
        if not seen and 'tenant_running_requests{tenant="tenant-b"} 1.0' in text:
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

            async def during(flood):
                first = await _watched(mesh, _short(gw, "key-b"))
                held = asyncio.create_task(_held(gw, flood))  # negative control: the same request as tenant A
                fair = [first[0]] + [await _short(gw, "key-b") for _ in range(2)]
                assert not any(t.done() for t in flood), "B waited for one of A's requests to end"
                return fair, first[1], held
            flooded, (fair, seen, held), _ = await _flood(mesh, during)
            held, a_ended_first = await held
            assert a_ended_first, "as tenant A the request took none of A's slots: the control cannot fail"
            idle += [await _short(gw, "key-b") for _ in range(3)]
            assert held > 2 * statistics.median(fair), (held, fair, idle)
            assert flooded == alone  # A's preempted requests continued with exactly the same output
            stats = await mesh.decode_server.engine.stats()
            assert stats.num_fair_preemptions >= 1
            gauges = seen["gauges"]
            assert _gauge(gauges, "tenant_running_requests", "tenant-b") == 1
            assert _gauge(gauges, "tenant_running_requests", "tenant-a") == SLOTS - 1
            assert _gauge(gauges, "tenant_waiting_requests", "tenant-a") == 1
            assert "key-a" not in gauges and "key-b" not in gauges
            assert seen["weight"] == 2.0  # the key entry's weight travelled gateway -> worker -> engine
            print(f"fair-share mesh: B idle {sorted(idle)}, B during the flood {fair}, as tenant A {held:.2f}s")

    async def closing():
        try:
            await main()
        finally:
            await _close_clients()
    run(closing(), timeout_s=300)
