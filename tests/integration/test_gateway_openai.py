"""The official `openai` client against the gateway over an in-process tiny-k3 mesh (disaggregated): models, chat
(streamed and not, reasoning fields, n, seed, stop, logprobs), completions, usage with cached tokens, tools with
`tool_choice` named / required / none / auto (arguments valid against the schema: the engine's grammar), and
`response_format` json_schema / json_object; the SSE wire format; a client that disconnects aborts its request."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.gateway_harness import (check_released, checkpoint_fixture, run, running_gateway, sse_events,
                                              wait_idle)
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"]}}}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris for the next three days?"}]


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _client(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=60)


def _schema(tool: dict) -> dict:
    return tool["function"]["parameters"]


async def _models_and_a_reply(client) -> str:
    """/v1/models, then one non-streamed chat reply; returns its reasoning."""
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    reply = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    [choice] = reply.choices
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 12
    # K3 thinks first: the reasoning is reported under both names, and no markup leaks into it.
    reasoning = choice.message.reasoning_content
    assert reasoning and choice.message.reasoning == reasoning and "<|" not in reasoning
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    return reasoning


async def _streamed_like_the_reply(client, reasoning: str) -> None:
    """Streaming: the same text, role first, finish_reason only on the last chunk, a usage trailer."""
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in body[1:])
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    assert streamed == reasoning
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # The repeated prompt hit the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


async def _sampling_options(client, reasoning: str) -> None:
    """Thinking off, n / seed / logprobs, a stop string."""
    # Thinking off: the generation prompt opens the response block, so the output is content.
    plain = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}})
    assert plain.choices[0].message.content and not getattr(plain.choices[0].message, "reasoning_content", None)
    assert plain.usage.completion_tokens == 8

    # n, seed, logprobs.
    sampled = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=2,
                                                   temperature=1.0, seed=11, logprobs=True, top_logprobs=2)
    again = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=2,
                                                 temperature=1.0, seed=11, logprobs=True, top_logprobs=2)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert [c.message.reasoning_content for c in sampled.choices] == \
           [c.message.reasoning_content for c in again.choices]
    content = sampled.choices[0].logprobs.content
    assert len(content) == 6 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
    assert sampled.usage.completion_tokens == 12

    # A stop string ends the output and is not part of it.
    cut_at = reasoning[len(reasoning) // 2: len(reasoning) // 2 + 3]
    stopped = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=400, temperature=0,
                                                   stop=[cut_at], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.reasoning_content == reasoning[: reasoning.find(cut_at)]
    # Cached tokens are known from the first chunk: the stream left early still reports the hit.
    assert stopped.usage.completion_tokens < 12
    assert stopped.usage.prompt_tokens_details.cached_tokens > 0


async def _legacy_completions(client) -> None:
    done = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert done.choices[0].text and done.usage.completion_tokens == 5
    as_json = await client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=40, temperature=0,
                                              extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(as_json.choices[0].text), dict)


def test_chat_completions_models_and_usage(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = _client(gw)
            reasoning = await _models_and_a_reply(client)
            await _streamed_like_the_reply(client, reasoning)
            await _sampling_options(client, reasoning)
            await _legacy_completions(client)  # through the same client

            # Prometheus metrics of all that.
            metrics = (await gw.http.get("/metrics")).text
            for series in ('kdamesh_gateway_requests_total{api="rest",endpoint="chat",status="200"} 6.0',
                           'kdamesh_gateway_time_to_first_token_seconds_count{endpoint="chat"} 6.0',
                           'kdamesh_gateway_time_per_output_token_seconds_count{endpoint="completions"} 2.0',
                           'kdamesh_gateway_requests_running{api="rest"} 0.0'):
                assert series in metrics, series
            assert 'kdamesh_gateway_generation_tokens_total{tenant="anonymous"}' in metrics
            await client.close()
    run(main())


def test_tools_and_structured_output(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = _client(gw)
            # Named: exactly one call of that function, arguments valid against its schema.
            named = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=150, temperature=0.7, seed=1,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            [call] = named.choices[0].message.tool_calls
            assert call.type == "function" and call.function.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.function.arguments), _schema(WEATHER))
            assert named.choices[0].finish_reason == "tool_calls"

            # Required: at least one call, each valid against its tool's schema; streamed fragments reassemble.
            stream = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200,
                temperature=0.7, seed=2, stream=True)
            calls: dict[int, dict] = {}
            finish = None
            async for chunk in stream:
                for c in chunk.choices:
                    for frag in c.delta.tool_calls or ():
                        entry = calls.setdefault(frag.index, {"name": None, "arguments": "", "id": None})
                        if frag.id:
                            assert entry["id"] is None and frag.function.name
                            entry.update(id=frag.id, name=frag.function.name)
                        entry["arguments"] += frag.function.arguments or ""
                    finish = c.finish_reason or finish
            assert calls and finish == "tool_calls"
            tools = {"get_weather": WEATHER, "get_time": TIME}
            for entry in calls.values():
                jsonschema.validate(json.loads(entry["arguments"]), _schema(tools[entry["name"]]))

            # none: never a call; auto: allowed (with --enable-auto-tool-choice), the model decides.
            none = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                                        tool_choice="none", max_tokens=10, temperature=0)
            assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "length"
            auto = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                                        max_tokens=10, temperature=0)
            assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")

            # response_format json_schema / json_object: the content is JSON (valid against the schema).
            schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10},
                                                       "confidence": {"type": "number"}},
                      "required": ["answer", "confidence"], "additionalProperties": False}
            shaped = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=120, temperature=0.7, seed=3,
                response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
            jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)
            assert shaped.choices[0].finish_reason == "stop"
            obj = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60,
                                                       temperature=0, response_format={"type": "json_object"})
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
            await client.close()
    run(main())


def test_typed_errors_and_the_sse_wire_format(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 512}) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = _client(gw)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=QUESTION)
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
            assert info.value.body["param"] == "temperature"
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=100000)
            assert info.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as info:  # the worker's limit (512) is below the model's
                await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=400, stream=True)
            assert info.value.code == "context_length_exceeded"

            # The raw SSE stream: exact chunk shapes, [DONE] last.
            reply = await gw.http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            events = sse_events(reply.text)
            ids = {e["id"] for e in events}
            assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
            assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["prompt_tokens"] + 4
            last = events[-2]["choices"][0]
            assert last["finish_reason"] == "length" and last["delta"] == {}
            await client.close()
    run(main())


def test_a_client_that_disconnects_aborts_its_request(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            engine = mesh.decode_server.engine
            body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
            # Streaming: read two chunks, then drop the connection.
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http:
                async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
                    seen = 0
                    async for line in reply.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            break
            steps = engine.core.num_steps
            await wait_idle(engine, timeout_s=5)
            assert engine.core.num_steps - steps < 1000, "decode kept generating after the client left"
            # Not streaming: the client gives up after a moment.
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=0.5) as http:
                with pytest.raises(httpx.TimeoutException):
                    await http.post("/v1/chat/completions", json=body)
            await wait_idle(engine, timeout_s=5)
            await check_released(mesh, engine)  # every block released (cached ones are evictable)
            stats = await engine.stats()
            assert stats.num_running == 0 and stats.num_waiting == 0
            # The gateway released both tenants' concurrency and counted the requests.
            metrics = (await gw.http.get("/metrics")).text
            assert 'kdamesh_gateway_requests_total{api="rest",endpoint="chat",status="200"} 2.0' in metrics
            assert gw.core.limiter.active("anonymous") == 0
    run(main())
