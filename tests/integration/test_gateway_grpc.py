"""The public gRPC API through the SDK (sync and asyncio): the same tokens as REST for the same seed, tools and
structured output, tokenizer parity, errors mapped to exceptions, deadlines, cancellation (the mesh aborts), and
bounded retries on UNAVAILABLE."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest

import sdk
from gateway.grpc_api import serve_grpc
from tests.integration.gateway_harness import (check_released, checkpoint_fixture, free_port, run, running_gateway,
                                              sse_events, wait_idle)
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
MESSAGES = [{"role": "user", "content": "Tell me a short story about a brave little boat."}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"term": {"type": "string", "maxLength": 10}, "limit": {"type": "integer"}},
    "required": ["term", "limit"]}}}


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


async def _rest_chat_text(gw, body: dict) -> tuple[str, str]:
    reply = await gw.http.post("/v1/chat/completions", json={**body, "stream": True})
    reasoning, content = [], []
    for event in sse_events(reply.text):
        for choice in event["choices"]:
            reasoning.append(choice["delta"].get("reasoning_content") or "")
            content.append(choice["delta"].get("content") or "")
    return "".join(reasoning), "".join(content)


def test_sdk_streams_the_same_tokens_as_rest(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            sampling = sdk.Sampling(max_tokens=24, temperature=0.9, seed=5)
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0.9, "seed": 5}
            rest = await _rest_chat_text(gw, body)
            async with sdk.AsyncClient(gw.grpc_address) as client:
                chunks = [c async for c in client.chat_stream(MODEL, MESSAGES, sampling=sampling)]
                assert chunks[0].choices[0].role == "assistant"
                assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 24
                streamed = ("".join(c.choices[0].reasoning_content for c in chunks),
                            "".join(c.choices[0].content for c in chunks))
                assert streamed == rest and streamed[0]
                whole = await client.chat(MODEL, MESSAGES, sampling=sampling)
                assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == rest
                assert whole.usage.cached_tokens > 0  # the prompt was seen before

                # Completions: token for token (token ids returned by both).
                rest_done = (await gw.http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": 12, "temperature": 0.8,
                    "seed": 9, "return_token_ids": True, "ignore_eos": True})).json()
                done = await client.generate(MODEL, "The lighthouse keeper", return_token_ids=True,
                                             sampling=sdk.Sampling(max_tokens=12, temperature=0.8, seed=9,
                                                                   ignore_eos=True))
                assert done.choices[0].token_ids == rest_done["choices"][0]["token_ids"]
                assert done.choices[0].text == rest_done["choices"][0]["text"]

                # Tools and structured output over gRPC.
                reply = await client.chat(MODEL, MESSAGES, tools=[TOOL], tool_choice="lookup",
                                          sampling=sdk.Sampling(max_tokens=120, temperature=0.7, seed=1))
                [call] = reply.choices[0].message.tool_calls
                assert call.name == "lookup" and reply.choices[0].finish_reason == "tool_calls"
                jsonschema.validate(call.parsed_arguments(), TOOL["function"]["parameters"])
                shaped = await client.chat(MODEL, MESSAGES, response_format={"type": "json_object"},
                                           sampling=sdk.Sampling(max_tokens=60, temperature=0))
                assert isinstance(json.loads(shaped.choices[0].message.content), dict)

                # Tokenizer and models, as REST answers them.
                ids = await client.tokenize(MODEL, messages=MESSAGES)
                rest_ids = (await gw.http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
                assert ids == rest_ids["tokens"] and rest_ids["count"] == len(ids)
                assert await client.detokenize(MODEL, ids[:5]) == \
                       (await gw.http.post("/detokenize", json={"model": MODEL, "tokens": ids[:5]})).json()["prompt"]
                [card] = await client.models()
                assert card.id == MODEL and card.family == "kimi_k3" and card.max_model_len > 0

            # The blocking client (in a thread: the servers run in this loop).
            def blocking():
                with sdk.Client(gw.grpc_address) as client:
                    return "".join(c.choices[0].reasoning_content for c in
                                   client.chat_stream(MODEL, MESSAGES, sampling=sampling))
            assert await asyncio.to_thread(blocking) == rest[0]
    run(main())


def test_sdk_errors_deadlines_cancellation(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 512}) as mesh, running_gateway(mesh, tiny_k3) as gw:
            engine = mesh.decode_server.engine
            async with sdk.AsyncClient(gw.grpc_address) as client:
                with pytest.raises(sdk.NotFound):
                    await client.chat("no-such-model", MESSAGES)
                with pytest.raises(sdk.InvalidRequest) as info:
                    await client.chat(MODEL, MESSAGES, sampling=sdk.Sampling(temperature=-1.0))
                assert "temperature" in info.value.message
                with pytest.raises(sdk.InvalidRequest, match="context length"):
                    await client.generate(MODEL, "hi", sampling=sdk.Sampling(max_tokens=5000))
                with pytest.raises(sdk.InvalidRequest):
                    await client.chat(MODEL, MESSAGES, tool_choice="required")  # no tools
                with pytest.raises(sdk.InvalidRequest):
                    await client.detokenize(MODEL, [10 ** 9])

                # Deadline: the call ends with DeadlineExceeded and the mesh stops generating.
                long = sdk.Sampling(max_tokens=300, ignore_eos=True, temperature=0)
                started, steps = time.monotonic(), engine.core.num_steps
                with pytest.raises(sdk.DeadlineExceeded):
                    await client.chat(MODEL, MESSAGES, sampling=long, timeout=0.3)
                assert time.monotonic() - started < 3
                await wait_idle(engine)
                assert engine.core.num_steps - steps < 250, "decode ran on past the deadline"

                # Cancellation: leaving the stream aborts the request in the mesh.
                steps = engine.core.num_steps
                stream = client.chat_stream(MODEL, MESSAGES, sampling=long)
                async for _ in stream:
                    break
                await stream.aclose()
                await wait_idle(engine)
                assert engine.core.num_steps - steps < 250, "decode ran on after the stream was closed"
                await check_released(mesh, engine)
    run(main())


def test_sdk_retries_unavailable_with_backoff(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, \
                running_gateway(mesh, tiny_k3, colocated=True) as gw:
            port = free_port()
            fast = sdk.RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.2, jitter=0.0)

            # Nothing listens: three attempts, then Unavailable (after the two backoffs).
            def dead():
                started = time.monotonic()
                with sdk.Client(f"127.0.0.1:{port}", retry=fast, timeout=10) as client:
                    with pytest.raises(sdk.Unavailable):
                        client.models()
                return time.monotonic() - started
            assert 0.3 <= await asyncio.to_thread(dead) < 5

            # The server comes up while the client retries: the call succeeds.
            patient = sdk.RetryPolicy(max_attempts=20, initial_backoff_s=0.05, max_backoff_s=0.2)

            def late():
                with sdk.Client(f"127.0.0.1:{port}", retry=patient, timeout=20) as client:
                    return client.generate(MODEL, "hello", sampling=sdk.Sampling(max_tokens=3, temperature=0))
            call = asyncio.ensure_future(asyncio.to_thread(late))
            await asyncio.sleep(0.5)
            server, bound = await serve_grpc(gw.core, f"127.0.0.1:{port}")
            assert bound == port
            try:
                done = await call
                assert done.usage.completion_tokens == 3
            finally:
                await server.stop(0)
    run(main())
