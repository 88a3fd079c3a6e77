"""Structure hints end to end: the gateway hints where a chat's system block ends, the workers snapshot the KDA state
there, and the next chat with the same system prompt and another user message resumes from it (`cached_tokens` is
exactly the hinted boundary rounded down to a KV block), with the output of a cold mesh; another tenant gets 0.

The mesh runs with a snapshot interval beyond the prompts, so periodic snapshots never help: every hit here comes from
the gateway's hint. (Needs the workers that honour `snapshot_hints`, branch h8.)"""

from __future__ import annotations

import openai

from gateway.chat import ChatRenderer
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
BS = 16
NO_PERIODIC = dict(snapshot_interval=4096)
KEYS = "key-a=tenant-a,key-b=tenant-b"
SYSTEM = " ".join(f"Rule {i}: answer politely and cite the harbour log entry {i * 7}." for i in range(23))
USERS = ["Where is the lighthouse?", "Which ships were saved in the storm of the old winter?"]

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def _chat(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _client(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)


async def _ask(client: openai.AsyncOpenAI, user: str) -> tuple[int, str]:
    reply = await client.chat.completions.create(model=MODEL, messages=_chat(user), max_tokens=8, temperature=0)
    message = reply.choices[0].message
    return reply.usage.prompt_tokens_details.cached_tokens, f"{message.model_extra}{message.content}"


def _expected_hit(model_dir) -> int:
    """The system-block hint rounded down to a block; checked to be the last block the two prompts share."""
    renderer = ChatRenderer.from_pretrained(model_dir)
    hint = len(renderer.render(_chat(USERS[0])[:1], add_generation_prompt=False).token_ids)
    first, second = (renderer.render(_chat(u)).token_ids for u in USERS)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert 560 <= hint <= common and common // BS == hint // BS, (hint, common)
    return hint // BS * BS


def test_second_chat_resumes_at_the_system_block_hint(tiny_k3):
    expected = _expected_hit(tiny_k3)

    async def warm():
        async with Mesh(tiny_k3, engine=NO_PERIODIC) as mesh, running_gateway(mesh, tiny_k3, api_keys=KEYS) as gw:
            a, b = _client(gw, "key-a"), _client(gw, "key-b")
            first = await _ask(a, USERS[0])
            await mesh.drain()  # prefill published the hinted snapshot
            second = await _ask(a, USERS[1])
            other_tenant = await _ask(b, USERS[1])
            return first, second, other_tenant

    async def cold():
        async with Mesh(tiny_k3, engine=NO_PERIODIC) as mesh, running_gateway(mesh, tiny_k3, api_keys=KEYS) as gw:
            return await _ask(_client(gw, "key-a"), USERS[1])

    first, second, other_tenant = run(warm(), timeout_s=150)
    assert (first[0], second[0], other_tenant[0]) == (0, expected, 0)
    fresh = run(cold(), timeout_s=100)
    assert fresh[0] == 0 and second[1] == fresh[1] == other_tenant[1]
