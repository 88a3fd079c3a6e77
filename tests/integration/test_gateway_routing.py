"""Routing over several decode workers (`--decode-workers a,b`): prefix affinity from the workers' KV events (a repeated prompt returns to the
worker that cached it), load awareness (a busy worker is passed over), and health (a worker that stops answering
its health checks gets no requests; the gateway reports it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
import pytest

from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh, engine_args, settle_kv_events

MODEL = "tiny-k3"


def _prompt(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a detailed report about {topic}, covering its history, its "
                                        f"present state and what experts expect of it in the next ten years."}]


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


@dataclass
class Pool:
    """Two decode workers behind one gateway, and how many requests each has served."""

    gw: object
    client: openai.AsyncOpenAI
    servers: dict  # address -> decode server
    first: str
    second: str

    def counts(self) -> dict[str, int]:
        return {a: s.worker.counters.local_requests for a, s in self.servers.items()}

    async def ask(self, topic: str, max_tokens: int = 2):
        reply = await self.client.chat.completions.create(model=MODEL, messages=_prompt(topic),
                                                          max_tokens=max_tokens, temperature=0)
        await self.settle()
        return reply

    async def settle(self) -> None:
        """The workers' KV events so far reached the gateway (routing is then deterministic)."""
        live = {a: s for a, s in self.servers.items() if s.kv_events is not None and not s.servicer.stopping}
        await settle_kv_events(self.gw.core.mesh, live)


async def _load_then_prefix_affinity(pool: Pool) -> None:
    first, second = pool.first, pool.second
    await pool.ask("lighthouses")  # both idle and uncached: the first listed worker
    assert pool.counts() == {first: 1, second: 0}
    # Load: while a long request runs on the first worker, a new prompt goes to the second (one request in flight
    # weighs as much as 1024 uncached tokens; the prompts share only the template's first blocks).
    busy = await pool.client.chat.completions.create(model=MODEL, messages=_prompt("lighthouses"), max_tokens=2000,
                                                     stream=True, extra_body={"ignore_eos": True})
    await busy.__anext__()
    await pool.settle()
    assert pool.counts() == {first: 2, second: 0}
    await pool.ask("glaciers")
    assert pool.counts() == {first: 2, second: 1}
    await busy.close()
    # Prefix affinity: each prompt returns to the worker that has it cached.
    for _ in range(2):
        await pool.ask("glaciers")
        await pool.ask("lighthouses")
    assert pool.counts() == {first: 4, second: 3}
    reply = await pool.ask("lighthouses")
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


async def _routes_around_a_dead_worker(pool: Pool) -> None:
    """The second worker goes away; the gateway notices and routes around it."""
    first, second, gw = pool.first, pool.second, pool.gw
    await pool.servers[second].stop(0)
    for _ in range(100):
        if not gw.core.mesh.decode_router.is_healthy(second):
            break
        await asyncio.sleep(0.05)
    assert not gw.core.mesh.decode_router.is_healthy(second)
    for _ in range(3):
        assert (await pool.ask("glaciers")).choices[0].finish_reason == "length"
    assert pool.counts()[first] == 8
    health = await gw.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["workers"] == {first: True, second: False}
    metrics = (await gw.http.get("/metrics")).text
    assert f'kdamesh_gateway_worker_healthy{{address="{second}",pool="decode"}} 0.0' in metrics


def test_prefix_and_load_aware_routing_skips_unhealthy_workers(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            second, port = await serve_decode(DecodeServiceConfig(engine=engine_args(tiny_k3),
                                                                  cache_address=mesh.cache_address,
                                                                  address="127.0.0.1:0"))
            await second.ready()
            addresses = (mesh.decode_address, f"127.0.0.1:{port}")
            try:
                async with running_gateway(mesh, tiny_k3, colocated=True, decode_addresses=addresses,
                                           health_check_interval_s=0.1, route_load_weight=1024.0) as gw:
                    client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="x", max_retries=0)
                    pool = Pool(gw, client, dict(zip(addresses, (mesh.decode_server, second))), *addresses)
                    await _load_then_prefix_affinity(pool)
                    await _routes_around_a_dead_worker(pool)
                    await client.close()
            finally:
                await second.stop(0)
    run(main())


def test_gateway_flags_and_the_launcher_plan(tiny_k3, tmp_path):
    from deploy.launcher import LaunchConfig, plan_services
    from deploy.serve import gateway_config_from, role_parser

    ns = role_parser("gateway").parse_args([
        "--model", str(tiny_k3), "--decode-workers", "a:1,b:2", "--prefill-workers", "c:3", "--grpc-port", "0",
        "--api-keys-file", str(tmp_path / "keys.json"), "--tenant-rpm", "60", "--tool-call-parser", "kimi_k3",
        "--reasoning-parser", "kimi_k3", "--enable-auto-tool-choice", "--health-check-interval-s", "2",
        "--grace-s", "7.5"])
    config = gateway_config_from(ns, api_keys="k=t")
    assert config.decode_addresses == ("a:1", "b:2") and config.prefill_addresses == ("c:3",)
    assert (config.grpc_port, config.api_keys, config.tenant_rpm, config.health_check_interval_s) == (0, "k=t", 60, 2)
    assert config.tool_call_parser == config.reasoning_parser == "kimi_k3" and config.enable_auto_tool_choice
    assert config.shutdown_grace_s == 7.5
    off = gateway_config_from(role_parser("gateway").parse_args(["--model", "/m", "--decode-addresses", "a:1",
                                                                 "--mode", "colocated", "--grpc-port", "-1"]))
    assert off.grpc_port is None and off.tool_call_parser is None
    with pytest.raises(ValueError):  # auto tool choice without a parser
        gateway_config_from(role_parser("gateway").parse_args(["--model", "/m", "--decode-workers", "a:1",
                                                               "--mode", "colocated", "--enable-auto-tool-choice"]))

    services = plan_services(LaunchConfig(model=str(tiny_k3), grpc_port=7000, api_keys="k=t"), str(tiny_k3))
    gateway = services[-1]
    argv = gateway.argv
    assert argv[argv.index("--grpc-port") + 1] == "7003" and gateway.grpc_api == "127.0.0.1:7003"
    assert argv[argv.index("--tool-call-parser") + 1] == "kimi_k3" and "--enable-auto-tool-choice" in argv
    assert gateway.env == {"KDAMESH_API_KEYS": "k=t"}
    plain = plan_services(LaunchConfig(model=str(tiny_k3), tool_call_parser="none", reasoning_parser="none",
                                       gateway_grpc_port=9999), str(tiny_k3))[-1].argv
    assert "--tool-call-parser" not in plain and "--reasoning-parser" not in plain
    assert plain[plain.index("--grpc-port") + 1] == "9999"
    assert all("--grace-s" not in s.argv for s in services)  # each service's own default
    graceful = plan_services(LaunchConfig(model=str(tiny_k3), grace_s=12), str(tiny_k3))
    assert [s.argv[s.argv.index("--grace-s") + 1] for s in graceful] == ["12"] * 4
    for service in graceful:  # every role's parser takes the flag
        role_parser(service.role).parse_args(service.argv)
