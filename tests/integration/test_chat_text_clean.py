"""Chat text is clean (issue 28 point 1), through the official `openai` client against a tiny-k3 mesh sampled at
temperature 1 with `ignore_eos` (the random model runs past its message end into new messages, as guidellm's
requests make a trained one do):

- no special-token string reaches `content` or `reasoning_content`, with tools off, with tools and tool_choice
  "auto", streamed and not;
- `tool_choice: "none"` never returns tool markup or calls (the grammar cannot open a tools block);
- the negative control: the same requests with `skip_special_tokens: false` do show special tokens.
"""

from __future__ import annotations

import openai

from engine.tokenizer import KimiTokenizer
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
TOOL = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
QUESTION = [{"role": "user", "content": "What is 27 + 74?"}]
SEEDS = (1, 2, 3)
MAX_TOKENS = 48

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=4)


def _texts(message) -> list[str]:
    return [message.content or "", getattr(message, "reasoning_content", None) or ""]


async def _replies(client, **extra) -> list:
    """The messages of one non-streamed and one streamed request per seed (the streamed folded)."""
    base = dict(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=1.0, n=2,
                extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)
    messages = []
    for seed in SEEDS:
        reply = await client.chat.completions.create(seed=seed, **base)
        messages += [choice.message for choice in reply.choices]
        stream = await client.chat.completions.create(seed=seed, stream=True, **base)
        folded: dict[int, dict] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                text = folded.setdefault(choice.index, {"content": "", "reasoning_content": ""})
                text["content"] += choice.delta.content or ""
                text["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
        messages += [openai.types.chat.ChatCompletionMessage(role="assistant", **text) for text in folded.values()]
    return messages


def test_no_control_token_in_chat_text(tiny_k3):
    specials = sorted(KimiTokenizer.from_pretrained(tiny_k3).special_tokens)

    def leaked(messages) -> list[str]:
        return [text for m in messages for text in _texts(m) if any(s in text for s in specials)]

    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=120)
            plain = await _replies(client)
            with_tools = await _replies(client, tools=[TOOL])
            assert not leaked(plain), leaked(plain)[:2]
            assert not leaked(with_tools), leaked(with_tools)[:2]
            assert any(m.content or m.reasoning_content for m in plain)  # there was text to check

            none = await _replies(client, tools=[TOOL], tool_choice="none")
            assert not leaked(none) and not any(m.tool_calls for m in none)
            assert not any("tool=" in text or "argument key=" in text for m in none for text in _texts(m))

            # the negative control: asked for, the special tokens are shown (the check above can fail)
            shown = await _replies(client, extra_body={"skip_special_tokens": False})
            assert leaked(shown)

    run(main(), timeout_s=600)
