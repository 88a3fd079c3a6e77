"""The gateway's event loop never does a request's CPU work (issue 27 point 2; gateway/prepare.py).

While three worst-case requests are being prepared — a chat of 10,000 short messages, a 10 MB completion prompt
and a response_format schema of a 2,000-way anyOf — /health and a small /tokenize answer within the issue's
target, 100 ms p99 over the test (`LATENCY_S`): the large requests are prepared on the pool's preparation
processes, off the gateway's GIL (82–113 ms p99 when they shared it on threads; 22.8 s before the pool). The one
allowance is for a shared machine: the bound grows with the load average per core beyond 1 (`_loaded_bound`),
since the gateway's process then gets only its share of a CPU. The gateway runs as its own process
(`kdamesh serve --role gateway`, as deployed) over an in-process decode worker; the heavy requests are encoded
beforehand and sent from threads, so the gateway's process does only the gateway's work. Negative control: an
in-process gateway whose preparation pool is replaced by a runner that calls the work inline (on the event loop,
as before) makes /health wait for a 30,000-message chat (> 300 ms; that gateway shares the probe's event loop,
so a probe's sample includes its own pause's overshoot).

Also: a chat's preparation costs O(messages): doubling the messages at most ~doubles its CPU time (bounded at 3x,
where rendering every prefix would give ~4x), and the pool's bounds answer 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time

import httpx
import pytest

from gateway.plan import ChatPlanner
from gateway.prepare import PrepPool, PrepSettings
from gateway.protocol import ApiError, parse_chat
from tests.faults.procs import ServiceProcess
from tests.integration.gateway_harness import checkpoint_fixture, free_port, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)
LATENCY_S = 0.100  # the issue's target, held by the test (see the module docstring)


def _chat(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"short message {i}"} for i in range(n)]


def _heavy_bodies() -> list[tuple[str, dict]]:
    prompt = " ".join(f"word{i % 977}" for i in range(1_400_000))[:10_000_000]
    schema = {"anyOf": [{"type": "object", "properties": {f"key{i}": {"type": "string"}}, "required": [f"key{i}"]}
                        for i in range(2000)]}
    return [("/v1/chat/completions", {"model": MODEL, "messages": _chat(10_000), "max_tokens": 1}),
            ("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}),
            ("/v1/chat/completions", {"model": MODEL, "messages": _chat(2), "max_tokens": 1,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "pick", "schema": schema}}})]


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _probe_while(http: httpx.AsyncClient, work: asyncio.Future, path: str, body: dict | None,
                       statuses: list[int]) -> list[float]:
    """Latencies of `path` (GET, or POST `body`) asked one after another until `work` is done; each sample also
    counts how late the 10 ms pause before it ended (a gateway on the probe's own loop blocks that pause)."""
    latencies, overshoot = [], 0.0
    while not work.done():
        start = time.perf_counter()
        response = await (http.get(path) if body is None else http.post(path, json=body))
        latencies.append(time.perf_counter() - start + overshoot)
        statuses.append(response.status_code)
        paused = time.perf_counter()
        await asyncio.sleep(0.01)
        overshoot = max(0.0, time.perf_counter() - paused - 0.01)
    return latencies


def _post(base_url: str, path: str, content: bytes) -> httpx.Response:
    """A heavy request from another thread, its body encoded beforehand: only the gateway's work is on its loop."""
    return httpx.post(base_url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)


async def _latencies_during(http: httpx.AsyncClient, bodies: list[tuple[str, dict]], statuses: list[int]):
    """(/health latencies, small /tokenize latencies, seconds the heavy requests took, their responses)."""
    encoded = [(path, json.dumps(body).encode()) for path, body in bodies]
    start = time.perf_counter()
    base_url = str(http.base_url).rstrip("/")
    work = asyncio.gather(*(asyncio.to_thread(_post, base_url, path, content) for path, content in encoded))
    health, small = await asyncio.gather(
        _probe_while(http, work, "/health", None, statuses),
        _probe_while(http, work, "/tokenize", {"model": MODEL, "prompt": "a small request"}, statuses))
    responses = await work
    return health, small, time.perf_counter() - start, responses


def _gateway_process(model_dir, decode_address: str, port: int) -> ServiceProcess:
    return ServiceProcess("deploy.cli", ["--log-level", "INFO", "serve", "--role", "gateway", "--model",
                                         str(model_dir), "--decode-workers", decode_address, "--mode", "colocated",
                                         "--port", str(port), "--grpc-port", "0", "--prepare-timeout-s", "120",
                                         "--disable-log-requests"], start_timeout_s=60)


async def _until_healthy(http: httpx.AsyncClient) -> None:
    for _ in range(300):
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the gateway never answered /health")


def test_health_and_small_requests_answer_while_worst_case_requests_are_prepared(tiny_k3):
    port = free_port()
    gateway = None

    async def body():
        nonlocal gateway
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            gateway = _gateway_process(tiny_k3, mesh.decode_address, port)
            await asyncio.to_thread(gateway.start)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                await _until_healthy(http)
                statuses: list[int] = []
                idle = await _probe_while(http, asyncio.ensure_future(asyncio.sleep(2.0)), "/health", None, statuses)
                measured = await _latencies_during(http, _heavy_bodies(), statuses)
            return (*measured, statuses, idle)

    try:
        health, small, took, responses, statuses, idle = run(body(), timeout_s=170)
    finally:
        if gateway is not None and gateway.proc is not None:
            gateway.kill()
    for response in responses:  # prepared and refused for their length (or served): never a 5xx
        assert response.status_code in (200, 400, 413), response.text[:300]
    assert set(statuses) == {200}, statuses
    assert took > 1.0 and len(health) >= 20, (took, len(health))  # the probes ran while the work was prepared
    print(f"idle /health p99 {_p99(idle) * 1e3:.0f} ms ({len(idle)}); "
          f"prepared in {took:.1f} s; /health p99 {_p99(health) * 1e3:.0f} ms max {max(health) * 1e3:.0f} ms "
          f"({len(health)}); small /tokenize p99 {_p99(small) * 1e3:.0f} ms ({len(small)})")
    bound = _loaded_bound()
    assert _p99(health) < bound, (bound, sorted(health)[-5:])
    assert _p99(small) < bound, (bound, sorted(small)[-5:])


def _loaded_bound() -> float:
    """100 ms up to one runnable task per core; on a busier machine the gateway's process gets only a share of a
    CPU, so the bound grows with the run queue (the load average per core): the control that blocks the loop stays
    far beyond it."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return LATENCY_S * max(1.0, per_core)


def _control_chat() -> tuple[str, dict]:
    """The control's request: a 30,000-message chat, three times the worst case's, so that its inline
    preparation outlasts the control's 300 ms on a fast machine too (a 10,000-message one took 0.29 s on an Intel
    Xeon of wave 3, session 16)."""
    return "/v1/chat/completions", {"model": MODEL, "messages": _chat(30_000), "max_tokens": 1}


class _Inline(PrepPool):
    """The negative control: the work runs on the event loop, as before the pool."""

    async def run(self, fn, *args, size: int = 0):
        return fn(*args)


def test_negative_control_inline_preparation_blocks_health(tiny_k3):
    async def body():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, \
                running_gateway(mesh, tiny_k3, colocated=True) as gw:
            gw.core.prep.close()
            gw.core.prep = _Inline()
            health, _, _, _ = await _latencies_during(gw.http, [_control_chat()], [])
        return health

    health = run(body(), timeout_s=120)
    print(f"control: /health max {max(health) * 1e3:.0f} ms while the chat was prepared inline")
    assert max(health) > 3 * LATENCY_S, max(health)
    assert max(health) > _loaded_bound(), (max(health), _loaded_bound())


def _plan_cpu_s(planner, chat) -> float:
    """CPU seconds of planning `chat` (render, structure hints). The cyclic
    garbage collector is paused meanwhile: its full collections cost in proportion to everything alive, an
    interpreter cost that would hide the algorithm's."""
    gc.collect()
    gc.disable()
    start = time.process_time()
    try:
        plan = planner.plan(chat)
    finally:
        spent = time.process_time() - start
        gc.enable()
    assert len(plan.snapshot_hints) == 16  # the hints were computed
    return spent


def test_chat_preparation_is_linear_in_messages(tiny_k3):
    async def body():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, \
                running_gateway(mesh, tiny_k3, colocated=True) as gw:
            core = gw.core  # its renderer and specials; a context length that admits every prompt (hints run)
            planner = ChatPlanner(core.renderer, core.config, lambda: 10**9, None, core.planner.special_ids)
            costs = {}
            for n in (2500, 5000) * 3:  # interleaved: the machine's load affects both alike
                chat = parse_chat({"model": MODEL, "messages": _chat(n)}, gw.core.served)
                costs.setdefault(n, []).append(_plan_cpu_s(planner, chat))
            return costs

    costs = run(body(), timeout_s=120)
    ratio = min(costs[5000]) / min(costs[2500])
    print(f"chat preparation: 2,500 messages {min(costs[2500]):.2f} s CPU, 5,000 {min(costs[5000]):.2f} s: {ratio:.2f}x")
    assert ratio < 3.0, costs


def test_pool_bounds_answer_503_with_retry_after():
    async def body():
        pool = PrepPool(PrepSettings(workers=1, queue_limit=1, timeout_s=0.3))
        release = threading.Event()
        try:
            slow = [asyncio.ensure_future(pool.run(release.wait, 5, size=1 << 20)) for _ in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(ApiError) as busy:
                await pool.run(len, "x", size=1 << 20)
            assert (busy.value.status, busy.value.code) == (503, "server_busy") and busy.value.headers["Retry-After"]
            assert await pool.run(len, "small", size=10) == 5  # the small lane is not behind the large one
            for task in slow:
                with pytest.raises(ApiError) as late:
                    await task
                assert (late.value.status, late.value.code) == (503, "prepare_timeout")
            assert pool.large.in_flight == 2  # the threads still hold their slots until their work ends
            release.set()
            for _ in range(100):
                if pool.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert pool.in_flight == 0
        finally:
            release.set()
            pool.close()
        before = sys.getswitchinterval()
        pool = PrepPool(PrepSettings(switch_interval_ms=0.5))
        pool.start()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        pool.close()
        assert sys.getswitchinterval() == before

    run(body(), timeout_s=20)
