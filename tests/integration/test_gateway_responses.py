"""The OpenAI Responses API (`/v1/responses`) through the official `openai` client against the gateway over an
in-process tiny-k3 mesh: reasoning items equal to the chat path's reasoning, streaming events in the order the
client's stream helper checks, function tools (forced: arguments valid against the schema), `previous_response_id`
with a `function_call_output` (the prompt equals the chat request with the whole history), the store (retrieve,
delete, other tenants see nothing), `reasoning.effort` and `text.format`; bad input in the OpenAI error envelope; a
client that leaves a stream (here or on /v1/messages) cancels its request."""

from __future__ import annotations

import base64
import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.gateway_harness import (check_released, checkpoint_fixture, run, running_gateway, sse_events,
                                              wait_idle)
from tests.integration.mesh_harness import Mesh
from tests.integration.test_gateway_openai import QUESTION, WEATHER
from tests.unit.vision.images import encode, make_image

MODEL = "tiny-k3"
INSTRUCTIONS, ASK = QUESTION[0]["content"], QUESTION[1]["content"]
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
IMAGE = base64.b64encode(encode(make_image("RGB", 224, 168, 1))).decode()  # 48 feature rows

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _client(gw, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)


async def _reasoning_like_chat(client) -> None:
    """A response's reasoning item is the chat path's reasoning for the same conversation; streamed deltas add up
    to it, the events come in the documented order, and the token limit makes the response incomplete."""
    chat = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    reasoning = chat.choices[0].message.reasoning_content
    reply = await client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=12,
                                          temperature=0)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [item] = reply.output
    assert item.type == "reasoning" and item.content[0].text == reasoning and item.summary == []
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens == chat.usage.prompt_tokens
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens <= 12

    stream = await client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=12,
                                           temperature=0, stream=True)
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[-1].response.output[0].content[0].text == reasoning
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0  # the same prompt again


async def _forced_tool_then_follow_up(client) -> None:
    """A named function call streams through the client's helper; its output answers it in a follow-up that
    continues from the stored response (the prompt is the chat request holding the whole history)."""
    async with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=[FUNCTION],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=150, temperature=0.7) as stream:
        seen = [event.type async for event in stream]
        first = await stream.get_final_response()
    assert first.status == "completed"
    assert "response.function_call_arguments.delta" in seen and "response.function_call_arguments.done" in seen
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])

    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    follow = await client.responses.create(model=MODEL, previous_response_id=first.id, input=output,
                                           tools=[FUNCTION], max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id
    reasoning = "".join(i.content[0].text for i in first.output if i.type == "reasoning")
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "reasoning_content": reasoning or None,
                "tool_calls": [{"id": call.call_id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    chat = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4,
                                                temperature=0)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.usage.input_tokens != first.usage.input_tokens  # negative control: the history counts

    # The store: retrieve, delete, then it is gone.
    again = await client.responses.retrieve(first.id)
    assert again.id == first.id and again.output[-1].call_id == call.call_id
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model=MODEL, previous_response_id=first.id, input="and tomorrow?")
    assert info.value.body["param"] == "previous_response_id"


async def _effort_and_format(client) -> None:
    plain = await client.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0,
                                          reasoning={"effort": "none"}, store=False)
    assert [item.type for item in plain.output] == ["message"] and plain.output[0].content[0].text
    assert plain.output_text == plain.output[0].content[0].text and plain.store is False
    with pytest.raises(openai.NotFoundError):  # store false: nothing kept
        await client.responses.retrieve(plain.id)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    shaped = await client.responses.create(model=MODEL, input=ASK, max_output_tokens=120, temperature=0.7,
                                           text={"format": {"type": "json_schema", "name": "reply",
                                                            "schema": schema}})
    assert shaped.status == "completed"
    jsonschema.validate(json.loads(shaped.output_text), schema)

    # An image: the prompt the chat path makes of the same image part (its feature rows included).
    url = "data:image/png;base64," + IMAGE
    seen = await client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}])
    chat = await client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert seen.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.input_tokens + 48


def test_responses_through_the_openai_client(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = _client(gw)
            await _reasoning_like_chat(client)
            await _forced_tool_then_follow_up(client)
            await _effort_and_format(client)
            metrics = (await gw.http.get("/metrics")).text
            assert 'kdamesh_gateway_requests_total{api="rest",endpoint="responses",status="200"}' in metrics
            await client.close()
    run(main(), timeout_s=150)


BAD = [  # (body changes, status, param)
    ({"input": ""}, 400, "input"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "input"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 100000}, 400, "input"),  # context_length_exceeded names the prompt, as chat does
    ({"temperature": "hot"}, 400, "temperature"),
    ({"background": True}, 400, "background"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"model": "nope"}, 404, "model"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
]


def test_bad_input_in_the_openai_envelope(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, api_keys="ka=alpha,kb=beta",
                                                          tenant_rpm=3) as gw:
            headers = {"Authorization": "Bearer ka"}
            for change, status, param in BAD:
                reply = await gw.http.post("/v1/responses", headers=headers,
                                           json={"model": MODEL, "input": ASK, **change})
                assert reply.status_code == status, (change, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param and error["message"] and error["type"], (change, error)
            unauthorized = await gw.http.post("/v1/responses", json={"model": MODEL, "input": ASK})
            assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
            with pytest.raises(openai.AuthenticationError):
                await _client(gw, "wrong").responses.create(model=MODEL, input=ASK)

            # A stored response is its tenant's alone.
            alpha, beta = _client(gw, "ka"), _client(gw, "kb")
            mine = await alpha.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
            assert (await alpha.responses.retrieve(mine.id)).id == mine.id
            with pytest.raises(openai.NotFoundError):
                await beta.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await beta.responses.create(model=MODEL, input=ASK, previous_response_id=mine.id)

            # The raw stream: `event:` lines name each event's type.
            reply = await gw.http.post("/v1/responses", headers=headers, json={
                "model": MODEL, "input": ASK, "max_output_tokens": 3, "stream": True})
            names = [line.split(": ", 1)[1] for line in reply.text.splitlines() if line.startswith("event: ")]
            assert names[0] == "response.created" and names[-1] == "response.incomplete"
            payloads = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
            assert [p["type"] for p in payloads] == names
            with pytest.raises(AssertionError):  # negative control: no chat-style [DONE] ends this stream
                sse_events(reply.text)

            too_big = await gw.http.post("/v1/responses", headers={**headers, "content-type": "application/json"},
                                         content=b" " * ((32 << 20) + 1))
            assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
            for _ in range(4):  # alpha's third request in the minute is its last
                limited = await gw.http.post("/v1/responses", headers=headers,
                                             json={"model": MODEL, "input": ASK, "max_output_tokens": 1})
                if limited.status_code == 429:
                    break
            assert limited.status_code == 429 and limited.headers["retry-after"]
            assert limited.json()["error"]["type"] == "rate_limit_error"
            await alpha.close()
            await beta.close()
    run(main(), timeout_s=120)


def test_a_client_that_leaves_a_stream_cancels_its_request(tiny_k3):
    """Both translated APIs: dropping the stream aborts the mesh request and releases the tenant's slot."""
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            engine = mesh.decode_server.engine
            bodies = {"/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 4000, "stream": True},
                      "/v1/responses": {"model": MODEL, "input": ASK, "max_output_tokens": 4000, "stream": True}}
            for path, body in bodies.items():
                async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http:
                    async with http.stream("POST", path, json=body) as reply:
                        seen = 0
                        async for line in reply.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen >= 6:
                                break
                        assert (await engine.stats()).num_running == 1  # still generating when the client leaves
                steps = engine.core.num_steps
                await wait_idle(engine, timeout_s=5)
                assert engine.core.num_steps - steps < 1000, f"{path}: decode kept generating after the client left"
            await check_released(mesh, engine)
            assert gw.core.limiter.active("anonymous") == 0
    run(main(), timeout_s=120)
