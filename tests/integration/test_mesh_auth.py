"""The mesh token (issue 16 item 6): cache, prefill and decode started with a token answer UNAUTHENTICATED to calls
without it (a direct Decode generates nothing; DataPlane reveals no Redis URL or arena), serve calls that carry it
(the gateway's mesh client, the workers' cache client), and keep health open for probes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.server import CacheServiceConfig
from cache_service.server import serve as serve_cache
from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from gateway.mesh_client import MeshClient, MeshRequest, PDDecider
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from protos import cache_pb2, cache_pb2_grpc, common_pb2, decode_pb2, decode_pb2_grpc
from telemetry import mesh_auth
from tests.integration.mesh_harness import engine_args, greedy, run_bounded, tiny_k3_checkpoint

TOKEN = "t0ken-" + "x" * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def _channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, interceptors=mesh_auth.client_interceptors(token) or None)


async def _health(address: str) -> int:
    async with _channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def test_cache_data_plane_needs_the_token(redis_url):
    async def body():
        for backend in ("memory", redis_url):
            server, port = await serve_cache(CacheServiceConfig(address="127.0.0.1:0", backend=backend,
                                                                mesh_token=TOKEN))
            address = f"127.0.0.1:{port}"
            try:
                for token in (None, "wrong-" + "y" * 30):
                    async with _channel(address, token) as channel:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await cache_pb2_grpc.CacheServiceStub(channel).DataPlane(cache_pb2.DataPlaneRequest(),
                                                                                     timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "redis://" not in (err.value.details() or "") and "/dev/shm" not in str(err.value)
                async with _channel(address, TOKEN) as channel:
                    reply = await cache_pb2_grpc.CacheServiceStub(channel).DataPlane(cache_pb2.DataPlaneRequest(),
                                                                                     timeout=5)
                assert reply.WhichOneof("plane") == ("shm" if backend == "memory" else "redis")
                assert await _health(address) == health_pb2.HealthCheckResponse.SERVING  # probes need no token
                assert server.metrics.registry.get_sample_value(
                    "kdamesh_cache_requests_total", {"method": "DataPlane", "status": "UNAUTHENTICATED"}) == 2
            finally:
                await server.stop(0)

    run_bounded(body())


def test_workers_need_the_token(model_dir):
    async def body():
        cache, cport = await serve_cache(CacheServiceConfig(address="127.0.0.1:0", mesh_token=TOKEN))
        cache_address = f"127.0.0.1:{cport}"
        prefill, pport = await serve_prefill(PrefillServiceConfig(
            engine=engine_args(model_dir), cache_address=cache_address, address="127.0.0.1:0", mesh_token=TOKEN))
        decode, dport = await serve_decode(DecodeServiceConfig(
            engine=engine_args(model_dir), cache_address=cache_address, address="127.0.0.1:0", mesh_token=TOKEN))
        decode_address = f"127.0.0.1:{dport}"
        try:
            await prefill.ready()
            await decode.ready()
            await _unauthenticated_decode(decode_address)
            # The gateway's client with the token: remote prefill, the handoff through the token-protected cache.
            client = MeshClient([decode_address], [f"127.0.0.1:{pport}"], PDDecider(min_uncached_tokens=0),
                                mesh_token=TOKEN)
            try:
                tokens, route = [], ""
                request = MeshRequest(request_id="with-token", prompt_token_ids=tuple(range(1, 40)),
                                      sampling=greedy(4), timeout_s=30)
                async for event in client.generate(request):
                    tokens.extend(event.token_ids)
                    route = event.route or route
                assert len(tokens) == 4 and route == "remote"
            finally:
                await client.close()
        finally:
            for server in (decode, prefill, cache):
                await server.stop(0)

    run_bounded(body(), 120)


async def _unauthenticated_decode(address: str) -> None:
    request = decode_pb2.DecodeRequest(generation=common_pb2.GenerationRequest(
        request_id="no-token", sampling=greedy(4), prompt=common_pb2.TokenIds(ids=[1, 2, 3])),
        local=decode_pb2.LocalPrefill())
    async with _channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=10):
                raise AssertionError("a Decode without the mesh token produced output")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await _health(address) == health_pb2.HealthCheckResponse.SERVING


def test_short_tokens_are_refused():
    with pytest.raises(ValueError):
        CacheServiceConfig(mesh_token="short")
    assert mesh_auth.mesh_token_from_env({}) is None
    assert mesh_auth.mesh_token_from_env({mesh_auth.MESH_TOKEN_ENV: TOKEN}) == TOKEN
