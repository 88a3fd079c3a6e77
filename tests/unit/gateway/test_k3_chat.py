"""Kimi K3 XTML renderer: exact strings for known conversations, text- and id-equality with the official renderer
(`encoding_k3.py` through the official tokenizer's `apply_chat_template`, loaded by path) on 40 varied conversations,
injection safety, and the errors malformed conversations raise."""

from __future__ import annotations

import copy

import pytest

from gateway.chat import ChatFormatError
from gateway.chat.k3 import K3Renderer
from tests.unit.gateway.conversations import TRICKY_TEXTS, Case, cases, injection_chat

O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
K3_CASES = cases(40, "kimi_k3")


@pytest.fixture(scope="module")
def renderer(k3_tok) -> K3Renderer:
    return K3Renderer(k3_tok)


def _message(attrs: str, body: str) -> str:
    return f"{O}message {attrs}{S}{body}{C}message{S}{E}"


# --------------------------------------------------------------------------------------------------------------
# Known conversations, exact strings

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "reasoning_content": "Two cities: call twice.", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
        {"id": "b", "type": "function", "function": {
            "name": "get_weather",
            "arguments": '{"city": "Oslo", "units": null, "alerts": true, "hours": [6, 12]}'}}]},
    {"role": "tool", "tool_call_id": "b", "content": "-2C snow"},  # out of order: matched by id
    {"role": "tool", "tool_call_id": "a", "content": "18C sun"},
    {"role": "assistant", "reasoning_content": "Summarise.", "content": "Paris 18C sun; Oslo -2C snow."},
    {"role": "user", "content": "Thanks!"},
]


def _arg(key: str, kind: str, value: str) -> str:
    return f'{O}argument key="{key}" type="{kind}"{S}{value}{C}argument{S}'


def test_multi_turn_tool_conversation_with_reasoning(renderer):
    tools_json = ('[{"function":{"name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},'
                  '"type":"object"}},"type":"function"}]')
    effort = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
              "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
              "Now the system is invoked with `thinking_effort=low`.")
    calls = (
        f'{O}tools{S}'
        f'{O}call tool="get_weather" index="1"{S}{_arg("city", "string", "Paris")}{_arg("days", "number", "2")}'
        f'{C}call{S}'
        f'{O}call tool="get_weather" index="2"{S}{_arg("city", "string", "Oslo")}{_arg("units", "null", "null")}'
        f'{_arg("alerts", "boolean", "true")}{_arg("hours", "array", "[6, 12]")}{C}call{S}'
        f'{C}tools{S}'
    )
    expected = (
        _message('role="system" type="tool-declare"',
                 f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools_json}\n```")
        + _message('role="system" type="thinking-effort"', effort)
        + _message('role="system"', "You are terse.")
        + _message('role="user"', "Weather in Paris and Oslo?")
        + _message('role="assistant"', f"{O}think{S}Two cities: call twice.{C}think{S}"
                                       f"{O}response{S}Checking.{C}response{S}{calls}")
        + _message('role="tool" tool="get_weather" index="1"', "18C sun")
        + _message('role="tool" tool="get_weather" index="2"', "-2C snow")
        + _message('role="assistant"', f"{O}think{S}Summarise.{C}think{S}"
                                       f"{O}response{S}Paris 18C sun; Oslo -2C snow.{C}response{S}")
        + _message('role="user"', "Thanks!")
        + f'{O}message role="assistant"{S}{O}think{S}'
    )
    low = {"thinking_effort": "low"}
    rendered = renderer.render(WEATHER_CHAT, WEATHER_TOOLS, chat_template_kwargs=low)
    assert rendered.text == expected
    assert renderer.render_text(WEATHER_CHAT, WEATHER_TOOLS, chat_template_kwargs=low) == expected
    assert rendered.starts_in_reasoning


def test_thinking_off_drops_think_blocks_and_opens_response(renderer):
    chat = [{"role": "user", "name": 'a "b" & c', "content": "Hi"},
            {"role": "assistant", "reasoning_content": "hidden", "content": "Hello"},
            {"role": "user", "content": "Again"}]
    rendered = renderer.render(chat, chat_template_kwargs={"thinking": False})
    assert rendered.text == (
        _message('role="user" name="a &quot;b&quot; &amp; c"', "Hi")
        + _message('role="assistant"', f"{O}response{S}Hello{C}response{S}")
        + _message('role="user"', "Again")
        + f'{O}message role="assistant"{S}{O}response{S}'
    )
    assert not rendered.starts_in_reasoning


def test_default_effort_is_max_and_none_omits_it(renderer):
    chat = [{"role": "user", "content": "x"}]
    assert "thinking_effort=max" in renderer.render_text(chat)
    assert "thinking-effort" not in renderer.render_text(chat, chat_template_kwargs={"thinking_effort": None})


def test_images_become_media_tokens(renderer, k3_tok):
    chat = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": "data:,a"}},
        {"type": "text", "text": " and "}, {"type": "image", "image": "b.png"}]}]
    rendered = renderer.render(chat, add_generation_prompt=False, chat_template_kwargs={"thinking": False},
                               image_sizes=[(640, 480), (28, 28)])
    media = "<|media_begin|>image {}<|media_content|><|media_pad|><|media_end|>"
    assert rendered.text == _message('role="user"', f"Compare {media.format('640x480')} and {media.format('28x28')}")
    pad = k3_tok.special_tokens["<|media_pad|>"]
    assert [rendered.token_ids[i] for i in rendered.media_pad_positions] == [pad, pad]
    assert rendered.token_ids.count(pad) == 2


def test_json_block_for_non_json_arguments_and_tool_choice_and_schema(renderer):
    chat = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "x", "function": {"name": "f", "arguments": "{oops"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "done"}]
    text = renderer.render_text(chat, chat_template_kwargs={"thinking": False}, tool_choice="required",
                                response_format={"type": "json_schema",
                                                 "json_schema": {"schema": {"b": 1, "a": {"d": 2, "c": 3}}}})
    assert f'{O}call tool="f" index="1"{S}{O}json type="object"{S}{{oops{C}json{S}{C}call{S}' in text
    assert "You MUST call tools in the next message." in text
    assert '```json\n{"a":{"c":3,"d":2},"b":1}\n```' in text


# --------------------------------------------------------------------------------------------------------------
# Parity with the official renderer

MEDIA_PROMPT = "<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"  # official make_image_prompt


def _official(tokenizer, case: Case, tokenize: bool):
    kwargs = dict(case.kwargs)
    thinking = kwargs.pop("thinking", True)
    extra = dict(kwargs)  # thinking_effort (the official default "max" applies when absent)
    if case.tool_choice is not None:
        extra["tool_choice"] = case.tool_choice
    if case.response_format is not None:
        extra["response_format"] = case.response_format
    if case.image_sizes:
        extra["image_prompts"] = [MEDIA_PROMPT.format(w=w, h=h) for w, h in case.image_sizes]
    return tokenizer.apply_chat_template(copy.deepcopy(case.messages), tools=copy.deepcopy(case.tools),
                                         tokenize=tokenize, add_generation_prompt=case.add_generation_prompt,
                                         thinking=thinking, **extra)


def _ours(renderer: K3Renderer, case: Case):
    return renderer.render(copy.deepcopy(case.messages), case.tools, case.add_generation_prompt, case.kwargs,
                           tool_choice=case.tool_choice, response_format=case.response_format,
                           image_sizes=case.image_sizes)


def test_cases_cover_the_format():
    joined = repr([(c.messages, c.kwargs, c.tool_choice, c.response_format, c.image_sizes) for c in K3_CASES])
    for needle in ("'thinking': False", "'thinking_effort': 'low'", "'required'", "json_schema", "image_url",
                   "{not json", "'tools': [", "'tool_calls'", "reasoning_content", "<|open|>"):
        assert needle in joined, needle


@pytest.mark.parametrize("case", K3_CASES, ids=lambda c: c.name)
def test_equals_official_renderer(renderer, official_k3_tokenizer, case):
    ours = _ours(renderer, case)
    assert ours.text == _official(official_k3_tokenizer, case, tokenize=False)
    assert ours.token_ids == _official(official_k3_tokenizer, case, tokenize=True)


def test_equals_official_segments(renderer, official_k3):
    """The same text straight from `build_chat_segments` (no tokenizer defaults involved)."""
    encoding, _ = official_k3
    for case in K3_CASES[:10]:
        kwargs = {"thinking_effort": "max", **case.kwargs}
        thinking = kwargs.pop("thinking", True)
        images = [MEDIA_PROMPT.format(w=w, h=h) for w, h in case.image_sizes] if case.image_sizes else None
        segments = encoding.build_chat_segments(copy.deepcopy(case.messages), tools=copy.deepcopy(case.tools),
                                                add_generation_prompt=case.add_generation_prompt, thinking=thinking,
                                                image_prompts=images, tool_choice=case.tool_choice,
                                                response_format=case.response_format, **kwargs)
        assert _ours(renderer, case).text == "".join(s.text for s in segments)


# --------------------------------------------------------------------------------------------------------------
# Injection safety


def _injected(tok) -> str:
    return "".join(tok.special_tokens) + "".join(TRICKY_TEXTS)


def _chat(text: str) -> tuple[list, list]:
    return injection_chat(text, second_arguments="{" + text, system_tools=True)  # arguments that are not JSON


def test_request_text_never_becomes_special_ids(renderer, k3_tok):
    specials = k3_tok.special_token_ids
    chat, tools = _chat(_injected(k3_tok))
    benign_chat, benign_tools = _chat("x")
    kwargs = dict(tool_choice="none", response_format={"type": "json_schema", "json_schema": {"schema": {
        _injected(k3_tok): "x"}}})
    rendered = renderer.render(chat, tools, **kwargs)
    benign = renderer.render(benign_chat, benign_tools, tool_choice="none",
                             response_format={"type": "json_schema", "json_schema": {"schema": {"x": "x"}}})
    assert [i for i in rendered.token_ids if i in specials] == [i for i in benign.token_ids if i in specials]
    assert k3_tok.decode(rendered.token_ids) == rendered.text
    assert _injected(k3_tok) in rendered.text


# --------------------------------------------------------------------------------------------------------------
# Errors

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_CONVERSATIONS = {
    "empty": [],
    "not a list": "hello",
    "message not an object": ["hi"],
    "unknown role": [{"role": "robot", "content": "x"}],
    "user without content": [{"role": "user"}],
    "content not text": [{"role": "user", "content": 42}],
    "unknown part": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
    "text part without text": [{"role": "user", "content": [{"type": "text"}]}],
    "tool before any call": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}],
    "tool with unknown id": [{"role": "assistant", "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "zz", "content": "r"}],
    "tool without id": [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "r"}],
    "call answered twice": [{"role": "assistant", "tool_calls": [CALL]},
                            {"role": "tool", "tool_call_id": "c1", "content": "r"},
                            {"role": "tool", "tool_call_id": "c1", "content": "r"}],
    "result for an older call": [{"role": "assistant", "tool_calls": [CALL]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "r"},
                                 {"role": "assistant", "content": "ok"},
                                 {"role": "tool", "tool_call_id": "c1", "content": "r"}],
    "duplicate call ids": [{"role": "assistant", "tool_calls": [CALL, CALL]}],
    "call without id": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
    "call without name": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
    "arguments not an object": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
    "arguments a number": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": 3}}]}],
    "NaN argument": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": {"x": float("nan")}}}]}],
    "tool_calls not a list": [{"role": "assistant", "tool_calls": {"id": "c"}}],
    "name not a string": [{"role": "user", "content": "x", "name": 3}],
    "reasoning not a string": [{"role": "assistant", "content": "x", "reasoning_content": ["r"]}],
}
BAD_TOOLS = {
    "not a list": {"type": "function"},
    "type not function": [{"type": "retrieval", "function": {"name": "f"}}],
    "no function": [{"type": "function"}],
    "bad name": [{"type": "function", "function": {"name": "has space"}}],
    "long name": [{"type": "function", "function": {"name": "x" * 65}}],
    "parameters not an object": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
    "parameters of another type": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
    "duplicate names": [{"type": "function", "function": {"name": "f"}}] * 2,
    "set in a schema": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": {1}}}}],
}
BAD_OPTIONS = {
    "effort medium": dict(chat_template_kwargs={"thinking_effort": "medium"}),
    "unknown kwarg": dict(chat_template_kwargs={"enable_thinking": False}),
    "thinking not bool": dict(chat_template_kwargs={"thinking": "yes"}),
    "tool_choice unknown": dict(tool_choice="sometimes"),
    "response_format type": dict(response_format={"type": "xml"}),
    "response_format schema missing": dict(response_format={"type": "json_schema"}),
    "images without sizes": dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
    "sizes without images": dict(image_sizes=[(1, 1)]),
}


@pytest.mark.parametrize("messages", BAD_CONVERSATIONS.values(), ids=BAD_CONVERSATIONS.keys())
def test_malformed_conversations_raise(renderer, messages):
    with pytest.raises(ChatFormatError):
        renderer.render(messages)


@pytest.mark.parametrize("tools", BAD_TOOLS.values(), ids=BAD_TOOLS.keys())
def test_bad_tool_schemas_raise(renderer, tools):
    with pytest.raises(ChatFormatError):
        renderer.render([{"role": "user", "content": "x"}], tools)


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_raise(renderer, options):
    options = dict(options)
    messages = options.pop("messages", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatFormatError):
        renderer.render(messages, **options)


def test_chat_format_error_is_a_value_error():
    assert issubclass(ChatFormatError, ValueError)
