"""The gateway over `dns:` pools (gateway/discovery.py): started with headless-Service targets and a fake resolver
that answers several pod addresses per Service, it dials every pod of each pool (one channel and router entry per
pod: the balancing a single Service address with gRPC's pick_first does not give), reports each in its health,
and stops re-resolving on close."""

from __future__ import annotations

import asyncio

from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.discovery import Discovery, DiscoverySettings
from tests.integration.gateway_harness import SALT_SECRET, checkpoint_fixture, run

tiny_k3 = checkpoint_fixture("tiny-k3", "tiny-k3", seed=3)
SETTINGS = DiscoverySettings(refresh_s=0.05, min_refresh_s=0.01, resolve_timeout_s=0.5, startup_timeout_s=2.0)
PODS = {"kdamesh-decode-headless": ["127.0.0.3", "127.0.0.1", "127.0.0.2"],
        "kdamesh-prefill-headless": ["127.0.0.5", "127.0.0.4"]}


async def fake_dns(host: str, port: int) -> list[str]:
    return [f"{ip}:{port}" for ip in PODS[host]]


def test_the_gateway_dials_every_pod_of_each_headless_service(tiny_k3):
    config = GatewayConfig(model=str(tiny_k3), decode_addresses=("dns:///kdamesh-decode-headless:1",),
                           prefill_addresses=("dns:///kdamesh-prefill-headless:2",), grpc_port=None,
                           health_check_interval_s=0.2)

    async def body():
        discovery = Discovery(config, fake_dns, SETTINGS)
        core = GatewayCore(config, env=SALT_SECRET, discovery=discovery)
        await core.start()
        try:
            assert sorted(core.mesh.decoders) == ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"]
            assert sorted(core.mesh.prefillers) == ["127.0.0.4:2", "127.0.0.5:2"]
            assert sorted(core.mesh.decode_router.addresses) == sorted(core.mesh.decoders)
            health = await core.mesh.health(timeout_s=0.5)  # nothing listens there: each pod asked, unhealthy
            assert sorted(health) == sorted([*core.mesh.decoders, *core.mesh.prefillers])
            assert not any(health.values())
            assert all(not t.done() for t in discovery._tasks) and len(discovery._tasks) == 2
        finally:
            tasks = list(discovery._tasks)
            await core.close()
        assert all(t.done() for t in tasks), tasks

    run(body(), timeout_s=30)


def test_a_changed_dns_answer_replaces_the_pools_of_the_mesh_client(tiny_k3):
    """Re-resolution reaches the real `MeshClient`: new pods join both the channels and the router, gone ones
    leave; an empty prefill answer empties that pool (requests then take the colocated path)."""
    pods = {"dec": ["127.0.0.1", "127.0.0.2"], "pre": ["127.0.0.4"]}

    async def dns(host: str, port: int) -> list[str]:
        return [f"{ip}:{port}" for ip in pods[host]]

    config = GatewayConfig(model=str(tiny_k3), decode_addresses=("dns:///dec:1",),
                           prefill_addresses=("dns:///pre:2",), grpc_port=None)

    async def body():
        discovery = Discovery(config, dns, SETTINGS)
        mesh = (await discovery.resolve_config()).make_mesh()
        assert (sorted(mesh.decoders), sorted(mesh.prefillers)) == (["127.0.0.1:1", "127.0.0.2:1"], ["127.0.0.4:2"])
        discovery.start(mesh)
        pods["dec"], pods["pre"] = ["127.0.0.2", "127.0.0.3", "127.0.0.5"], []
        want = ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.5:1"]
        try:
            for _ in range(200):
                await asyncio.sleep(0.02)
                if sorted(mesh.decoders) == want and not mesh.prefillers:
                    break
            assert sorted(mesh.decoders) == sorted(mesh.decode_router.addresses) == want
            assert not mesh.prefillers
        finally:
            await discovery.stop()
            await mesh.close()
    run(body())
