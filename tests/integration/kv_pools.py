"""Pools of in-process workers for the KV-event routing tests (tests/integration/test_kv_event_routing.py): the
cache service and one prefill and one decode worker from `Mesh`, plus more of each, and a `MeshClient` subscribed to
every worker's KV event stream; a multi-tenant shared-prefix workload; a spy on a router's picks."""

from __future__ import annotations

import random
from contextlib import aclosing
from dataclasses import dataclass

from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from gateway.kv_events import SubscriberConfig
from gateway.mesh_client import MeshClient, MeshRequest, PDDecider
from gateway.routing import RouterConfig
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from tests.integration.mesh_harness import VOCAB, Mesh, Run, engine_args, greedy, settle_kv_events

PREFIX_TOKENS, SUFFIX_TOKENS = 64, 8
FAST_STALE = 1.5  # seconds of silence after which a worker counts as empty (the workers heartbeat every 0.5 s)


@dataclass(frozen=True)
class Family:
    """One tenant's shared prefix: requests of a family differ only in their suffix."""

    tenant_salt: bytes
    prefix: tuple[int, ...]

    def prompt(self, round_: int) -> list[int]:
        rng = random.Random(f"{self.tenant_salt.hex()}/{self.prefix[0]}/{round_}")
        return list(self.prefix) + [rng.randrange(VOCAB) for _ in range(SUFFIX_TOKENS)]


def families(tenants: int = 4, prefixes: int = 4, seed: int = 0) -> list[Family]:
    rng = random.Random(seed)
    shared = [tuple(rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)) for _ in range(prefixes)]
    return [Family(bytes([t + 1]) * 16, p) for t in range(tenants) for p in shared]


async def start_worker(mesh: Mesh, role: str, model_dir, address: str = "127.0.0.1:0", engine: dict | None = None):
    """Another worker of `role` on the mesh's cache service (loading remote prefixes when the mesh's do) ->
    (server, address); `engine`: engine overrides."""
    args = engine_args(model_dir, **(engine or {}))
    common = dict(engine=args, address=address, cache_address=mesh.cache_address, cache_timeout_s=5.0,
                  load_remote_prefix=mesh.load_remote_prefix)
    if role == "prefill":
        server, port = await serve_prefill(PrefillServiceConfig(**common))
    else:
        server, port = await serve_decode(DecodeServiceConfig(**common))
    await server.ready()
    return server, f"127.0.0.1:{port}"


def subscribed_client(decoders, prefillers=(), stale_after_s: float = 3.0) -> MeshClient:
    client = MeshClient(list(decoders), list(prefillers), PDDecider(min_uncached_tokens=0),
                        router_config=RouterConfig(stale_after_s=stale_after_s),
                        subscriber_config=SubscriberConfig(stale_after_s=stale_after_s, retry_s=0.05, max_retry_s=0.2))
    client.start_kv_events()
    return client


async def ask(client: MeshClient, family: Family, round_: int, max_tokens: int = 3) -> Run:
    request = MeshRequest(request_id=f"kv-{random.getrandbits(40):x}", prompt_token_ids=tuple(family.prompt(round_)),
                          sampling=greedy(max_tokens), tenant_salt=family.tenant_salt, timeout_s=30.0)
    run = Run()
    async with aclosing(client.generate(request)) as events:
        async for event in events:
            run.tokens.setdefault(event.index, []).extend(event.token_ids)
            if event.usage is not None:
                run.usage, run.route = event.usage, event.route
    return run


def spy_picks(router) -> list:
    """Records every `router.route` pick, in order."""
    picks, original = [], router.route

    def route(prompt=None):
        pick = original(prompt)
        picks.append(pick)
        return pick

    router.route = route
    return picks


async def settle(client: MeshClient, servers: dict) -> None:
    await settle_kv_events(client, {a: s for a, s in servers.items() if not s.servicer.stopping})
