"""vLLM/OpenAI fields this server does not implement are refused by name when set, never silently ignored."""

import pytest

from gateway.protocol.chat import parse_chat
from gateway.protocol.common import UNIMPLEMENTED_FIELDS
from gateway.protocol.completions import parse_completion
from gateway.protocol.errors import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
VALUES = {"guided_json": {"type": "object"}, "guided_choice": ["a", "b"], "allowed_token_ids": [1, 2],
          "bad_words": ["x"], "truncate_prompt_tokens": 5, "reasoning_effort": "low", "structured_outputs": {"json": {}},
          "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": {"name": "f"}}


class _Tok:  # what parse_completion needs of a tokenizer
    def encode(self, text, allow_special=False):
        return [ord(c) for c in text]


def _value(name):
    return VALUES.get(name, "x")


def parse_completion_body(body, served):
    return parse_completion(body, _Tok(), served)


@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED_FIELDS))
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_set_unimplemented_field_is_a_400_naming_it(name, kind):
    parse, body = (parse_chat, CHAT) if kind == "chat" else (parse_completion_body, COMPLETION)
    with pytest.raises(ApiError) as err:
        parse({**body, name: _value(name)}, {"m"})
    assert (err.value.status, err.value.param, err.value.code) == (400, name, "unsupported_parameter")
    assert f"'{name}'" in str(err.value)


@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED_FIELDS))
def test_null_or_empty_is_accepted(name):
    parse_chat({**CHAT, name: None}, {"m"})
    parse_completion_body({**COMPLETION, name: []}, {"m"})


def test_the_issue_fields_are_all_covered():
    issue = {"guided_json", "structured_outputs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
             "reasoning_effort", "functions", "function_call"}
    assert issue <= set(UNIMPLEMENTED_FIELDS)


def test_other_unknown_fields_stay_ignored():  # the negative control: the refusal is by name, not blanket
    parse_chat({**CHAT, "some_vendor_extension": {"a": 1}}, {"m"})
