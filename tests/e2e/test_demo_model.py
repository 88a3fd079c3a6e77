"""End to end on the shipped, trained demo-k3 (deploy/models/demo-k3) through the launched mesh and the official
`openai` client, greedy: a chat answer ends by itself with content; with thinking on, reasoning and content are both
there; with a declared tool and `tool_choice="auto"`, a tool-use prompt yields a call whose arguments validate
against the tool's schema. The prompts follow the training set's style but none of them is in it (checked when
they were chosen: `bench/demo_eval.py`'s `training_prompts`). Negative control: the same assertions against the
random tiny-k3 fail, all three (checked by hand when this file was written)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from deploy.checkpoints import SHIPPED_MODELS
from tests.e2e.launched import launch, stop
from trainer.chat_data import TOOLS

MODEL = "demo-k3"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("e2e-demo"), "endpoints ", model=SHIPPED_MODELS[MODEL])
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{launched.port}/v1", api_key="none", max_retries=0, timeout=120)
    stop(launched.proc)


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=200, temperature=0, **kwargs).choices[0]


def test_the_default_model_is_the_trained_demo(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_chat_answer_ends_by_itself_with_content(client):
    choice = _chat(client, "Please work out 38 + 47.", extra_body=NO_THINKING)
    assert choice.finish_reason == "stop" and choice.message.content.strip()
    assert not getattr(choice.message, "reasoning_content", None)


def test_with_thinking_on_reasoning_and_content_are_both_there(client):
    choice = _chat(client, "Compute 64 - 29.")  # thinking on: the renderer's default
    assert choice.finish_reason == "stop"
    assert choice.message.reasoning_content.strip() and choice.message.content.strip()


def test_a_tool_prompt_yields_a_schema_valid_call(client):
    tool = TOOLS["get_weather"]
    choice = _chat(client, "What is the weather in Kyoto?", tools=[tool], tool_choice="auto")  # a city never seen
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])
