"""End to end: `kdamesh up` (with `KDAMESH_API_KEYS` in its environment) on tiny-k3, driven by the official `openai`
client over REST and by the SDK over the gateway's gRPC API: chat with reasoning, a forced tool call valid against
its schema, json_schema output, per-tenant cache isolation, typed errors; SIGTERM stops everything."""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import openai
import pytest

import sdk
from tests.e2e.launched import launch, stop

MODEL = "tiny-k3"
MESSAGES = [{"role": "user", "content": "Plan a weekend trip to the mountains for two friends who like hiking, "
                                        "photography and good food; list what to pack."}]
TOOL = {"type": "function", "function": {"name": "book_hut", "parameters": {
    "type": "object", "properties": {"nights": {"type": "integer", "minimum": 1, "maximum": 3},
                                     "name": {"type": "string", "maxLength": 8}},
    "required": ["nights", "name"]}}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("e2e-openai"), "gateway_grpc ",
                      env={**os.environ, "KDAMESH_API_KEYS": "key-a=tenant-a,key-b=tenant-b"})
    yield {"proc": launched.proc, "port": launched.port, "grpc": launched.line.split()[0], "log": launched.log}
    stop(launched.proc)


def _client(mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh['port']}/v1", api_key=key, max_retries=0, timeout=60)


def test_rest_and_grpc_apis_of_the_launched_mesh(mesh):
    a, b = _client(mesh, "key-a"), _client(mesh, "key-b")
    assert [m.id for m in a.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        _client(mesh, "wrong").models.list()

    reply = a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.reasoning_content and reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    # Tenant isolation: B's identical prompt misses; A's repeat hits.
    assert b.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens == 0
    assert a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens > 0

    stream = a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.reasoning_content

    forced = a.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TOOL], max_tokens=120,
                                       temperature=0.7, seed=2,
                                       tool_choice={"type": "function", "function": {"name": "book_hut"}})
    [call] = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 6},
                                                         "maxItems": 3}}, "required": ["items"]}
    shaped = a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "packing", "schema": schema}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)

    with pytest.raises(openai.NotFoundError):
        a.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        a.chat.completions.create(model=MODEL, messages=MESSAGES, n=0)

    # The SDK over the gateway's gRPC port: the same greedy tokens as REST.
    with sdk.Client(mesh["grpc"], api_key="key-a", timeout=60) as client:
        same = client.chat(MODEL, MESSAGES, sampling=sdk.Sampling(max_tokens=8, temperature=0))
        assert same.choices[0].message.reasoning_content == reply.choices[0].message.reasoning_content
        assert same.usage.cached_tokens > 0
    with sdk.Client(mesh["grpc"], timeout=30) as anonymous:
        with pytest.raises(sdk.Unauthenticated):
            anonymous.chat(MODEL, MESSAGES)


def test_sigterm_stops_the_mesh(mesh):
    proc = mesh["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert "stopping the mesh" in mesh["log"].read_text()
