"""Tenancy through the running gateway: API keys (401), per-tenant cache salts (no prefix-cache hits across
tenants), per-tenant rate and concurrency limits (429 with Retry-After), on REST (official openai client, raw HTTP)
and the gRPC API (SDK), and the per-tenant metrics."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

import sdk
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
KEYS = "key-a=tenant-a,key-b=tenant-b"
# A prompt of several KV blocks (16 tokens each), so a repeat can hit the prefix cache.
PROMPT = [{"role": "user", "content": "Summarise the history of the lighthouse on the northern cape, the keepers who "
                                      "lived there, the storms they saw and the ships they saved, in three lines."}]


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-c": {"tenant": "tenant-c", "rpm": 2},
                                "key-d": {"tenant": "tenant-d", "max_concurrency": 1}}))
    return str(path)


def _client(gw, key: str | None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key or "", max_retries=0, timeout=60)


async def _cached(client: openai.AsyncOpenAI, **extra) -> int:
    reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, temperature=0,
                                                 extra_body=extra or None)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_tenant_isolation_and_authentication(tiny_k3, keys_file):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, api_keys=KEYS,
                                                          api_keys_file=keys_file) as gw:
            a, b = _client(gw, "key-a"), _client(gw, "key-b")
            assert await _cached(a) == 0
            assert await _cached(b) == 0, "tenant B must not hit tenant A's prefix cache"
            assert await _cached(a) > 0, "tenant A repeating its prompt hits its own cache"
            assert await _cached(b) > 0
            # A client salt only splits a tenant's cache further (never joins another's).
            assert await _cached(a, cache_salt="experiment-1") == 0
            assert await _cached(a, cache_salt="experiment-1") > 0

            # 401: no key, an unknown key, a wrong scheme; typed in the openai client.
            with pytest.raises(openai.AuthenticationError):
                await _client(gw, "key-zzz").chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            with pytest.raises(openai.AuthenticationError):
                await _client(gw, "key-zzz").models.list()
            for headers in ({}, {"Authorization": "Basic a2V5LWE="}, {"Authorization": "Bearer"}):
                reply = await gw.http.post("/v1/chat/completions", headers=headers,
                                           json={"model": MODEL, "messages": PROMPT})
                assert reply.status_code == 401, headers
                assert reply.json()["error"]["type"] == "authentication_error"
                assert reply.headers["www-authenticate"] == "Bearer"
            for path in ("/tokenize", "/detokenize", "/v1/completions"):
                assert (await gw.http.post(path, json={})).status_code == 401
            # Health stays open; metrics need a key (they name tenants and workers).
            assert (await gw.http.get("/health")).status_code == 200
            assert (await gw.http.get("/metrics")).status_code == 401
            metrics = (await gw.http.get("/metrics", headers={"Authorization": "Bearer key-a"})).text
            assert 'kdamesh_gateway_prompt_tokens_total{tenant="tenant-a"}' in metrics
            assert 'kdamesh_gateway_cached_tokens_total{tenant="tenant-b"}' in metrics
            assert 'status="401"' in metrics

            # The gRPC API: the same keys and salts.
            async with sdk.AsyncClient(gw.grpc_address, api_key="key-b") as client:
                reply = await client.chat(MODEL, PROMPT, sampling=sdk.Sampling(max_tokens=2, temperature=0))
                assert reply.usage.cached_tokens > 0
            async with sdk.AsyncClient(gw.grpc_address) as anonymous:
                with pytest.raises(sdk.Unauthenticated):
                    await anonymous.chat(MODEL, PROMPT)
                with pytest.raises(sdk.Unauthenticated):
                    await anonymous.models()
            for client in (a, b):
                await client.close()
    run(main())


def test_rate_and_concurrency_limits(tiny_k3, keys_file):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, api_keys=KEYS,
                                                          api_keys_file=keys_file) as gw:
            c = _client(gw, "key-c")  # 2 requests per minute
            for _ in range(2):
                await c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            with pytest.raises(openai.RateLimitError) as info:
                await c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            assert int(info.value.response.headers["retry-after"]) >= 1
            assert info.value.body["code"] == "rate_limit_exceeded"
            # Another tenant is not affected; nor is the gRPC API of another tenant.
            await _client(gw, "key-a").chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            async with sdk.AsyncClient(gw.grpc_address, api_key="key-c") as client:
                with pytest.raises(sdk.RateLimited) as rl:
                    await client.generate(MODEL, "hello", sampling=sdk.Sampling(max_tokens=1))
                assert rl.value.retry_after >= 1

            # tenant-d: one request in flight at a time.
            d = _client(gw, "key-d")
            long = await d.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=3000, stream=True,
                                                   extra_body={"ignore_eos": True})
            first = await long.__anext__()
            assert first.choices[0].delta.role == "assistant"
            with pytest.raises(openai.RateLimitError) as info:
                await d.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            assert "concurrent" in info.value.message
            await long.close()  # disconnect: the lease is released when the stream ends
            for _ in range(200):
                if gw.core.limiter.active("tenant-d") == 0:
                    break
                await asyncio.sleep(0.02)
            await d.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            metrics = (await gw.http.get("/metrics", headers={"Authorization": "Bearer key-a"})).text
            assert 'kdamesh_gateway_rate_limited_total{limit="rpm",tenant="tenant-c"} 2.0' in metrics
            assert 'kdamesh_gateway_rate_limited_total{limit="concurrency",tenant="tenant-d"} 1.0' in metrics
    run(main())


def test_open_gateway_without_keys(tiny_k3, caplog):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            assert gw.core.tenants.is_open
            reply = await gw.http.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT,
                                                                      "max_tokens": 1})
            assert reply.status_code == 200
    with caplog.at_level("INFO", logger="gateway.core"):
        run(main())
    assert any("gateway is open" in r.getMessage() for r in caplog.records)
