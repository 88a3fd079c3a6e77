"""A running gateway for integration tests: REST (uvicorn on a free port) and the gRPC API, over an in-process mesh
(`tests.integration.mesh_harness.Mesh`), all in the test's event loop.

`async with running_gateway(mesh, model_dir, ...) as gw:` gives `gw.base_url` (".../v1" is the OpenAI base URL),
`gw.grpc_address`, `gw.core` (the `GatewayCore`) and `gw.http` (an httpx client over TCP). A real socket (not an
ASGI transport) is used so that client disconnects reach the server as they would in production.

Also the pieces every gateway test module shares: `checkpoint_fixture(kind, name, seed)` (a module-scoped fixture
of a generated checkpoint folder named as clients call the model), `run(coro)` (a fresh event loop with a time
limit), `sse_events`, `wait_idle` and `check_released` (after a drain the engine is intact and holds no block).
"""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from engine.model.checkpoint import make_checkpoint
from gateway.app import create_app
from gateway.chat import OUTPUT_FORMATS, read_family
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.grpc_api import serve_grpc
from gateway.rest_io import ShutdownClock
from tests.integration.mesh_harness import Mesh

SALT_SECRET = {"KDAMESH_CACHE_SALT_SECRET": "integration-test-secret-0123456789"}


def checkpoint_fixture(kind: str, name: str, seed: int):
    """A module-scoped fixture: `make_checkpoint(kind)` in a folder called `name` (the served model's name)."""
    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory):
        return make_checkpoint(kind, tmp_path_factory.mktemp(kind) / name, seed=seed)
    return checkpoint


def run(coro, timeout_s: float = 80.0):
    """Runs a test's coroutine in a fresh event loop; fails it after `timeout_s`."""
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro
    return asyncio.run(bounded())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    base_url: str
    grpc_address: str
    core: GatewayCore
    config: GatewayConfig
    http: httpx.AsyncClient

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body (asserting it ends with [DONE])."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(e) for e in events[:-1]]


@asynccontextmanager
async def running_gateway(mesh: Mesh, model_dir, *, parsers: bool = True, api_keys: str | None = None,
                          api_keys_file: str | None = None, decode_addresses: tuple[str, ...] | None = None,
                          colocated: bool = False, **config_overrides):
    fmt = OUTPUT_FORMATS[read_family(model_dir)]
    options = dict(tool_call_parser=fmt, reasoning_parser=fmt, enable_auto_tool_choice=True) if parsers else {}
    options.update(config_overrides)
    prefill = () if colocated or not mesh.with_prefill else (mesh.prefill_address,)
    config = GatewayConfig(model=str(model_dir), decode_addresses=decode_addresses or (mesh.decode_address,),
                           prefill_addresses=prefill, mode="colocated" if not prefill else "disaggregated",
                           pd_min_uncached_tokens=0, host="127.0.0.1", http_port=free_port(), grpc_port=0,
                           api_keys=api_keys, api_keys_file=api_keys_file, **options)
    core = GatewayCore(config, env=SALT_SECRET)
    await core.start()
    grpc_server, grpc_port = await serve_grpc(core, "127.0.0.1:0")
    app = create_app(config, core=core, shutdown=ShutdownClock(1.0))  # as `serve` makes it
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.http_port,
                                           log_level="warning", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    base_url = f"http://127.0.0.1:{config.http_port}"
    http = httpx.AsyncClient(base_url=base_url, timeout=60)
    try:
        yield Gateway(base_url, f"127.0.0.1:{grpc_port}", core, config, http)
    finally:
        await http.aclose()
        server.should_exit = True
        await task
        await grpc_server.stop(0)
        await core.close()


async def check_released(mesh: Mesh, engine) -> None:
    """After the mesh drained: the engine's pools are intact and every block is free (cached ones are evictable)."""
    await mesh.drain()
    await engine.check_integrity()
    pool = engine.core.manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


async def wait_idle(engine, timeout_s: float = 5.0) -> None:
    """Waits until an engine has no running or waiting request; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        assert loop.time() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.02)
