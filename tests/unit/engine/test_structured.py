"""Structured output (engine/structured/): grammar-constrained decoding on random-weight tiny checkpoints.

- `json_schema` / `json_object`: the output parses and validates, bare or wrapped in the K3 / K2 message format
  (read back by the gateway's parsers), with and without a reasoning block opened by the prompt;
- `tool_call` (required with two tools, or a named tool): the family's parser (`gateway.parsers`) returns >= 1 call
  whose name is allowed and whose arguments validate against the tool's schema; greedy and seeded sampling;
- markers are emitted only as their special ids; after the grammar only the stop token; `max_tokens` too small for
  a free-running random model still ends in a valid structure (steered finish);
- unconstrained requests in the same batch are unaffected (equal to running alone); matchers are released;
- export/resume replays the carried output through a fresh matcher;
- invalid schemas and parameters raise `InvalidRequestError`; schemas are checked copies of what was given.

(The OpenAI request -> structured output mapping is the gateway's, gateway/plan.py, tested there.)
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputParams, ToolSpec
from gateway.parsers import build_output_parser

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"},
        "detailed": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "unit"],
}
MOVE = {  # needs the K3 json block: anyOf and a length-bounded string
    "type": "object",
    "properties": {"to": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
                   "why": {"type": "string", "minLength": 1, "maxLength": 8}},
    "required": ["to", "why"],
    "additionalProperties": False,
}
TOOLS = {"get_weather": WEATHER, "move": MOVE, "person": PERSON}
FAMILY = {"k3": "kimi_k3", "linear": "kimi_k2"}
NUM_PROMPTS = 4


def validate(value, schema) -> None:
    """A small JSON Schema check (the subset used here); jsonschema too when it is installed."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, schema)
    check(value, schema)


def check(value, schema) -> None:
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return check(value, option)
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError(f"{value!r} matches no option: {errors}")
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or []
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "null": lambda v: v is None}
    assert not types or any(checks[t](value) for t in types), (value, schema)
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), (value, schema)
    if isinstance(value, dict):
        assert set(schema.get("required", [])) <= set(value), (value, schema)
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(properties), (value, schema)
        for key, item in value.items():
            if key in properties:
                check(item, properties[key])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            check(item, schema["items"])


@pytest.fixture(scope="module")
def llms(tiny_k3_dir, tiny_linear_dir):
    args = dict(kv_cache_memory=16 << 20, max_num_seqs=8, enable_prefix_caching=False)
    return {"k3": LLM(tiny_k3_dir, **args), "linear": LLM(tiny_linear_dir, **args)}


def prompts(llm, n: int = NUM_PROMPTS) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.encode(f"Request {i}: answer in the asked format, please.")}
            for i in range(n)]


def generate(llm, structured, temperature: float, max_tokens: int = 100, n: int = NUM_PROMPTS, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, structured=structured,
                            skip_special_tokens=False, **kwargs)
    outs = llm.generate(prompts(llm, n), params, check_integrity=True)
    assert llm.engine.constrained.count == 0  # every matcher was released
    return [o.outputs[0] for o in outs]


def parse(family: str, text: str, starts_in_reasoning: bool):
    parser = build_output_parser(family, family, start_in_reasoning=starts_in_reasoning)
    return parser.parse(text)


# ----------------------------------------------------------------------------------------------------------------
# JSON


@pytest.mark.parametrize("model", ["k3", "linear"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_bare(llms, model, temperature):
    structured = StructuredOutputParams("json_schema", json_schema=PERSON)
    for out in generate(llms[model], structured, temperature):
        assert out.finish_reason == "stop"
        validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize("model", ["k3", "linear"])
@pytest.mark.parametrize("reasoning", [False, True])
def test_json_in_the_chat_format(llms, model, reasoning):
    family = FAMILY[model]
    for kind, schema in (("json_schema", MOVE), ("json_object", {"type": "object"})):
        structured = StructuredOutputParams(kind, json_schema=schema if kind == "json_schema" else None,
                                            output_format=family, starts_in_reasoning=reasoning,
                                            max_reasoning_tokens=4)
        for temperature in (0.0, 1.0):
            for out in generate(llms[model], structured, temperature, max_tokens=60):
                parsed = parse(family, out.text, reasoning)
                assert out.finish_reason == "stop" and not parsed.tool_calls, out.text
                value = json.loads(parsed.content)
                validate(value, schema)
                if reasoning:
                    assert parsed.reasoning is not None and len(parsed.reasoning) > 0, out.text


# ----------------------------------------------------------------------------------------------------------------
# Tool calls


def check_calls(family: str, out, allowed: set[str], reasoning: bool, exactly_one: bool = False) -> None:
    parsed = parse(family, out.text, reasoning)
    assert out.finish_reason == "stop", out.text
    assert parsed.tool_calls, out.text
    assert not exactly_one or len(parsed.tool_calls) == 1, out.text
    assert not (parsed.content or "").strip(), out.text  # everything became a call
    for call in parsed.tool_calls:
        assert call.name in allowed, out.text
        validate(json.loads(call.arguments), TOOLS[call.name])
    if family == "kimi_k3":  # the k-th call of the turn carries index="k" (the K3 template's numbering)
        indices = re.findall(r'<\|open\|>call tool="[^"]*" index="([^"]*)"', out.text)
        assert indices == [str(k) for k in range(1, len(parsed.tool_calls) + 1)], out.text


@pytest.mark.parametrize("model", ["k3", "linear"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("reasoning", [False, True])
def test_tool_call_required(llms, model, temperature, reasoning):
    family = FAMILY[model]
    tools = (ToolSpec("get_weather", WEATHER), ToolSpec("person", PERSON))
    structured = StructuredOutputParams("tool_call", tools=tools, mode="required", output_format=family,
                                        starts_in_reasoning=reasoning, max_reasoning_tokens=6)
    for out in generate(llms[model], structured, temperature, max_tokens=150 if model == "k3" else 80):
        check_calls(family, out, {"get_weather", "person"}, reasoning)


@pytest.mark.parametrize("model", ["k3", "linear"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_call_named(llms, model, temperature):
    family = FAMILY[model]
    for name in ("move", "get_weather"):
        structured = StructuredOutputParams("tool_call", tools=tuple(ToolSpec(n, s) for n, s in TOOLS.items()),
                                            mode="named", name=name, output_format=family, starts_in_reasoning=True,
                                            max_reasoning_tokens=3)
        for out in generate(llms[model], structured, temperature, max_tokens=120 if model == "k3" else 60,
                            ignore_eos=True, min_tokens=3):
            check_calls(family, out, {name}, reasoning=True, exactly_one=True)


def test_single_call_and_k3_encodings(llms):
    """K3 writes simple arguments as `argument` blocks (strings raw) and others as one `json` block."""
    llm = llms["k3"]
    open_, close, sep = (llm.tokenizer.special_tokens[m] for m in ("<|open|>", "<|close|>", "<|sep|>"))
    structured = StructuredOutputParams("tool_call", tools=tuple(ToolSpec(n, s) for n, s in TOOLS.items()),
                                        parallel_tool_calls=False, output_format="kimi_k3")
    outs = generate(llm, structured, 1.0, max_tokens=150, n=8)
    for out in outs:
        check_calls("kimi_k3", out, set(TOOLS), reasoning=False, exactly_one=True)
        specials = [t for t in out.token_ids if llm.tokenizer.is_special(t)]
        assert set(specials[:-1]) <= {open_, close, sep} and specials[-1] in llm.engine.eos_token_ids
        assert out.text.startswith("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"")
        assert out.text.endswith("<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
        name = parse("kimi_k3", out.text, False).tool_calls[0].name
        assert ('<|open|>json type="object"<|sep|>' in out.text) == (name == "move")
        if name == "get_weather":
            assert '<|open|>argument key="city" type="string"<|sep|>' in out.text


# ----------------------------------------------------------------------------------------------------------------
# Masks, budget, batching, export


def test_masks(llms):
    """At the start of a K3 thinking-mode call only `<|close|>` is allowed; at the end only the stop tokens."""
    engine = llms["k3"].engine
    backend = engine.constrained.backend()
    structured = StructuredOutputParams("tool_call", tools=(ToolSpec("person", PERSON),), mode="named",
                                        name="person", output_format="kimi_k3", starts_in_reasoning=True)
    state = backend.new_state(structured, engine.eos_token_ids)

    def allowed(tokens_left=10_000):
        mask = backend.fill([state, None], [tokens_left, tokens_left])
        bits = [(int(mask[0, t >> 5]) >> (t & 31)) & 1 for t in range(backend.vocab_size)]
        assert int((mask[1] != -1).sum()) == 0  # an unconstrained row allows everything
        return [t for t, bit in enumerate(bits) if bit]

    tokenizer = engine.tokenizer
    assert allowed() == [tokenizer.special_tokens["<|close|>"]]
    text = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="person" index="1"<|sep|><|open|>argument key="name" type="string"<|sep|>Ann'
            '<|close|>argument<|sep|><|open|>argument key="age" type="number"<|sep|>7<|close|>argument<|sep|>'
            '<|open|>argument key="color" type="string"<|sep|>red<|close|>argument<|sep|>'
            '<|open|>argument key="tags" type="array"<|sep|>["x"]<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|>')
    for token in tokenizer.encode(text, allow_special=True):
        assert state.accept(token), tokenizer.decode([token])
    assert state.is_completed and sorted(allowed()) == sorted(engine.eos_token_ids)
    assert not state.accept(tokenizer.encode("x")[0])
    call = parse("kimi_k3", text, True).tool_calls[0]
    assert json.loads(call.arguments) == {"name": "Ann", "age": 7, "color": "red", "tags": ["x"]}


@pytest.mark.parametrize("model", ["k3", "linear"])
def test_small_budget_still_finishes(llms, model):
    """A random model never ends a string by itself; the steered finish closes everything within max_tokens."""
    family = FAMILY[model]
    structured = StructuredOutputParams("tool_call", tools=(ToolSpec("get_weather", WEATHER),), mode="named",
                                        name="get_weather", output_format=family)
    budget = 90 if model == "k3" else 40
    for out in generate(llms[model], structured, 1.0, max_tokens=budget):
        assert len(out.token_ids) <= budget
        check_calls(family, out, {"get_weather"}, reasoning=False)
    outs = generate(llms[model], StructuredOutputParams("json_object"), 0.0, max_tokens=12)
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("model", ["k3", "linear"])
def test_unconstrained_requests_unaffected(llms, model):
    llm = llms[model]
    plain = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)]
    batch_prompts = prompts(llm, 4)
    alone = [o.outputs[0].token_ids for o in llm.generate(batch_prompts[:2], plain)]
    structured = StructuredOutputParams("json_schema", json_schema=PERSON)
    constrained = [SamplingParams(max_tokens=40, temperature=t, seed=5, structured=structured) for t in (0, 1.0)]
    constrained_alone = [o.outputs[0].token_ids for o in llm.generate(batch_prompts[2:], constrained)]
    mixed = llm.generate(batch_prompts, plain + constrained, check_integrity=True)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert [o.outputs[0].token_ids for o in mixed[2:]] == constrained_alone
    for out in mixed[2:]:
        validate(json.loads(out.outputs[0].text), PERSON)
    assert llm.engine.constrained.count == 0


def test_n_abort_and_export_resume(llms):
    llm = llms["linear"]
    engine = llm.engine
    structured = StructuredOutputParams("tool_call", tools=(ToolSpec("person", PERSON),), output_format="kimi_k2")
    engine.add_request("abort-me", prompts(llm, 1)[0], SamplingParams(n=3, max_tokens=50, structured=structured))
    assert engine.constrained.count == 3
    engine.step()
    engine.abort("abort-me")
    engine.step()
    assert engine.constrained.count == 0 and not engine.has_unfinished_requests()

    # like prefill (one token, exported) + decode (imported): the same tokens as one run, steered finish included
    for temperature, head_tokens in ((0.0, 1), (1.0, 1), (0.0, 10)):
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=11, structured=structured,
                                skip_special_tokens=False)
        whole = llm.generate(prompts(llm, 2), params)
        head = llm.generate(prompts(llm, 2), dataclasses.replace(params, max_tokens=head_tokens), export=True)
        resumed = llm.resume([h.exported for h in head], params)
        assert [r.outputs[0].token_ids for r in resumed] == [w.outputs[0].token_ids for w in whole]
        for out in whole:
            check_calls("kimi_k2", out.outputs[0], {"person"}, reasoning=False)


# ----------------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("make", [
    lambda: StructuredOutputParams("json_schema", json_schema={"type": "strng"}),
    lambda: StructuredOutputParams("json_schema", json_schema={"type": "object", "properties": 5}),
    lambda: StructuredOutputParams("json_schema", json_schema={"type": "string", "minLength": -1}),
    lambda: StructuredOutputParams("json_schema", json_schema={"type": "string", "pattern": "(("}),
    lambda: StructuredOutputParams("json_schema", json_schema=[1, 2]),
    lambda: StructuredOutputParams("json_schema"),
    lambda: StructuredOutputParams("xml"),
    lambda: StructuredOutputParams("json_object", output_format="kimi_k4"),
    lambda: StructuredOutputParams("json_object", starts_in_reasoning=True),
    lambda: StructuredOutputParams("json_object", max_reasoning_tokens=-1),
    lambda: StructuredOutputParams("tool_call", tools=(ToolSpec("f", {}),)),  # no output_format
    lambda: StructuredOutputParams("tool_call", output_format="kimi_k3"),  # no tools
    lambda: StructuredOutputParams("tool_call", tools=(ToolSpec("f"), ToolSpec("f")), output_format="kimi_k3"),
    lambda: StructuredOutputParams("tool_call", tools=(ToolSpec("f"),), mode="named", name="g",
                                   output_format="kimi_k3"),
    lambda: ToolSpec("has space"),
    lambda: ToolSpec("f", {"type": "object", "required": "a"}),
    lambda: SamplingParams(structured={"type": "json_object"}),
])
def test_invalid_requests(make):
    with pytest.raises(InvalidRequestError):
        make()


def test_invalid_request_leaves_engine_serving(llms):
    llm = llms["k3"]
    with pytest.raises(InvalidRequestError):
        StructuredOutputParams("json_schema", json_schema={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(InvalidRequestError):  # kimi_k2 markers are not special tokens of a K3 tokenizer
        llm.generate(prompts(llm, 1), SamplingParams(structured=StructuredOutputParams(
            "json_object", output_format="kimi_k2")))
    assert not llm.engine.has_unfinished_requests()
    out = generate(llm, StructuredOutputParams("json_object"), 0.0, n=1)[0]
    assert isinstance(json.loads(out.text), dict)


def test_schemas_are_checked_copies():
    """The grammar reads checked copies taken at construction: changing the caller's dicts later changes nothing."""
    arguments = {"properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = ToolSpec("get_weather", arguments)
    assert tool.schema == {**arguments, "type": "object"} and "type" not in arguments
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = StructuredOutputParams("json_schema", json_schema=schema)
    key = params.key
    schema["properties"]["a"]["type"] = "string"
    arguments["properties"]["city"]["type"] = "integer"
    assert params.schema["properties"]["a"]["type"] == "integer" and params.key == key
    assert tool.schema["properties"]["city"]["type"] == "string"
    calls = StructuredOutputParams("tool_call", tools=[tool], output_format="kimi_k2")  # a list is accepted
    assert calls.allowed_tools == (tool,) and "get_weather" in calls.key
