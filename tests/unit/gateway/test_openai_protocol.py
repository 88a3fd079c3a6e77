"""The gateway's wire protocol without a mesh: request validation and sampling mapping, the gRPC -> REST body
translation, per-choice text (stop strings, stop tokens, special tokens), error mapping, and the SDK's pure parts
(requests, folding chunks, retry backoff, error classes), plus import hygiene."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import sdk
from engine.tokenizer import KimiTokenizer
from gateway.grpc_translate import chat_body, generate_body
from gateway.mesh_client import TokenEvent
from gateway.protocol import (ApiError, ChatCompletionRequest, ClientGone, failure_of, mesh_api_error, parse_chat,
                              parse_completion, parse_detokenize, parse_tokenize, sampling_from_chat)
from gateway.text import ChoiceText, TextRules
from protos import common_pb2, gateway_pb2
from sdk.errors import from_rpc_error
from sdk.requests import chat_request, generate_request
from sdk.responses import ChatAccumulator, chat_chunk
from sdk.types import ChatOptions, RetryPolicy, Sampling

ROOT = Path(__file__).resolve().parents[3]
SERVED = {"m"}
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _error(body, served=SERVED) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat(body, served)
    return info.value


def test_chat_defaults_and_sampling():
    request = parse_chat({"model": "m", "messages": MSG, "unknown_field": 1}, SERVED)
    assert request.n == 1 and request.completion_limit is None and request.effective_tool_choice is None
    sampling = sampling_from_chat(request, skip_special_tokens=True)
    assert not sampling.HasField("max_tokens") and not sampling.HasField("temperature")
    assert sampling.n == 1 and sampling.skip_special_tokens and not sampling.logprobs

    request = parse_chat({"model": "m", "messages": MSG, "max_tokens": 5, "max_completion_tokens": 7, "seed": -1,
                          "temperature": 0, "stop": "END", "logprobs": True, "top_logprobs": 3, "n": 2,
                          "top_k": 4, "repetition_penalty": 1.1}, SERVED)
    sampling = sampling_from_chat(request, skip_special_tokens=False)
    assert sampling.max_tokens == 7 and sampling.seed == (1 << 64) - 1 and sampling.temperature == 0
    assert list(sampling.stop) == ["END"] and sampling.top_logprobs == 3 and sampling.n == 2
    assert sampling.top_k == 4 and abs(sampling.repetition_penalty - 1.1) < 1e-6
    assert not sampling.skip_special_tokens


def test_tool_choice_defaults_like_vllm():
    assert parse_chat({"model": "m", "messages": MSG, "tools": [TOOL]}, SERVED).effective_tool_choice == "auto"
    assert parse_chat({"model": "m", "messages": MSG, "tool_choice": "none"}, SERVED).effective_tool_choice is None
    named = parse_chat({"model": "m", "messages": MSG, "tools": [TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "f"}}}, SERVED)
    assert named.effective_tool_choice == {"type": "function", "function": {"name": "f"}}
    assert _error({"model": "m", "messages": MSG, "tool_choice": "required"}).param == "tool_choice"
    assert _error({"model": "m", "messages": MSG, "tools": [TOOL], "tool_choice": "maybe"}).param == "tool_choice"


@pytest.mark.parametrize("body, status, param", [
    ({"messages": MSG}, 400, "model"),
    ({"model": "x", "messages": MSG}, 404, "model"),
    ({"model": "m", "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "m", "messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"model": "m", "messages": MSG, "top_p": 0}, 400, "top_p"),
    ({"model": "m", "messages": MSG, "logit_bias": {"a": 2}}, 400, "logit_bias"),
    ({"model": "m", "messages": MSG, "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"model": "m", "messages": MSG, "stream_options": {}}, 400, "stream_options"),
    ({"model": "m", "messages": MSG, "seed": 1 << 64}, 400, "seed"),
    ([], 400, None),
])
def test_chat_validation_errors(body, status, param):
    error = _error(body)
    assert (error.status, error.param) == (status, param)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def _called(arguments) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "ok"}]


@pytest.mark.parametrize("body, param, says", [
    ({"stop": "x" * 1_000_000}, "stop", "at most 2048 characters"),
    ({"stop": ["fine", "y" * 2049]}, "stop", "at most 2048 characters"),
    ({"request_id": "r" * 1_000_000}, "request_id", "at most 256"),
    ({"cache_salt": "s" * 257}, "cache_salt", "at most 256"),
    ({"user": "u" * 1_000_000}, "user", "at most 256"),
    ({"messages": _called({"city": "Paris"})}, "messages", "tool_calls[0].function.arguments must be a string"),
    ({"messages": _called(7)}, "messages", "must be a string of JSON text, got int"),
    ({"messages": _called("{not json")}, "messages", "tool_calls[0].function.arguments is not valid JSON"),
])
def test_oversized_strings_and_non_json_tool_arguments_are_400s(body, param, says):
    """Issue 27 point 5: refused with a 400 naming the field (they used to be accepted)."""
    error = _error({"model": "m", "messages": MSG, **body})
    assert (error.status, error.param) == (400, param) and says in error.message, error.message


def test_the_limits_admit_what_they_should():
    """The negative control of the limits above: at the limit, and JSON arguments (also empty or null), pass."""
    for body in ({"stop": "x" * 2048}, {"request_id": "r" * 256, "cache_salt": "s" * 256, "user": "u" * 256},
                 {"messages": _called('{"city": "Paris"}')}, {"messages": _called("")},
                 {"messages": _called(None)}):
        parse_chat({"model": "m", "messages": MSG, **body}, SERVED)


def test_tokenize_detokenize_and_completions_parsing():
    assert parse_tokenize({"prompt": "abc"}, SERVED).prompt == "abc"
    assert parse_tokenize({"model": "m", "messages": MSG}, SERVED).add_generation_prompt
    with pytest.raises(ApiError):
        parse_tokenize({"prompt": "a", "messages": MSG}, SERVED)
    assert parse_detokenize({"tokens": [1, 2]}, SERVED, vocab_size=10).tokens == [1, 2]
    with pytest.raises(ApiError):
        parse_detokenize({"tokens": [10]}, SERVED, vocab_size=10)

    class Tok:
        vocab_size = 100

        def encode(self, text, allow_special=False):
            return [ord(c) % 100 for c in text]

    job = parse_completion({"model": "m", "prompt": "ab", "priority": 3, "cache_salt": "s", "user": "u",
                            "return_token_ids": True}, Tok(), SERVED)
    request = job.request
    assert (request.priority, request.cache_salt, request.user, request.return_token_ids, job.max_tokens) == \
           (3, "s", "u", True, 16)


def test_mesh_errors_map_to_statuses():
    error = mesh_api_error(grpc.StatusCode.INVALID_ARGUMENT, "this model's maximum context length is 5 tokens",
                           "messages")
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert mesh_api_error(grpc.StatusCode.UNAVAILABLE, "down").status == 503
    assert mesh_api_error(grpc.StatusCode.DEADLINE_EXCEEDED, "slow").status == 504
    assert ApiError(429, "x").grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ApiError(401, "x").grpc_code == grpc.StatusCode.UNAUTHENTICATED


class _Tok:
    vocab_size = 100

    def encode(self, text, allow_special=False):
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize("field, value", [("top_p", 0), ("temperature", -1), ("n", 0), ("stop", [""]),
                                          ("seed", 1 << 64), ("presence_penalty", 3), ("logit_bias", {"-1": 2})])
def test_completions_validate_sampling_fields_as_chat_does(field, value):
    with pytest.raises(ApiError) as chat:
        parse_chat({"model": "m", "messages": MSG, field: value}, SERVED)
    with pytest.raises(ApiError) as completion:
        parse_completion({"model": "m", "prompt": "hi", field: value}, _Tok(), SERVED)
    assert completion.value.status == chat.value.status == 400
    assert completion.value.param == chat.value.param == field


def test_completion_nulls_take_defaults_and_prompts_are_checked():
    job = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": None, "n": None, "stream": None},
                           _Tok(), SERVED)
    assert job.max_tokens == 16 and job.request.n == 1 and not job.request.stream
    assert job.prompts == [[1, 2], [3]] and job.prompt_texts == [None, None]
    for prompt in ("", [], [[]], [1, "a"], [True], [[1], "a"], [100]):
        with pytest.raises(ApiError) as info:
            parse_completion({"model": "m", "prompt": prompt}, _Tok(), SERVED)
        assert info.value.param == "prompt", prompt


def test_one_failure_mapping():
    assert failure_of(ApiError(429, "slow down", code="rate_limit_exceeded")) == ("rate_limit_exceeded", 429)
    assert failure_of(ApiError(400, "bad")) == ("invalid_request_error", 400)
    assert failure_of(ClientGone()) == ("cancelled", 499)
    assert failure_of(asyncio.CancelledError()) == ("cancelled", 499)
    assert failure_of(KeyError("x")) == ("KeyError", 500)


def test_grpc_requests_become_the_same_rest_requests():
    """The SDK's request, translated by the gateway, validates to what the equivalent REST body gives."""
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "", "reasoning_content": "hmm",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    sampling = Sampling(max_tokens=9, temperature=0.5, seed=3, stop=["x"], logprobs=True, top_logprobs=2, n=2)
    options = ChatOptions(tools=[TOOL], tool_choice="f", response_format={"type": "json_object"},
                          chat_template_kwargs={"thinking": False})
    proto = chat_request("m", messages, sampling, options, cache_salt="cs", user="u", priority=4, request_id="r")
    via_grpc = parse_chat(chat_body(gateway_pb2.ChatRequest.FromString(proto.SerializeToString())), SERVED)
    direct = parse_chat({"model": "m", "messages": messages, "max_completion_tokens": 9, "temperature": 0.5,
                         "seed": 3, "stop": ["x"], "logprobs": True, "top_logprobs": 2, "n": 2, "tools": [TOOL],
                         "tool_choice": {"type": "function", "function": {"name": "f"}},
                         "response_format": {"type": "json_object"}, "chat_template_kwargs": {"thinking": False},
                         "cache_salt": "cs", "user": "u", "priority": 4, "request_id": "r",
                         "parallel_tool_calls": True}, SERVED)
    assert sampling_from_chat(via_grpc, True) == sampling_from_chat(direct, True)
    for name in ("messages", "tools", "tool_choice", "response_format", "chat_template_kwargs", "cache_salt",
                 "user", "priority", "request_id", "parallel_tool_calls"):
        got, want = getattr(via_grpc, name), getattr(direct, name)
        if name == "messages":
            got = [{k: v for k, v in m.items() if v is not None} for m in got]
            want = [{k: v for k, v in m.items() if v is not None} for m in want]
            want[1]["content"] = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        assert got == want, name

    generate = generate_request("m", [1, 2, 3], Sampling(max_tokens=4, logprobs=True, top_logprobs=1), echo=True,
                                return_token_ids=True, cache_salt=None, user=None, priority=0, request_id=None)
    body = generate_body(generate)
    assert body["prompt"] == [1, 2, 3] and body["logprobs"] == 1 and body["max_tokens"] == 4 and body["echo"]


def test_grpc_bodies_refuse_bad_json():
    request = gateway_pb2.ChatRequest(model="m", chat_template_kwargs_json="{nope")
    with pytest.raises(ApiError) as info:
        chat_body(request)
    assert info.value.param == "chat_template_kwargs"
    request = gateway_pb2.ChatRequest(model="m", tools=[gateway_pb2.Tool(function=gateway_pb2.FunctionDefinition(
        name="f", parameters_json="[1,"))])
    with pytest.raises(ApiError):
        chat_body(request)
    request = gateway_pb2.ChatRequest(model="m", sampling=common_pb2.SamplingParams(
        structured_output=common_pb2.StructuredOutput(kind=common_pb2.StructuredOutput.KIND_JSON_OBJECT)))
    with pytest.raises(ApiError):
        chat_body(request)


# -- per-choice text ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_tokenizer(k3_dir) -> KimiTokenizer:
    return KimiTokenizer.from_pretrained(k3_dir)


def _events(tokenizer, text: str) -> list[TokenEvent]:
    return [TokenEvent(0, [t]) for t in tokenizer.encode(text)]


def test_choice_text_holds_back_and_cuts_stop_strings(k3_tokenizer):
    choice = ChoiceText(k3_tokenizer, TextRules(stop=("STOP",)))
    out = "".join(choice.add(e) for e in _events(k3_tokenizer, "hello there STOP and more"))
    assert out == "hello there " and choice.finish_reason == "stop" and choice.stop_reason == "STOP"


def test_choice_text_drops_stop_tokens_and_unknown_specials(k3_tokenizer):
    specials = k3_tokenizer.special_tokens
    eom, open_, reserved = specials["<|end_of_msg|>"], specials["<|open|>"], specials["[EOT]"]
    rules = TextRules(skip_special_tokens=False, keep_special_ids=frozenset({open_}))
    choice = ChoiceText(k3_tokenizer, rules)
    text = choice.add(TokenEvent(0, [open_, reserved] + k3_tokenizer.encode("ok")))
    text += choice.add(TokenEvent(0, [eom], finish_reason="stop", stop_token_id=eom))
    assert text == "<|open|>ok" and choice.finish_reason == "stop"
    # vLLM's stop_reason: the stop token id, unless it is the model's own EOS
    assert choice.stop_reason == (None if eom in k3_tokenizer.stop_token_ids else eom)
    assert choice.token_ids[-1] == eom


# -- the SDK's pure parts -----------------------------------------------------------------------------------------


def test_sdk_folds_chunks_and_maps_errors():
    def response(**choice) -> gateway_pb2.ChatResponse:
        return gateway_pb2.ChatResponse(id="c", model="m", created=1, choices=[gateway_pb2.ChatChoice(**choice)])

    acc = ChatAccumulator()
    acc.add(chat_chunk(response(index=0, delta=gateway_pb2.ChatDelta(role="assistant"))))
    acc.add(chat_chunk(response(index=0, delta=gateway_pb2.ChatDelta(reasoning_content="think "))))
    acc.add(chat_chunk(response(index=0, delta=gateway_pb2.ChatDelta(tool_calls=[
        gateway_pb2.ToolCallDelta(index=0, id="i", type="function", name="f")]))))
    acc.add(chat_chunk(response(index=0, delta=gateway_pb2.ChatDelta(tool_calls=[
        gateway_pb2.ToolCallDelta(index=0, arguments='{"a": 1}')]))))
    last = response(index=0, delta=gateway_pb2.ChatDelta(), finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS)
    last.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2))
    acc.add(chat_chunk(last))
    done = acc.result()
    choice = done.choices[0]
    assert choice.message.reasoning_content == "think " and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].parsed_arguments() == {"a": 1} and choice.message.tool_calls[0].id == "i"
    assert done.usage == sdk.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2)
    assert done.usage != sdk.Usage(prompt_tokens=3, completion_tokens=4)  # negative control: cached tokens count

    class FakeError(grpc.RpcError):
        def __init__(self, code, trailers=()):
            self._code, self._trailers = code, trailers

        def code(self):
            return self._code

        def details(self):
            return "why"

        def trailing_metadata(self):
            return self._trailers

    limited = from_rpc_error(FakeError(grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after", "7"),)))
    assert isinstance(limited, sdk.RateLimited) and limited.retry_after == 7.0
    for code, cls in ((grpc.StatusCode.INVALID_ARGUMENT, sdk.InvalidRequest),
                      (grpc.StatusCode.UNAUTHENTICATED, sdk.Unauthenticated),
                      (grpc.StatusCode.NOT_FOUND, sdk.NotFound), (grpc.StatusCode.UNAVAILABLE, sdk.Unavailable),
                      (grpc.StatusCode.DEADLINE_EXCEEDED, sdk.DeadlineExceeded),
                      (grpc.StatusCode.DATA_LOSS, sdk.InternalError)):
        error = from_rpc_error(FakeError(code))
        assert isinstance(error, cls) and isinstance(error, sdk.KdameshError) and error.message == "why"


def test_retry_backoff_is_bounded_and_jittered():
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2.0, jitter=0.5)
    assert [round(policy.backoff(k, 0.5), 6) for k in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]
    assert policy.backoff(1, 0.0) == pytest.approx(0.05) and policy.backoff(1, 0.999999) < 0.15
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_import_hygiene():
    """sdk -> protos and grpc only; the gateway loads neither torch nor the engine's model code."""
    code = ("import sys, sdk; bad = {m.split('.')[0] for m in sys.modules} & {'torch', 'engine', 'gateway', "
            "'kernels', 'numpy'}; assert not bad, bad; "
            "import gateway.app, gateway.grpc_api; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert ChatCompletionRequest.model_fields["tool_choice"]  # the model is importable without a server
