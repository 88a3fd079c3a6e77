"""Kimi Linear (the K2 chat format: Jinja template, `<think>`, `functions.NAME:IDX` tool calls) through the gateway
with `--tool-call-parser kimi_k2 --reasoning-parser kimi_k2`: chat, forced tool calls valid against the schema (the
K2 grammar), json_schema output, tokenize parity with the chat template, and a multi-turn tool conversation."""

from __future__ import annotations

import json

import jsonschema
import openai

from gateway.chat import ChatRenderer
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-linear"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 16}, "top": {"type": "integer"}},
    "required": ["query", "top"]}}}
MESSAGES = [{"role": "user", "content": "Find me three papers about linear attention."}]


tiny_linear = checkpoint_fixture("tiny-linear", MODEL, seed=4)


def test_kimi_linear_chat_tools_and_json(tiny_linear):
    async def main():
        async with Mesh(tiny_linear) as mesh, running_gateway(mesh, tiny_linear) as gw:
            client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="x", max_retries=0, timeout=60)
            reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                         temperature=0)
            assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 10
            message = reply.choices[0].message
            assert (message.content or "") + (getattr(message, "reasoning_content", None) or "")

            forced = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[SEARCH], max_tokens=120, temperature=0.7, seed=3,
                tool_choice={"type": "function", "function": {"name": "search"}})
            [call] = forced.choices[0].message.tool_calls
            assert call.id.startswith("functions.search:") and call.function.name == "search"
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, SEARCH["function"]["parameters"])
            assert forced.choices[0].finish_reason == "tool_calls"

            # The call and its result go back into the conversation (ids as the model produced them).
            follow = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                                 {"role": "tool", "tool_call_id": call.id, "content": "[]"}]
            again = await client.chat.completions.create(model=MODEL, messages=follow, tools=[SEARCH],
                                                         max_tokens=5, temperature=0)
            assert again.usage.prompt_tokens > forced.usage.prompt_tokens

            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
            shaped = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)

            # /tokenize renders with the checkpoint's chat template.
            rendered = ChatRenderer.from_pretrained(tiny_linear).render(MESSAGES, [SEARCH], True, None)
            tokens = (await gw.http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES,
                                                            "tools": [SEARCH]})).json()
            assert tokens["tokens"] == rendered.token_ids and tokens["count"] == len(rendered.token_ids)
            await client.close()

    run(main())
