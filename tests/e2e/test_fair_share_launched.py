"""End to end, issue 27: `kdamesh up --mode colocated` (gateway, decode worker with 64 slots and the cache service
as their own processes; tiny-k3 on CPU) with an `--api-keys-file` naming two tenants, driven by the official
`openai` client.

Tenant A sends 64 long chats (max_tokens 512, ignore_eos: inside its default limit of 256 in flight) and fills
every engine slot; tenant B's short chats (8 tokens), sent one after another while they run, finish within 2 s and
within 5x their time on the idle mesh (the medians of IDLE_SHORTS chats right before the flood and FAIR_SHORTS
during it), because the decode worker preempts A's newest request to give B its share in a step of its own
(recompute: A's outputs equal those of the same flood without B). Measured on a shared 2-core box at load 2-4:
2.1-3.0x (docs/benchmarks.md, "Fair share of the running slots"). A lone A fills all 64 slots. The decode worker's
/metrics show each tenant's running and waiting requests and weight under the tenant's configured name, never a
key. Negative control: the same short chat under A's key waits for one of A's slots (one of A's chats ends first),
far longer.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest

from tests.e2e.launched import launch, stop

SLOTS = 64
FLOOD_TOKENS = 512
SHORT_TOKENS = 8
IDLE_SHORTS = FAIR_SHORTS = 5
WATCHED_TOKENS = 64  # B's chat whose gauges are read: long enough for a few scrapes of the busy worker
MODEL = "tiny-k3"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-fair")
    keys = root / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": {"tenant": "tenant-b", "weight": 2}}))
    launched = launch(root, "metrics ", up_flags=["--mode", "colocated", "--max-num-seqs", str(SLOTS),
                                                  "--kv-cache-memory", "96MiB", "--api-keys-file", str(keys)])
    yield {"port": launched.port, "metrics": json.loads(launched.line)}
    stop(launched.proc)


def _client(mesh, key: str) -> openai.AsyncOpenAI:
    """The test's one client of `key`, closed when the test ends (`_close_clients`). One client per chat, left to
    the garbage collector, left up to 54 of the flood's 64 responses unread in their sockets until the client's
    timeout once a 512-token flood ran long enough for collections to happen meanwhile."""
    clients = mesh.setdefault("clients", {})
    if key not in clients:
        clients[key] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh['port']}/v1", api_key=key,
                                          max_retries=0, timeout=180)
    return clients[key]


async def _close_clients(mesh) -> None:
    for client in mesh.pop("clients", {}).values():
        await client.close()


async def _chat(client: openai.AsyncOpenAI, text: str, max_tokens: int) -> dict:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                 max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == max_tokens
    return reply.choices[0].message.model_dump()  # content, reasoning, tool calls: everything the tokens gave


async def _short(mesh, key: str) -> float:
    start = time.monotonic()
    await _chat(_client(mesh, key), "Name three lighthouses.", SHORT_TOKENS)
    return time.monotonic() - start


async def _held(mesh, flood: list[asyncio.Task]) -> tuple[float, bool]:
    """The short chat under A's key -> (its seconds, whether one of A's flood chats had ended before it)."""
    seconds = await _short(mesh, "key-a")
    return seconds, any(t.done() for t in flood)


async def _scrape(http: httpx.AsyncClient, url: str) -> dict[tuple[str, str], float]:
    """The decode worker's per-tenant series: (series, tenant) -> value."""
    series = {}
    for line in (await http.get(url)).text.splitlines():
        if line.startswith("kdamesh_decode_tenant_"):
            name, _, value = line.rpartition(" ")
            series[(name[len("kdamesh_decode_"):name.index("{")], name.split('"')[1])] = float(value)
    return series


async def _flood(mesh, during=None):
    """A's 64 chats; once all of them run, `await during(http, their tasks)` -> (A's outputs, its result, the most
    running at once)."""
    a, url = _client(mesh, "key-a"), mesh["metrics"]["decode"]
    async with httpx.AsyncClient(timeout=10) as http:
        flood = [asyncio.create_task(_chat(a, f"Tell the story of lighthouse number {i}.", FLOOD_TOKENS))
                 for i in range(SLOTS)]
        widest = 0
        while widest < SLOTS:
            assert not any(t.done() for t in flood), "the flood ended before it filled the batch"
            widest = max(widest, (await _scrape(http, url)).get(("tenant_running_requests", "tenant-a"), 0))
            await asyncio.sleep(0.05)
        result = await during(http, flood) if during is not None else None
        assert during is None or not all(t.done() for t in flood), "the flood ended before the checks did"
        return await asyncio.gather(*flood), result, widest


async def _watched(mesh, http: httpx.AsyncClient) -> tuple[dict, dict]:
    """One chat of B of WATCHED_TOKENS -> (its message, the tenant series the first time they showed B running)
    (an 8-token chat can end between two scrapes on an idle machine)."""
    task = asyncio.create_task(_chat(_client(mesh, "key-b"), "Name three lighthouses.", WATCHED_TOKENS))
    seen = {}
    while not task.done():
        series = await _scrape(http, mesh["metrics"]["decode"])
        if not seen and series.get(("tenant_running_requests", "tenant-b")):
            seen = series
        await asyncio.sleep(0.05)
    return await task, seen


def test_a_flooding_tenant_cannot_hold_another_tenants_short_chat(mesh):
    async def main():
        await _short(mesh, "key-b")  # warm; the launcher printed its endpoints once the gateway could admit it
        alone, _, widest = await _flood(mesh)
        assert widest == SLOTS  # a lone tenant gets the whole engine
        idle = [await _short(mesh, "key-b") for _ in range(IDLE_SHORTS)]  # right before the flood

        async def during(http, flood):
            _, seen = await _watched(mesh, http)
            held = asyncio.create_task(_held(mesh, flood))  # negative control: the same chat as tenant A
            fair = [await _short(mesh, "key-b") for _ in range(FAIR_SHORTS)]
            assert not any(t.done() for t in flood), "B waited for one of A's chats to end"
            return fair, seen, held
        flooded, (fair, seen, held), _ = await _flood(mesh, during)
        held, a_ended_first = await held
        assert a_ended_first, "as tenant A the chat took none of A's slots: the control cannot fail"
        fair_s, idle_s = statistics.median(fair), statistics.median(idle)
        print(f"fair share e2e: B idle {sorted(idle)}, B during the flood {fair} ({fair_s / idle_s:.1f}x), as "
              f"tenant A {held:.2f}s")
        assert fair_s < 2.0 and fair_s < 5 * idle_s, (fair, idle)
        assert held > 2 * fair_s, (held, fair, idle)
        assert flooded == alone  # A's preempted chats continued with exactly the same output
        assert seen[("tenant_running_requests", "tenant-b")] == 1 and seen[("tenant_weight", "tenant-b")] == 2
        assert seen[("tenant_running_requests", "tenant-a")] == SLOTS - 1
        assert seen[("tenant_waiting_requests", "tenant-a")] == 1
        assert not any("key" in tenant for _, tenant in seen)

    async def closing():
        try:
            await main()
        finally:
            await _close_clients(mesh)
    asyncio.run(asyncio.wait_for(closing(), 400))
