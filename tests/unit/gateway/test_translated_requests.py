"""Requests of the Responses API (gateway/responses/) and the Anthropic Messages API (gateway/anthropic/) as the chat
requests that serve them: input items and content blocks become the chat messages a chat client would send, the
options the chat fields, and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import pytest

from gateway.anthropic.protocol import error_body, parse_count_tokens, parse_messages
from gateway.anthropic.render import arguments_object
from gateway.anthropic.translate import chat_body as anthropic_chat_body, chat_messages
from gateway.protocol import ApiError, parse_chat
from gateway.responses.protocol import parse_response_request
from gateway.responses.translate import chat_body, input_messages

SERVED = {"m"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _responses(**body):
    request = parse_response_request({"model": "m", **body}, SERVED)
    chat = chat_body(request, [], input_messages(request))
    parse_chat(chat, SERVED)  # the chat API takes what the translation makes
    return chat


def test_responses_input_items_fold_into_chat_turns():
    chat = _responses(instructions="be brief", tools=[TOOL], tool_choice={"type": "function", "name": "f"},
                      max_output_tokens=7, reasoning={"effort": "low"},
                      text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}}}, input=[
                          {"role": "developer", "content": "house rules"},
                          {"type": "message", "role": "user", "content": [
                              {"type": "input_text", "text": "look: "},
                              {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
                          {"type": "reasoning", "id": "rs_1", "summary": [],
                           "content": [{"type": "reasoning_text", "text": "hmm"}]},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
                          {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'},
                          {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "house rules"},
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "calling", "reasoning_content": "hmm", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}} and chat["max_tokens"] == 7
    assert chat["chat_template_kwargs"] == {"thinking": True, "thinking_effort": "low"}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "r",
                                                                              "schema": {"type": "object"}}}
    assert _responses(input="hi", reasoning={"effort": "none"})["chat_template_kwargs"] == {"thinking": False}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
])
def test_responses_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        _responses(**body)
    assert info.value.status == 400 and info.value.param == param


def _anthropic(**body):
    request = parse_messages({"model": "m", "max_tokens": 5000, **body}, SERVED)
    chat = anthropic_chat_body(request, chat_messages(request))
    parse_chat(chat, SERVED)
    return chat


def test_anthropic_blocks_become_chat_turns():
    tool = {"name": "f", "input_schema": {"type": "object"}}
    chat = _anthropic(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], tools=[tool],
                      tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
                      thinking={"type": "enabled", "budget_tokens": 2048}, metadata={"user_id": "u1"}, messages=[
                          {"role": "user", "content": [{"type": "image", "source": {
                              "type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                          {"role": "assistant", "content": [
                              {"type": "thinking", "thinking": "hmm", "signature": ""},
                              {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}]},
                          {"role": "user", "content": [
                              {"type": "text", "text": "and?"},
                              {"type": "tool_result", "tool_use_id": "call_1", "is_error": True,
                               "content": [{"type": "text", "text": "boom"}]}]}])
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Error: boom"},  # the results first
        {"role": "user", "content": [{"type": "text", "text": "and?"}]}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["user"] == "u1"
    assert chat["chat_template_kwargs"] == {"thinking": True}
    assert arguments_object('{"a": 1}') == {"a": 1} and arguments_object("[1]") == {"arguments": "[1]"}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 9000}},
     "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "container": "c"}, "container"),
])
def test_anthropic_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        _anthropic(**body)
    assert info.value.status == 400 and info.value.param == param
    envelope = error_body(info.value, "req-1")
    assert envelope["type"] == "error" and envelope["request_id"] == "req-1"
    assert envelope["error"]["type"] == "invalid_request_error" and param in envelope["error"]["message"]


def test_count_tokens_needs_no_max_tokens_and_errors_map_by_status():
    assert parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "x"}]}, SERVED)
    kinds = {status: error_body(ApiError(status, "x"))["error"]["type"] for status in (401, 404, 413, 429, 500, 503)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
