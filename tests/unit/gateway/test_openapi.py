"""The served /openapi.json documents the request body of every POST endpoint with its fields (schema-driven
clients and fuzzers read it), from the same pydantic models that validate the bodies."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig

# endpoint -> fields its request body schema must list (one of the alternatives for /tokenize)
EXPECTED = {
    "/v1/chat/completions": [{"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                              "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "tools",
                              "tool_choice", "response_format", "chat_template_kwargs", "cache_salt", "priority"}],
    "/v1/completions": [{"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                         "stop", "seed", "logprobs", "echo", "best_of", "return_token_ids", "response_format"}],
    "/tokenize": [{"model", "prompt", "add_special_tokens", "return_token_strs"},
                  {"model", "messages", "add_generation_prompt", "tools", "chat_template_kwargs"}],
    "/detokenize": [{"model", "tokens"}],
    "/v1/responses": [{"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                       "stream", "store", "previous_response_id", "reasoning", "text"}],
    "/v1/messages": [{"model", "messages", "max_tokens", "system", "tools", "tool_choice", "thinking",
                      "stop_sequences", "stream", "output_config"}],
    "/v1/messages/count_tokens": [{"model", "messages", "system", "tools", "thinking"}],
}
REQUIRED = {"/v1/chat/completions": [{"model", "messages"}], "/v1/completions": [{"model", "prompt"}],
            "/tokenize": [{"prompt"}, {"messages"}], "/detokenize": [{"tokens"}],
            "/v1/responses": [{"model", "input"}], "/v1/messages": [{"model", "messages", "max_tokens"}],
            "/v1/messages/count_tokens": [{"model", "messages"}]}


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))  # all the app reads before start
    app = create_app(GatewayConfig(model=str(folder), decode_addresses=("127.0.0.1:1",), mode="colocated"))

    async def fetch() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            reply = await http.get("/openapi.json")
            assert reply.status_code == 200
            return reply.json()
    return asyncio.run(fetch())


def _resolve(spec: dict, schema: dict) -> dict:
    prefix = "#/components/schemas/"
    assert schema["$ref"].startswith(prefix), schema
    return spec["components"]["schemas"][schema["$ref"][len(prefix):]]


def _body_schemas(spec: dict, path: str) -> list[dict]:
    body = spec["paths"][path]["post"]["requestBody"]
    assert body["required"]
    schema = body["content"]["application/json"]["schema"]
    return [_resolve(spec, s) for s in schema.get("oneOf", [schema])]


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_request_bodies_are_documented_with_their_fields(spec, path):
    schemas = _body_schemas(spec, path)
    assert len(schemas) == len(EXPECTED[path])
    for schema, fields, required in zip(schemas, EXPECTED[path], REQUIRED[path]):
        assert schema["type"] == "object"
        assert fields <= set(schema["properties"]), fields - set(schema["properties"])
        assert set(schema.get("required", ())) == required


def test_nested_schemas_resolve_and_carry_the_limits(spec):
    chat = _body_schemas(spec, "/v1/chat/completions")[0]["properties"]
    assert chat["n"]["minimum"] == 1 and chat["n"]["maximum"] == 128
    assert chat["top_p"]["anyOf"][0]["exclusiveMinimum"] == 0
    refs = json.dumps(spec).split('"$ref": "')[1:]
    for ref in refs:  # every reference points at a schema that is there
        _resolve(spec, {"$ref": ref.split('"', 1)[0]})
    prompt = _body_schemas(spec, "/v1/completions")[0]["properties"]["prompt"]
    assert {"string", "array"} == {alt["type"] for alt in prompt["anyOf"]}


def test_the_stored_responses_routes_are_listed(spec):
    assert {"get", "delete"} <= set(spec["paths"]["/v1/responses/{response_id}"])


def test_every_route_declares_its_statuses_and_media_types(spec):
    ops = spec["paths"]
    assert set(ops["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}  # not JSON
    assert "head" in ops["/metrics"] and "head" in ops["/health"]
    chat = ops["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "404", "413", "415", "429", "503", "504"):
        error = chat[status]["content"]["application/json"]["schema"]
        assert error["required"] == ["error"], status
    assert {"400", "413", "415"} <= set(ops["/tokenize"]["post"]["responses"])
    assert "404" in ops["/v1/models/{model_id}"]["get"]["responses"]
    assert "503" in ops["/health"]["get"]["responses"]


def test_the_app_answers_only_declared_statuses_for_bad_requests(spec, tmp_path):
    """Real refusals of the ASGI app (no mesh needed) are each declared for their route."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    app = create_app(GatewayConfig(model=str(tmp_path), decode_addresses=("127.0.0.1:1",), mode="colocated"))

    async def probe() -> list[tuple[str, str, int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            cases = [("post", "/v1/chat/completions", dict(content=b"{", headers={"content-type": "application/json"})),
                     ("post", "/v1/completions", dict(content=b"{}", headers={"content-type": "text/plain"})),
                     ("post", "/tokenize", dict(content=b"[]", headers={"content-type": "application/json"}))]
            return [(method, path, (await http.request(method.upper(), path, **kwargs)).status_code)
                    for method, path, kwargs in cases]

    for method, path, status in asyncio.run(probe()):
        assert 400 <= status < 500 and str(status) in spec["paths"][path][method]["responses"], (path, status)
