"""Kimi K2 / Kimi Linear renderer (kdamesh's Jinja2 template): exact strings for known conversations, equality with
`transformers`' `apply_chat_template` on 30 varied conversations, injection safety, the escaper, template loading,
and errors."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.chat import ChatFormatError, k2_chat_template, load_chat_template, write_k2_chat_template
from gateway.chat.k2 import Escaper, K2Renderer, prepare_conversation
from tests.unit.gateway.conversations import TRICKY_TEXTS, cases, has_special_lookalikes, injection_chat

SEEDED = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                  suppress_health_check=[HealthCheck.too_slow])
DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
K2_CASES = cases(30, "kimi_linear")


@pytest.fixture(scope="module")
def renderer(k2_tok) -> K2Renderer:
    return K2Renderer(k2_tok, k2_chat_template())


# --------------------------------------------------------------------------------------------------------------
# Known conversations, exact strings

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER_CHAT = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "reasoning_content": "Two cities.", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "-2C"},
    {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
    {"role": "assistant", "reasoning_content": "Summarise.", "content": "Paris 18C, Oslo -2C."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "reasoning_content": "One more.", "content": "", "tool_calls": [
        {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_c", "content": "25C"},
]


def test_multi_turn_tool_conversation_with_reasoning(renderer):
    expected = (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather","parameters":'
        '{"type":"object","properties":{"city":{"type":"string"}}}}}]<|im_end|>'
        + DEFAULT_SYSTEM
        + "<|im_user|>user<|im_middle|>Weather in Paris and Oslo?<|im_end|>"
        # before the last user message: reasoning emptied
        + "<|im_assistant|>assistant<|im_middle|><think></think>Checking.<|tool_calls_section_begin|>"
        + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        + '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        + "<|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n-2C<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>Paris 18C, Oslo -2C.<|im_end|>"
        + "<|im_user|>user<|im_middle|>And Rome?<|im_end|>"
        # after it: reasoning kept; call ids keep counting across the conversation
        + "<|im_assistant|>assistant<|im_middle|><think>One more.</think><|tool_calls_section_begin|>"
        + '<|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        + "<|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:2\n25C<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think>"
    )
    rendered = renderer.render(WEATHER_CHAT, WEATHER_TOOLS, chat_template_kwargs={"thinking": True})
    assert rendered.text == expected
    assert renderer.render_text(WEATHER_CHAT, WEATHER_TOOLS, chat_template_kwargs={"thinking": True}) == expected
    assert rendered.starts_in_reasoning


def test_generation_prompt_variants(renderer):
    chat = [{"role": "system", "name": "rules", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    head = "<|im_system|>rules<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
    prompt = "<|im_assistant|>assistant<|im_middle|>"
    assert renderer.render_text(chat) == head + prompt
    assert renderer.render_text(chat, chat_template_kwargs={"thinking": False}) == head + prompt + "<think></think>"
    assert renderer.render_text(chat, add_generation_prompt=False) == head
    assert not renderer.render(chat).starts_in_reasoning
    assert not renderer.render(chat, chat_template_kwargs={"thinking": False}).starts_in_reasoning


def test_ids_follow_the_template_specials(renderer, k2_tok):
    rendered = renderer.render(WEATHER_CHAT, WEATHER_TOOLS)
    assert k2_tok.decode(rendered.token_ids) == rendered.text
    assert rendered.token_ids == k2_tok.encode(rendered.text, allow_special=True)  # no look-alikes in this chat


# --------------------------------------------------------------------------------------------------------------
# Equality with transformers' apply_chat_template


@pytest.mark.parametrize("case", K2_CASES, ids=lambda c: c.name)
def test_equals_transformers(renderer, hf_k2_tokenizer, case):
    messages, tools = prepare_conversation(copy.deepcopy(case.messages), case.tools)
    expected = hf_k2_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=case.add_generation_prompt, **case.kwargs)
    ours = renderer.render(copy.deepcopy(case.messages), case.tools, case.add_generation_prompt, case.kwargs)
    assert ours.text == expected
    if not has_special_lookalikes(case):  # transformers would turn look-alikes into specials; we must not
        hf_ids = hf_k2_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                     add_generation_prompt=case.add_generation_prompt, **case.kwargs)
        assert ours.token_ids == list(hf_ids["input_ids"])


def test_cases_cover_the_format():
    joined = repr([(c.messages, c.kwargs) for c in K2_CASES])
    for needle in ("'tool_calls'", "'tool_call_id'", "reasoning_content", "'thinking': True", "'thinking': False",
                   "<|im_end|>", "'type': 'text'"):
        assert needle in joined, needle


# --------------------------------------------------------------------------------------------------------------
# Injection safety


def _chat(text: str) -> tuple[list, list]:
    return injection_chat(text, second_arguments=json.dumps({"v": text}))


def test_request_text_never_becomes_special_ids(renderer, k2_tok):
    injected = "".join(k2_tok.special_tokens) + "".join(TRICKY_TEXTS) + "\ue000\ue001\ue003x"
    specials = k2_tok.special_token_ids
    rendered = renderer.render(*_chat(injected), chat_template_kwargs={"thinking": True, "note": injected})
    benign = renderer.render(*_chat("x"), chat_template_kwargs={"thinking": True})
    assert [i for i in rendered.token_ids if i in specials] == [i for i in benign.token_ids if i in specials]
    assert k2_tok.decode(rendered.token_ids) == rendered.text
    assert rendered.text.count(injected) >= 8  # the request text survives unchanged


@SEEDED
@given(text=st.text(alphabet=st.sampled_from(list("<|>[]/ab\ue000\ue001\ue002\ue003\ue004\ue005")), max_size=40))
def test_escaper_round_trip_and_removes_boundaries(text):
    escaper = Escaper(["<|im_end|>", "[EOS]", "<think>"])
    escaped = escaper.escape(text)
    assert escaper.unescape(escaped) == text
    assert not set(escaped) & set("<>[]")


# --------------------------------------------------------------------------------------------------------------
# Template files and errors


def test_template_from_tokenizer_config(tmp_path, k2_tok):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": k2_chat_template()}]}))
    assert load_chat_template(tmp_path) == k2_chat_template()
    write_k2_chat_template(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == k2_chat_template()
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "missing")


def test_template_errors_become_chat_format_errors(k2_tok):
    strict = K2Renderer(k2_tok, "{{ raise_exception('no system messages') if messages[0].role == 'system' }}")
    with pytest.raises(ChatFormatError, match="no system messages"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError):
        K2Renderer(k2_tok, "{% if %}")


@pytest.mark.parametrize("messages, kwargs", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], {}),
    ([{"role": "system", "tools": [{"type": "function", "function": {"name": "f"}}]}], {}),
    ([{"role": "tool", "tool_call_id": "x", "content": "r"}], {}),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"messages": []}}),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"x": {1, 2}}}),
], ids=["image", "system tools", "orphan tool result", "reserved kwarg", "non-json kwarg"])
def test_malformed_requests_raise(renderer, messages, kwargs):
    with pytest.raises(ChatFormatError):
        renderer.render(messages, **kwargs)
