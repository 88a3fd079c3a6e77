"""Hypothesis fuzz of the output parsers (gateway/parsers) and the chat renderers (gateway/chat) on arbitrary input:
a parser never raises on model output and its stream folds to its parse however the text is split; a renderer
raises nothing but `ChatFormatError` (a 400) on any conversation, tools or options."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats.markers import K3_STRUCTURAL_MARKERS, OUTPUT_MARKERS
from gateway.chat import ChatFormatError, ChatRenderer, load_chat_template
from gateway.parsers import K2OutputParser, K3OutputParser, ParserOptions, fold

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
FRAGMENTS = ("{", "}", '"', ":", ",", "[", "]", "\n", "think", "response", "tool_call", "name", "functions.f:0",
             '{"a": 1}', "arguments", " ")
# model output: markers and JSON-ish fragments among arbitrary text, so the grammar's branches are reached
output_text = st.lists(st.one_of(st.sampled_from(OUTPUT_MARKERS + K3_STRUCTURAL_MARKERS + FRAGMENTS), st.text(max_size=8)),
                       max_size=40).map("".join)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=10),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "")
KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "type", "text", "image_url",
        "function", "arguments", "id")
# conversations: dicts over the fields a message uses (any values), sometimes well-formed enough to render
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.one_of(output_text, json_value)},
                          optional={k: json_value for k in KEYS[2:]}),
    st.dictionaries(st.sampled_from(KEYS), json_value, max_size=5),
    json_value)
conversation = st.one_of(st.just([{"role": "user", "content": "hi"}]), st.lists(message, max_size=5), json_value)


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@pytest.mark.parametrize("parser_type", [K3OutputParser, K2OutputParser])
@pytest.mark.parametrize("start_in_reasoning", [True, False])
def test_parsers_never_raise_and_streams_fold_to_the_parse(parser_type, start_in_reasoning):
    parser = parser_type(ParserOptions(start_in_reasoning=start_in_reasoning, make_call_id=lambda i, name: f"c{i}"))

    @FUZZ
    @given(text=output_text, cuts=st.lists(st.integers(min_value=0), max_size=12))
    def check(text, cuts):
        whole = parser.parse(text)
        stream = parser.stream()
        deltas = [d for piece in _splits(text, cuts) for d in stream.feed(piece)] + stream.finish()
        assert fold(deltas) == whole

    check()


@pytest.fixture(scope="module")
def renderers(k3_tok, k2_tok, k2_dir):
    return [ChatRenderer("kimi_k3", k3_tok), ChatRenderer("kimi_linear", k2_tok, load_chat_template(k2_dir))]


@FUZZ
@given(messages=conversation, tools=st.one_of(st.none(), json_value), kwargs=st.one_of(st.none(), json_value),
       tool_choice=st.one_of(st.none(), st.sampled_from(["auto", "none", "required"]), json_value),
       generation=st.booleans())
def test_renderers_raise_only_chat_format_errors(renderers, messages, tools, kwargs, tool_choice, generation):
    for renderer in renderers:
        try:
            prompt = renderer.render(messages, tools, generation, kwargs, tool_choice=tool_choice)
        except ChatFormatError:
            continue
        assert prompt.token_ids and isinstance(prompt.text, str)
