"""Fuzzing the running gateway (over the in-process tiny-k3 mesh): a hand-written table of malformed requests of
distinct kinds, then schemathesis generating requests from the served /openapi.json — not one response is a 5xx,
every response conforms to the document (its status declared, its media type declared, its body valid against the
declared schema: schemathesis' conformance checks), and the one keep-alive connection the table uses still serves
after every request. Negative control: the document with `/metrics` declared JSON fails the media type check."""

from __future__ import annotations

import asyncio
import json

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from gateway.protocol.common import UINT32_MAX

from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh
from tests.integration.test_gateway_robustness import KeepAlive

MODEL = "tiny-k3"
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
BIG = 10 ** 30

# field -> bad values, applied to the chat body and the completion body alike
FIELD_VALUES = {
    "model": [None, 5, "", [MODEL], {"id": MODEL}, "x" * 10_000],
    "max_tokens": [-1, 0, 1.5, "2", True, BIG, [2], 2 ** 32],
    "n": [0, -3, "2", 129, 2.0, BIG, None],
    "temperature": [-1, "1", BIG, 1e39, [0.5], True],
    "top_p": [0, -0.1, 1.01, "0.5", {}],
    "top_k": [-2, 2 ** 31, BIG, "5", 1.5],
    "min_p": [-0.5, 1.5, "0"],
    "presence_penalty": [3, -3, "0", BIG],
    "frequency_penalty": [2.5, [], None],
    "repetition_penalty": [0, -1, "1.1", 1e40],
    "seed": [2 ** 64, -(2 ** 63) - 1, "7", 1.5],
    "stop": [5, [""], [1, 2], ["x"] * 17, {"a": 1}, [None]],
    "stop_token_ids": [[-1], [2 ** 32], "1", [1.5], [[1]], [0] * 1025],
    "min_tokens": [-1, 2 ** 32, "1", 10],
    "ignore_eos": ["true", 1, None],
    "stream": ["yes", 1, "false", {}],
    "stream_options": [{"include_usage": True}, "x", {"include_usage": "yes"}],
    "response_format": ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema",
                                                                            "json_schema": {"schema": 5}}],
    "priority": [2 ** 31, "high", 1.5],
    "user": [5, ["u"], {}],
    "logit_bias": [{"1": 5}, "x", [1]],
    "cache_salt": [5, ["s"]],
    "request_id": [5, {}],
    "skip_special_tokens": ["no"],
    "include_stop_str_in_output": [2],
}
CHAT_ONLY = {
    "messages": [[], "hi", [1], [{"role": "user"}], [{"role": "x", "content": "a"}], [{"content": "a"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "audio"}]}],
                 [{"role": "tool", "content": "a"}], [{"role": "assistant", "tool_calls": "x"}],
                 [{"role": "user", "content": None}], [{"role": "user", "content": [{"type": "text"}]}]],
    "max_completion_tokens": [0, 2 ** 32, "3"],
    "logprobs": [1, "true"],
    "top_logprobs": [-1, 21, "3", 5],
    "tools": ["f", [{}], [{"type": "function"}], [{"type": "function", "function": {"name": 5}}]],
    "tool_choice": ["maybe", {"type": "function"}, 5, "required"],
    "chat_template_kwargs": ["x", {"thinking": "maybe"}, {"thinking": 5}],
    "parallel_tool_calls": ["yes"],
    "prompt_logprobs": [1, "x"],
    "continue_final_message": [True, "no"],
    "add_generation_prompt": ["no"],
}
COMPLETION_ONLY = {
    "prompt": [None, "", [], [""], [[]], [1, "a"], [-1], [10 ** 9], [[1], "a"], {"text": "hi"}, 5, [[1.5]]],
    "logprobs": [-1, 21, "1", True],
    "best_of": [0, 3, "1", BIG],
    "suffix": ["x", 5],
    "echo": ["yes"],
    "return_token_ids": ["1"],
}
# raw bodies (sent as application/json) per endpoint
RAW = {
    "/v1/chat/completions": [
        b"", b"{", b"null", b"[]", b'"x"', b"1e999999", b"\xff\xfe\x00", b'{"model": "\\ud800", "messages": []}',
        b"[" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000],
    "/v1/completions": [
        b'{"model": "tiny-k3", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"model": "tiny-k3", "prompt": "hi", "n": NaN}', b'{"model": "tiny-k3", "prompt": "hi", "model": 5}',
        b'{"model": "tiny-k3", "prompt": "hi", "temperature": -Infinity}'],
    "/tokenize": [b'{"prompt": 5}', b'{"prompt": "a", "messages": []}', b'{"messages": [{"role": 1}]}',
                  b'{"prompt": "a", "add_special_tokens": "yes"}'],
    "/detokenize": [b'{"tokens": [1e3]}', b'{"tokens": [99999999999999999999]}', b'{"tokens": "1,2"}',
                    b'{"tokens": [[1]]}'],
    "/v1/responses": [b"{", b'{"model": "tiny-k3", "input": [5]}', b'{"model": "tiny-k3", "input": [{"type": 5}]}',
                      b'{"model": "tiny-k3", "input": [{"role": "user", "content": [null]}]}',
                      b'{"model": "tiny-k3", "input": [{"type": "function_call_output", "output": 5}]}',
                      b'{"model": "tiny-k3", "input": [{"type": "reasoning", "content": "x"}]}',
                      b'{"model": "tiny-k3", "input": "x", "tools": [{"type": "function"}]}',
                      b'{"model": "tiny-k3", "input": "x", "previous_response_id": 5}'],
    "/v1/messages": [b"[]", b'{"model": "tiny-k3", "max_tokens": 2, "messages": [{"role": "user", "content": 5}]}',
                     b'{"model": "tiny-k3", "max_tokens": 2, "messages": [{"role": "user", "content": [5]}]}',
                     b'{"model": "tiny-k3", "max_tokens": 2, "messages": [{"role": "assistant", "content": [{}]}]}',
                     b'{"model": "tiny-k3", "max_tokens": 2, "system": [5], "messages": [{"role": "user"}]}',
                     b'{"model": "tiny-k3", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": '
                     b'"image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}]}]}',
                     b'{"model": "tiny-k3", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": '
                     b'"tool_result", "tool_use_id": "x", "content": [5]}]}]}'],
    "/v1/messages/count_tokens": [b'{"model": "tiny-k3", "messages": [{"role": "user", "content": [{}]}]}',
                                  b'{"model": "tiny-k3", "messages": "x"}'],
}
# a good body under other content types
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", None, "multipart/form-data; boundary=x",
                 "application/jsonx", "text/json"]


def _table() -> list[tuple[str, dict | bytes, str | None]]:
    cases: list = []
    for path, base, only in (("/v1/chat/completions", CHAT, CHAT_ONLY),
                             ("/v1/completions", COMPLETION, COMPLETION_ONLY)):
        for field, values in {**FIELD_VALUES, **only}.items():
            cases += [(path, {**base, field: value}, "application/json") for value in values]
    cases += [(path, body, "application/json") for path, bodies in RAW.items() for body in bodies]
    return cases + [("/v1/completions", COMPLETION, content_type) for content_type in CONTENT_TYPES]


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def test_the_malformed_request_table_never_gets_a_5xx_and_keeps_the_connection(tiny_k3):
    table = _table()
    assert len(table) >= 100

    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3) as gw, KeepAlive(gw.config.http_port) as c:
            failures = []
            for path, body, content_type in table:
                reply = await c.post(path, body, content_type)  # fails if the connection was dropped
                if reply.status >= 500:
                    failures.append((path, str(body)[:120], reply.status, reply.body[:200]))
            assert not failures, "\n".join(map(str, failures))
            assert (await c.request("GET", "/health")).status == 200

    run(main(), timeout_s=150)


# -- schemathesis: requests generated from the served OpenAPI spec -------------------------------------------------

# examples per operation and generation mode; every POST operation gets both modes: 4 x (150 + 350) for chat,
# completions, tokenize and detokenize, 3 x (60 + 140) for the translated APIs (responses, messages, count_tokens,
# which reach the same chat path): 2,600 cases
SPEC_EXAMPLES = {GenerationMode.POSITIVE: 150, GenerationMode.NEGATIVE: 350}
TRANSLATED = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
TRANSLATED_EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 140}
GET_EXAMPLES = 15
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]


def _bounded(case, mode: GenerationMode) -> None:
    """Keeps a generated request cheap without changing whether it is valid: a valid `max_tokens` (or
    `max_completion_tokens`, or the Responses API's `max_output_tokens`) becomes at most 4, a valid `n` at most 2,
    and a chat request without a limit gets 4; a valid request names the served model (so it gets past the model
    check)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if mode == GenerationMode.POSITIVE and isinstance(body.get("model"), str):
        body["model"] = MODEL
    for field, cap, top in (("max_tokens", 4, UINT32_MAX), ("max_completion_tokens", 4, UINT32_MAX),
                            ("max_output_tokens", 4, UINT32_MAX), ("n", 2, 128)):
        value = body.get(field)
        if type(value) is int and 1 <= value <= top:
            body[field] = min(value, cap)
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4


def _conformance_failure(case, reply) -> str | None:
    """What schemathesis' conformance checks find wrong with `reply` (None: it conforms)."""
    try:
        case.validate_response(reply, checks=CONFORMANCE)
    except FailureGroup as exc:  # schemathesis: every failed check of the response
        found = "; ".join(str(e).splitlines()[0][:120] for e in exc.exceptions)
        return f"{case.method} {case.path} -> {reply.status_code} {reply.headers.get('content-type')}: {found}"
    return None


def _fuzz_operation(operation, base_url: str, session, mode: GenerationMode, examples: int, seen: list,
                    failures: list) -> None:
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    def one(case):
        _bounded(case, mode)
        reply = case.call(base_url=base_url, session=session, timeout=30)
        seen.append(reply.status_code)
        assert reply.status_code < 500, (case.method, case.path, case.body, reply.status_code, reply.text[:300])
        failure = _conformance_failure(case, reply)
        if failure is not None:
            failures.append(failure)

    one()


def _fuzz_spec(base_url: str, spec: dict) -> tuple[list[int], list[str]]:
    schema = schemathesis.openapi.from_dict(spec)
    seen: list[int] = []
    failures: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = {GenerationMode.POSITIVE: GET_EXAMPLES} if operation.method.upper() != "POST" else (
                TRANSLATED_EXAMPLES if operation.path in TRANSLATED else SPEC_EXAMPLES)
            for mode, examples in modes.items():
                _fuzz_operation(operation, base_url, session, mode, examples, seen, failures)
    return seen, failures


def _metrics_declared_json_fails(base_url: str, spec: dict) -> str | None:
    """The negative control: GET /metrics checked against a copy of the document that declares it JSON."""
    wrong = json.loads(json.dumps(spec))
    wrong["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"application/json": {"schema": {}}}
    operation = schemathesis.openapi.from_dict(wrong)["/metrics"]["GET"]
    case = operation.Case()
    with requests.Session() as session:
        return _conformance_failure(case, case.call(base_url=base_url, session=session, timeout=30))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_schemathesis_over_the_served_spec_never_gets_a_5xx(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 512}) as mesh, \
                running_gateway(mesh, tiny_k3, max_model_len=256) as gw:
            spec = (await gw.http.get("/openapi.json")).json()
            seen, failures = await asyncio.to_thread(_fuzz_spec, gw.base_url, spec)
            control = await asyncio.to_thread(_metrics_declared_json_fails, gw.base_url, spec)
        assert len(seen) >= 2600 and max(seen) < 500
        assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)  # both kinds reached the gateway
        assert not failures, f"{len(failures)} response conformance failures:\n" + "\n".join(sorted(set(failures)))
        assert control is not None and "/metrics" in control  # the checks do catch an undeclared media type

    run(main(), timeout_s=570)
