"""Output parsers (`kimi_k3`, `kimi_k2`): well-formed outputs parse to what was generated; streamed deltas — from our
tokenizer's ids detokenised one token at a time, from single characters, from every two-way split and from random
splits — reassemble exactly to the non-streaming parse; malformed outputs degrade to content and never raise.

Model outputs are built as text, encoded with specials allowed (as the model emits them) and decoded with
`IncrementalDetokenizer(skip_special_tokens=False)`, which is what the parsers read. Hypothesis runs derandomized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer
from gateway.chat.k3 import xtml_type
from gateway.parsers import K2OutputParser, K3OutputParser, ParsedOutput, ParserOptions, ToolCall, fold
from gateway.parsers import k2 as k2p
from gateway.parsers import k3 as k3p

SEEDED = settings(derandomize=True, database=None, deadline=None, max_examples=120,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALL_MARKERS = k3p.MARKERS + k2p.MARKERS


def _ids(index: int, name: str) -> str:
    return f"call_{index}_{name}"


# verbatim degrading keeps the markers here (skip_special_tokens=False); tests/unit/gateway/test_clean_chat_text.py
# covers the default, which removes them
K3 = K3OutputParser(ParserOptions(make_call_id=_ids, skip_special_tokens=False))
K3_NO_THINK = K3OutputParser(ParserOptions(start_in_reasoning=False, make_call_id=_ids, skip_special_tokens=False))
K2 = K2OutputParser(ParserOptions(make_call_id=_ids, skip_special_tokens=False))
K2_IN_THINK = K2OutputParser(ParserOptions(start_in_reasoning=True, make_call_id=_ids, skip_special_tokens=False))


# --------------------------------------------------------------------------------------------------------------
# Streaming helpers


def stream(parser, deltas: list[str]) -> list:
    state = parser.stream()
    out = []
    for delta in deltas:
        out += state.feed(delta)
    return out + state.finish()


def token_deltas(tok, text: str) -> list[str]:
    """The text deltas a gateway sees: ids (specials allowed) detokenised one at a time, specials kept."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    return [detok.push(i) for i in tok.encode(text, allow_special=True)] + [detok.finish()]


def check_delta_shapes(deltas: list) -> None:
    """One kind per delta; a call opens with index/id/name/arguments "" and continues with arguments only."""
    seen: set[int] = set()
    for delta in deltas:
        kinds = [delta.reasoning is not None, delta.content is not None, bool(delta.tool_calls)]
        assert sum(kinds) == 1, delta
        assert delta.reasoning != "" and delta.content != ""
        for entry in delta.tool_calls:
            payload = entry.to_openai()
            if entry.index not in seen:
                assert entry.index == len(seen)
                assert payload["type"] == "function" and payload["id"] and payload["function"]["name"]
                assert payload["function"]["arguments"] == ""
                seen.add(entry.index)
            else:
                assert set(payload) == {"index", "function"} and set(payload["function"]) == {"arguments"}


def check_streaming(parser, tok, text: str, cuts: list[int] = (), every_token_split: bool = False) -> ParsedOutput:
    """Every streaming form of `text` folds to `parser.parse(text)`; returns that parse.

    Forms: one delta per token, one per character, the random `cuts`, and (optionally) each two-way split at a
    token boundary.
    """
    expected = parser.parse(text)
    per_token = token_deltas(tok, text)
    forms = [per_token, list(text), _split(text, cuts)]
    if every_token_split:
        forms += [["".join(per_token[:k]), "".join(per_token[k:])] for k in range(1, len(per_token))]
    for deltas in forms:
        streamed = stream(parser, deltas)
        check_delta_shapes(streamed)
        assert fold(streamed) == expected
    return expected


def _split(text: str, cuts) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def check_every_split(parser, text: str) -> None:
    expected = parser.parse(text)
    for cut in range(len(text) + 1):
        assert fold(stream(parser, [text[:cut], text[cut:]])) == expected, cut


# --------------------------------------------------------------------------------------------------------------
# Output builders


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _xtml_argument(key: str, value) -> str:
    kind = xtml_type(value)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f'<|open|>argument key="{_escape_attr(key)}" type="{kind}"<|sep|>{text}<|close|>argument<|sep|>'


def k3_call(name: str, arguments: dict, index: int) -> str:
    body = "".join(_xtml_argument(key, value) for key, value in arguments.items())
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


@dataclass
class Plan:
    reasoning: str
    content: str
    calls: list  # [(name, arguments dict)]
    trailing: str = ""


def k3_output(plan: Plan, thinking: bool = True, reopen: bool = False, end: str = "") -> str:
    text = ""
    if thinking:
        opener = "<|open|>think<|sep|>" if reopen else ""
        text = f"{opener}{plan.reasoning}<|close|>think<|sep|><|open|>response<|sep|>"
    text += plan.content + "<|close|>response<|sep|>"
    if plan.calls:
        calls = "".join(k3_call(name, args, i + 1) for i, (name, args) in enumerate(plan.calls))
        text += f"<|open|>tools<|sep|>{calls}<|close|>tools<|sep|>"
    return text + "<|close|>message<|sep|>" + end


def k2_output(plan: Plan, think: str = "output", end: str = "", first_index: int = 0) -> str:
    text = {"output": f"<think>{plan.reasoning}</think>", "prompt": f"{plan.reasoning}</think>", "none": ""}[think]
    text += plan.content
    if plan.calls:
        calls = "".join(
            f"<|tool_call_begin|>functions.{name}:{first_index + i}<|tool_call_argument_begin|>"
            f"{json.dumps(args, ensure_ascii=i % 2 == 0)}<|tool_call_end|>"
            for i, (name, args) in enumerate(plan.calls)
        )
        text += f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"
    return text + plan.trailing + end


def expected_calls(plan: Plan, ids) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(i, ids(i, name), name, json.dumps(args, ensure_ascii=False))
                 for i, (name, args) in enumerate(plan.calls))


def _no_markers(text: str) -> bool:
    return not any(marker in text for marker in ALL_MARKERS)


ALPHABET = st.sampled_from(list("ab Z9_-.:,\"'&{}[]\n\t<|>/=") + ["é", "中", "😀", "think", "open", "sep", "<|"])
free_text = st.lists(ALPHABET, max_size=20).map("".join).filter(_no_markers)
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                      st.floats(allow_nan=False, allow_infinity=False, width=32), free_text)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(free_text, inner, max_size=3)),
                          max_leaves=6)
arguments = st.dictionaries(free_text, json_value, max_size=4)
plans = st.builds(Plan, free_text, free_text, st.lists(st.tuples(names, arguments), max_size=3), free_text)
plans_with_calls = st.builds(Plan, free_text, free_text, st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
                             free_text)
cut_points = st.lists(st.integers(0, 10_000), max_size=8)


# --------------------------------------------------------------------------------------------------------------
# K3


@SEEDED
@given(plan=plans, reopen=st.booleans(), end=st.sampled_from(["", "<|end_of_msg|>"]), cuts=cut_points)
def test_k3_well_formed(k3_tok, plan, reopen, end, cuts):
    text = k3_output(plan, reopen=reopen, end=end)
    parsed = check_streaming(K3, k3_tok, text, cuts, every_token_split=True)
    assert parsed == ParsedOutput(plan.reasoning or None, plan.content or None, expected_calls(plan, _ids))
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [args for _, args in plan.calls]


@SEEDED
@given(plan=plans, cuts=cut_points)
def test_k3_thinking_off(k3_tok, plan, cuts):
    text = k3_output(plan, thinking=False)
    parsed = check_streaming(K3_NO_THINK, k3_tok, text, cuts)
    assert parsed == ParsedOutput(None, plan.content or None, expected_calls(plan, _ids))


def test_k3_every_split():
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "kda", "n": None, "f": [1, {"a": "b"}]})]
    plan = Plan("Two cities <|o? let me see.", "Checking \"both\" & more.", calls)
    for text in (k3_output(plan), k3_output(plan, reopen=True, end="<|end_of_msg|>")):
        check_every_split(K3, text)
    check_every_split(K3_NO_THINK, k3_output(plan, thinking=False))


def _xcall(header: str, *body: str) -> str:
    return f"<|open|>call {header}<|sep|>{''.join(body)}<|close|>call<|sep|>"


def _xarg(key: str, kind: str, value: str, tag: str = "argument") -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>{tag}<|sep|>'


def _xjson(value: str) -> str:
    return f'<|open|>json type="object"<|sep|>{value}<|close|>json<|sep|>'


def test_k3_malformed_cases_degrade_to_content():
    head = "ok<|close|>think<|sep|><|open|>response<|sep|>hi<|close|>response<|sep|><|open|>tools<|sep|>"
    good = _xcall('tool="g" index="2"', _xarg("x", "boolean", "true"))
    f = 'tool="f" index="1"'
    bad_calls = {
        "invalid number": _xcall(f, _xarg("n", "number", "abc")),
        "type mismatch": _xcall(f, _xarg("n", "boolean", "1")),
        "unknown type": _xcall(f, _xarg("n", "date", "1")),
        "NaN": _xcall(f, _xarg("n", "number", "NaN")),
        "duplicate key": _xcall(f, _xarg("a", "string", "1"), _xarg("a", "string", "2")),
        "no tool name": _xcall('index="1"'),
        "text in call": _xcall(f, "stray"),
        "wrong close": _xcall(f, _xarg("a", "string", "v", tag="call")),
        "json not object": _xcall(f, _xjson("[1]")),
        "json and arguments": _xcall(f, _xjson("{}"), _xarg("a", "string", "v")),
    }
    for name, call in bad_calls.items():
        parsed = K3.parse(head + call + good + "<|close|>tools<|sep|><|close|>message<|sep|>")
        assert parsed.reasoning == "ok", name
        assert call in parsed.content, name
        assert parsed.tool_calls == (ToolCall(0, _ids(0, "g"), "g", '{"x": true}'),), name
    json_call = K3.parse(head + _xcall(f, _xjson('{"a": [1]}'))).tool_calls
    assert json_call == (ToolCall(0, _ids(0, "f"), "f", '{"a": [1]}'),)
    unterminated = '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>Par'
    parsed = K3.parse(head + unterminated)
    assert parsed.content == "hi" and parsed.tool_calls == ()  # cut short (max_tokens): dropped, no markup
    partial_marker = {m[:k] for m in k3p.MARKERS for k in range(1, len(m))}  # a cut inside a special token's text
    for cut in range(len(unterminated) + 1):  # wherever the output (whole tokens) ends inside the call
        if any(unterminated[:cut].endswith(p) for p in partial_marker):
            continue
        parsed = K3.parse(head + unterminated[:cut])
        assert "<|" not in (parsed.content or "") and parsed.tool_calls == (), cut


def test_k3_reasoning_edges():
    assert K3.parse("still thinking") == ParsedOutput("still thinking", None)  # unterminated: stays reasoning
    assert K3.parse("r<|open|>response<|sep|>c") == ParsedOutput("r", "c")  # response opens: think ends
    assert K3.parse("r<|close|>think<|sep|>c") == ParsedOutput("r", "c")  # text between blocks is content
    assert K3.parse("r<|close|>message<|sep|><|end_of_msg|>after") == ParsedOutput("r", "after")
    assert K3.parse("a<|open|>bogus<|sep|>b<|sep|>") == ParsedOutput("a<|open|>bogus<|sep|>b<|sep|>", None)
    assert K3_NO_THINK.parse("<|open|>response<|sep|>c<|close|>response<|sep|>") == ParsedOutput(None, "c")


def test_k3_disabled_parts():
    text = k3_output(Plan("r", "c", [("f", {"a": 1})]))
    no_reasoning = K3OutputParser(ParserOptions(separate_reasoning=False, make_call_id=_ids))
    assert no_reasoning.parse(text) == ParsedOutput(None, "rc", (ToolCall(0, _ids(0, "f"), "f", '{"a": 1}'),))
    no_tools = K3OutputParser(ParserOptions(parse_tool_calls=False, make_call_id=_ids, skip_special_tokens=False))
    tools_block = text[text.index("<|open|>tools"): text.index("<|close|>message")]
    assert no_tools.parse(text) == ParsedOutput("r", "c" + tools_block)


# --------------------------------------------------------------------------------------------------------------
# K2


@SEEDED
@given(plan=plans, think=st.sampled_from(["output", "prompt", "none"]),
       end=st.sampled_from(["", "<|im_end|>"]), first=st.integers(0, 30), cuts=cut_points)
def test_k2_well_formed(k2_tok, plan, think, end, first, cuts):
    parser = K2_IN_THINK if think == "prompt" else K2
    text = k2_output(plan, think, end, first)
    parsed = check_streaming(parser, k2_tok, text, cuts, every_token_split=True)
    reasoning = None if think == "none" else plan.reasoning or None
    assert parsed.reasoning == reasoning
    assert parsed.content == ((plan.content + plan.trailing) or None)
    assert [(c.id, c.name) for c in parsed.tool_calls] == [
        (f"functions.{name}:{first + i}", name) for i, (name, _) in enumerate(plan.calls)]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [args for _, args in plan.calls]


def test_k2_every_split():
    plan = Plan("Let me <think about it.", "Sure, checking: ",
                [("get_weather", {"city": "Paris"}), ("search", {"q": "中文", "n": [1, None]})], " Done.")
    for text, parser in ((k2_output(plan), K2), (k2_output(plan, "prompt", "<|im_end|>"), K2_IN_THINK),
                         (k2_output(plan, "none"), K2)):
        check_every_split(parser, text)


def test_k2_edges_and_malformed():
    section = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
    call = "<|tool_call_begin|>{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
    good = call.format("functions.ok:3", '{"x": 1}')
    ok = ToolCall(0, "functions.ok:3", "ok", '{"x": 1}')
    # reasoning also ends where the tool-call section begins; text before the section is content
    assert K2.parse("<think>plan" + section.format(good)) == ParsedOutput("plan", None, (ok,))
    assert K2.parse("Sure." + section.format(good) + "<|im_end|>") == ParsedOutput(None, "Sure.", (ok,))
    assert K2.parse(" <think>x</think>") == ParsedOutput(None, " <think>x</think>")  # not at the start: text
    assert K2_IN_THINK.parse("still thinking") == ParsedOutput("still thinking", None)
    # a missing `functions.` prefix is tolerated; whitespace around id and arguments is trimmed
    assert K2.parse(section.format(call.format(" f:0 ", ' {"a": 2} '))).tool_calls == (
        ToolCall(0, "f:0", "f", '{"a": 2}'),)
    for bad in (call.format("functions.f:0", "{oops"), call.format("functions.f:0", "[1]"),
                call.format("functions.f", "{}"), call.format("functions.f:0", '{"n": NaN}'),
                "<|tool_call_begin|>functions.f:0<|tool_call_end|>"):
        parsed = K2.parse("c" + section.format(bad + good))
        assert parsed == ParsedOutput(None, "c" + bad, (ok,)), bad
    unterminated = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\""
    assert K2.parse("c" + "<|tool_calls_section_begin|>" + unterminated) == ParsedOutput(None, "c")  # dropped


def test_k2_disabled_parts():
    text = k2_output(Plan("r", "c", [("f", {"a": 1})]))
    no_reasoning = K2OutputParser(ParserOptions(separate_reasoning=False))
    assert no_reasoning.parse(text).reasoning is None and no_reasoning.parse(text).content == "rc"
    no_tools = K2OutputParser(ParserOptions(parse_tool_calls=False, skip_special_tokens=False))
    assert no_tools.parse(text) == ParsedOutput("r", "c" + text[text.index("<|tool_calls_section_begin|>"):])


# --------------------------------------------------------------------------------------------------------------
# Both formats: arbitrary and truncated outputs


@dataclass(frozen=True)
class Format:
    parsers: tuple  # every parser configuration to try on arbitrary text
    words: tuple[str, ...]  # besides the markers, what arbitrary outputs are made of
    output: object  # Plan -> a well-formed output
    call_end: str  # what ends a complete call


FORMATS = {
    "k3": Format((K3, K3_NO_THINK), tuple(k3p.MARKERS) + (
        "think", "response", "tools", "message", "argument", "call", 'call tool="f"', 'argument key="k" type="number"',
        'argument key="k" type="string"', 'json type="object"', "json", "1", '{"a": 1}', "x y", "\n"),
        k3_output, "<|close|>call<|sep|>"),
    "k2": Format((K2, K2_IN_THINK), tuple(k2p.MARKERS) + (
        "functions.f:0", "functions.g:1", "f:2", "functions.bad", '{"a": 1}', "{oops", "[1]", " ", "\n"),
        k2_output, "<|tool_call_end|>"),
}


@pytest.fixture(scope="module")
def toks(k3_tok, k2_tok) -> dict:
    return {"k3": k3_tok, "k2": k2_tok}


@pytest.mark.parametrize("family", sorted(FORMATS))
@SEEDED
@given(data=st.data(), cuts=cut_points)
def test_arbitrary_output_never_raises(toks, family, data, cuts):
    fmt = FORMATS[family]
    text = data.draw(st.lists(st.one_of(st.sampled_from(fmt.words), free_text), max_size=40).map("".join))
    for parser in fmt.parsers:
        check_streaming(parser, toks[family], text, cuts)


@pytest.mark.parametrize("family", sorted(FORMATS))
@SEEDED
@given(plan=plans_with_calls, cut=st.integers(0, 10_000), cuts=cut_points)
def test_truncated_output(toks, family, plan, cut, cuts):
    """An output cut anywhere (max_tokens) parses consistently; a call is either complete or content."""
    fmt = FORMATS[family]
    full = fmt.output(plan)
    text = full[: cut % (len(full) + 1)]
    parsed = check_streaming(fmt.parsers[0], toks[family], text, cuts)
    assert len(parsed.tool_calls) == text.count(fmt.call_end)


# --------------------------------------------------------------------------------------------------------------
# OpenAI shapes


def test_openai_shapes():
    parsed = K3.parse(k3_output(Plan("why", "what", [("f", {"a": "b"})])))
    message = parsed.to_openai_message()
    assert message == {"role": "assistant", "content": "what", "reasoning_content": "why", "reasoning": "why",
                       "tool_calls": [{"id": _ids(0, "f"), "type": "function",
                                       "function": {"name": "f", "arguments": '{"a": "b"}'}}]}
    deltas = [d.to_openai() for d in stream(K3, [k3_output(Plan("why", "", [("f", {})]))])]
    assert deltas == [{"reasoning_content": "why", "reasoning": "why"},
                      {"tool_calls": [{"index": 0, "id": _ids(0, "f"), "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]


@pytest.mark.parametrize("parser", [K3, K2])
def test_random_call_ids_by_default(parser):
    default = type(parser)()
    text = (k3_output if parser is K3 else lambda p: k2_output(p, "none"))(Plan("", "", [("f", {})]))
    call_id = default.parse(text).tool_calls[0].id
    assert call_id.startswith("call_") if parser is K3 else call_id == "functions.f:0"
