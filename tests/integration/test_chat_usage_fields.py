"""Usage fields through the official `openai` client against a tiny-k3 mesh: `completion_tokens_details.
reasoning_tokens` counts the tokens of the reasoning block (all of a reply that never left it; none with thinking
off — the negative control), and vLLM's `stream_options.continuous_usage_stats` puts the usage so far on every
chunk (growing, ending at the trailer's)."""

from __future__ import annotations

import openai

from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
QUESTION = [{"role": "user", "content": "What is 27 + 74?"}]

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=4)


async def _reasoning_tokens(client) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    usage, message = reply.usage, reply.choices[0].message
    assert message.reasoning_content and not message.content  # the random model never leaves its think block
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12
    off = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                               extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0 and off.usage.completion_tokens == 12


async def _continuous_usage(client) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 10 and chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # without continuous_usage_stats only the trailer carries usage
    plain = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    usages = [chunk.usage async for chunk in plain]
    assert all(u is None for u in usages[:-1]) and usages[-1].completion_tokens == 10


def test_usage_fields(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, running_gateway(mesh, tiny_k3) as gw:
            client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=120)
            await _reasoning_tokens(client)
            await _continuous_usage(client)

    run(main(), timeout_s=300)
