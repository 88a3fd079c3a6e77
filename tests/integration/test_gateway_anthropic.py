"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official `anthropic` client
against the gateway over an in-process tiny-k3 mesh: thinking blocks equal to the chat path's reasoning, streams
(the client's stream helper, and the raw event names with `ping`), forced tool use (input valid against the schema,
streamed as input_json_delta), a tool_result follow-up whose count_tokens is the prompt the model got, thinking off,
an image; `x-api-key` tenants; bad input in Anthropic's error envelope with the right statuses (400, 401, 404,
413, 429)."""

from __future__ import annotations

import base64
import json

import anthropic
import jsonschema
import pytest

from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh
from tests.integration.test_gateway_openai import QUESTION, WEATHER
from tests.unit.vision.images import encode, make_image

MODEL = "tiny-k3"
SYSTEM, ASK = QUESTION[0]["content"], QUESTION[1]["content"]
USER = [{"role": "user", "content": ASK}]
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
GREEDY, WARM = {"temperature": 0}, {"temperature": 0.7}  # sampling fields the client no longer declares
IMAGE = base64.b64encode(encode(make_image("RGB", 224, 168, 1))).decode()  # 48 feature rows

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _client(gw, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key, max_retries=0, timeout=60)


async def _thinking_like_chat(gw, client) -> None:
    """The thinking block is the chat path's reasoning; the stream helper assembles the same message."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0) as openai_client:
        chat = await openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                           extra_body=GREEDY)
    reasoning = chat.choices[0].message.reasoning_content
    reply = await client.messages.create(model=MODEL, system=SYSTEM, messages=USER, max_tokens=12, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    [block] = reply.content
    assert block.type == "thinking" and block.thinking == reasoning
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 12
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens

    async with client.messages.stream(model=MODEL, system=SYSTEM, messages=USER, max_tokens=12,
                                      extra_body=GREEDY) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].thinking == reasoning and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the prefix cache

    raw = await gw.http.post("/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 3,
                                                   "stream": True})
    names = [line.split(": ", 1)[1] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]


async def _tool_use_and_result(client) -> None:
    """Forced tool use (named, then any while streaming); its result answers it; count_tokens counts that prompt."""
    named = await client.messages.create(model=MODEL, system=SYSTEM, messages=USER, tools=[TOOL], max_tokens=150,
                                         tool_choice={"type": "tool", "name": "get_weather"}, extra_body=WARM)
    assert named.stop_reason == "tool_use"
    [call] = [b for b in named.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, TOOL["input_schema"])

    async with client.messages.stream(model=MODEL, messages=USER, tools=[TOOL], tool_choice={"type": "any"},
                                      max_tokens=150, extra_body=WARM) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        streamed = await stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    for block in streamed.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, TOOL["input_schema"])

    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in named.content]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                          {"type": "text", "text": "Thanks, and tomorrow?"}]}]
    follow = await client.messages.create(model=MODEL, system=SYSTEM, messages=history, tools=[TOOL],
                                          max_tokens=4, extra_body=GREEDY)
    counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history, tools=[TOOL])
    assert counted.input_tokens == follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    shorter = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER, tools=[TOOL])
    assert shorter.input_tokens < counted.input_tokens  # negative control: the history counts


async def _thinking_off_and_an_image(client) -> None:
    plain = await client.messages.create(model=MODEL, messages=USER, max_tokens=5, extra_body=GREEDY,
                                         thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text
    hidden = await client.messages.create(model=MODEL, messages=USER, max_tokens=5, extra_body=GREEDY,
                                          thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, b.thinking) for b in hidden.content] == [("thinking", "")] and hidden.usage.output_tokens == 5
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    shaped = await client.messages.create(model=MODEL, messages=USER, max_tokens=120, extra_body=WARM,
                                          output_config={"effort": "low", "format": {"type": "json_schema",
                                                                                     "schema": schema}})
    assert shaped.stop_reason == "end_turn"
    jsonschema.validate(json.loads("".join(b.text for b in shaped.content if b.type == "text")), schema)
    picture = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}},
        {"type": "text", "text": "What is in this picture?"}]}]
    seen = await client.messages.create(model=MODEL, messages=picture, max_tokens=3, extra_body=GREEDY)
    counted = await client.messages.count_tokens(model=MODEL, messages=picture)
    assert counted.input_tokens == seen.usage.input_tokens + seen.usage.cache_read_input_tokens
    text_only = await client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}])
    assert counted.input_tokens - text_only.input_tokens >= 48  # the image's feature rows


def test_messages_through_the_anthropic_client(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = _client(gw)
            await _thinking_like_chat(gw, client)
            await _tool_use_and_result(client)
            await _thinking_off_and_an_image(client)
            metrics = (await gw.http.get("/metrics")).text
            assert 'kdamesh_gateway_requests_total{api="rest",endpoint="messages",status="200"}' in metrics
            await client.close()
    run(main(), timeout_s=150)


BAD = [  # (body changes, status, error type)
    ({"max_tokens": 0}, 400, "invalid_request_error"),
    ({"messages": []}, 400, "invalid_request_error"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, 400, "invalid_request_error"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "invalid_request_error"),
    ({"temperature": 1.5}, 400, "invalid_request_error"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 100000}, 400, "invalid_request_error"),
    ({"model": "nope"}, 404, "not_found_error"),
]


def _check_envelope(reply, status: int, kind: str) -> None:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    assert "param" not in body["error"]  # Anthropic's envelope, not OpenAI's


def test_bad_input_in_the_anthropic_envelope(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, api_keys="ka=alpha",
                                                          tenant_rpm=3) as gw:
            headers = {"x-api-key": "ka"}
            for change, status, kind in BAD:
                reply = await gw.http.post("/v1/messages", headers=headers,
                                           json={"model": MODEL, "messages": USER, "max_tokens": 8, **change})
                _check_envelope(reply, status, kind)
            _check_envelope(await gw.http.post("/v1/messages", json={"model": MODEL, "messages": USER,
                                                                     "max_tokens": 8}), 401, "authentication_error")
            _check_envelope(await gw.http.post("/v1/messages/count_tokens", headers=headers,
                                               json={"model": MODEL}), 400, "invalid_request_error")
            too_big = await gw.http.post("/v1/messages", headers={**headers, "content-type": "application/json"},
                                         content=b" " * ((32 << 20) + 1))
            _check_envelope(too_big, 413, "request_too_large")
            with pytest.raises(anthropic.AuthenticationError):
                await _client(gw, "wrong").messages.create(model=MODEL, messages=USER, max_tokens=2)
            with pytest.raises(anthropic.BadRequestError) as info:
                await _client(gw, "ka").messages.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"top_p": 2.0})
            assert info.value.body["error"]["type"] == "invalid_request_error"
            bearer = await gw.http.post("/v1/messages", headers={"Authorization": "Bearer ka"},
                                        json={"model": MODEL, "messages": USER, "max_tokens": 2})
            assert bearer.status_code == 200 and json.loads(bearer.text)["type"] == "message"
            for _ in range(8):  # past the tenant's requests per minute
                reply = await gw.http.post("/v1/messages", headers=headers,
                                           json={"model": MODEL, "messages": USER, "max_tokens": 1})
                if reply.status_code == 429:
                    break
            _check_envelope(reply, 429, "rate_limit_error")
            assert reply.headers["retry-after"]
    run(main(), timeout_s=120)

