"""kdamesh's K3 Jinja chat template (`engine/assets/kimi_k3_chat_template.jinja`, shipped as `chat_template.jinja`)
renders, through `transformers.AutoTokenizer.apply_chat_template`, exactly what the gateway's Python renderer
(gateway/chat/k3.py) renders: the text on 80 seeded conversations (tools, parallel calls with every argument type,
tool results, reasoning, thinking on/off and effort, tool_choice, response_format, dynamic tool declarations,
images as placeholders, multi-turn) and the token ids on 40 more, of those where the conversation holds no special-token look-alike
(transformers reads those as the special token; the gateway never does) and no two text parts side by side in a
content list (the renderer, as the official one, encodes each part on its own; a tokenizer given the rendered text
cannot know where one part ended). The conversation is given as a client of a
transformers template gives it (vLLM's form): arguments as objects, tool results in call order."""

from __future__ import annotations

import copy
import json

import pytest

from engine import tokenizer_build as tb
from gateway.chat import ChatRenderer
from gateway.chat.conversation import normalize_messages
from tests.unit.gateway.conversations import cases, has_special_lookalikes

import transformers  # noqa: E402  (the dev extra pins it: a missing one fails, never skips)

CASES = cases(80, "kimi_k3", seed=2828)


@pytest.fixture(scope="module")
def hf_k3(tmp_path_factory):
    folder = tb.write_tokenizer_json(tmp_path_factory.mktemp("k3-hf"), "kimi_k3")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def renderer(k3_tok):
    return ChatRenderer("kimi_k3", k3_tok)


def client_form(messages: list) -> list:
    """The conversation as a client hands it to a transformers template: tool results in the order of the calls
    they answer, JSON-string arguments parsed (a string that is not JSON stays a string)."""
    out = []
    for message in normalize_messages(copy.deepcopy(messages), allow_images=True, allow_system_tools=True):
        for call in message.get("tool_calls", ()):
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    pass
        out.append(message)
    return out


def adjacent_text_parts(case) -> bool:
    for message in case.messages:
        content = message.get("content")
        if isinstance(content, list) and any(a["type"] == b["type"] == "text" for a, b in zip(content, content[1:])):
            return True
    return False


ID_CASES = [c for c in cases(600, "kimi_k3", seed=2829)
            if not has_special_lookalikes(c) and not adjacent_text_parts(c)][:40]


def _template_kwargs(case) -> dict:
    return dict(case.kwargs, tool_choice=case.tool_choice, response_format=case.response_format,
                image_sizes=case.image_sizes)


def _both(renderer, hf_k3, case, tokenize: bool):
    ours = renderer.render(copy.deepcopy(case.messages), case.tools, case.add_generation_prompt, case.kwargs,
                           tool_choice=case.tool_choice, response_format=case.response_format,
                           image_sizes=case.image_sizes)
    kwargs = dict(tools=case.tools, add_generation_prompt=case.add_generation_prompt, **_template_kwargs(case))
    theirs = hf_k3.apply_chat_template(client_form(case.messages), tokenize=tokenize, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_template_text_equals_the_renderer(renderer, hf_k3, case):
    ours, text = _both(renderer, hf_k3, case, tokenize=False)
    assert text == ours.text


@pytest.mark.parametrize("case", ID_CASES, ids=[c.name for c in ID_CASES])
def test_template_ids_equal_the_renderer(renderer, hf_k3, case):
    ours, encoded = _both(renderer, hf_k3, case, tokenize=True)
    assert list(encoded["input_ids"]) == ours.token_ids


def test_cases_cover_the_format():
    needles = ("'tool_calls'", "'tool_call_id'", "reasoning_content", "'thinking': False", "'thinking_effort'",
               "'required'", "'none'", "json_schema", "json_object", "'image_url'")
    for group, extra in ((CASES, ("'tools': [", "{not json")), (ID_CASES, ())):
        joined = repr([(c.messages, c.kwargs, c.tool_choice, c.response_format, c.image_sizes) for c in group])
        for needle in needles + extra:
            assert needle in joined, needle
    assert len(ID_CASES) == 40


def test_the_comparison_can_fail(renderer, hf_k3):
    """Negative control: a different option changes the template's output, so equality above is not vacuous."""
    chat = [{"role": "user", "content": "hi"}]
    thinking = hf_k3.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert thinking == renderer.render(chat).text
    assert thinking != hf_k3.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, thinking=False)


def test_shipped_copies_are_the_asset():
    """demo-k3 and every generated K3 folder carry the asset itself (no drifting copy)."""
    asset = tb.CHAT_TEMPLATES["kimi_k3"].read_bytes()
    from deploy.checkpoints import SHIPPED_MODELS

    assert (SHIPPED_MODELS["demo-k3"] / tb.CHAT_TEMPLATE_FILE).read_bytes() == asset
