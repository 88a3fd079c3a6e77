"""Prompt logprobs through the gateway and the mesh (remote prefill and colocated), equal to the offline engine's
own (which tests/unit/engine/test_prompt_logprobs.py checks against a full forward): `/v1/completions` with `echo` +
`logprobs` (also `max_tokens` 0), `prompt_logprobs` on completions and chat, the 400s of these fields; and a forced
tool call cut short by `max_tokens` comes back without control markup, streamed or not."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway, sse_events
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods at night."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


@pytest.fixture(scope="module")
def offline(tiny_k3):
    return LLM(tiny_k3, kv_cache_memory=8 << 20, enable_prefix_caching=False)


def engine_prompt_logprobs(llm: LLM, ids: list[int], k: int):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
    return llm.generate([{"prompt_token_ids": ids}], params)[0].prompt_logprobs


async def _completions(gw, llm) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    expected = engine_prompt_logprobs(llm, ids, 2)
    for attempt in range(2):  # the second is identical: the prefix cache is skipped, cached_tokens 0
        reply = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "echo": True,
                                                            "logprobs": 2, "max_tokens": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        [choice] = body["choices"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - expected[p][ids[p]].logprob) < 1e-4, (attempt, p)
            assert len(lp["top_logprobs"][p]) <= 2
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    streamed = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "echo": True,
                                                           "logprobs": 2, "max_tokens": 0, "stream": True})
    chunks = [c["choices"][0] for c in sse_events(streamed.text)]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), []) == lp["token_logprobs"]
    # generation after the echoed prompt, with vLLM's prompt_logprobs too
    reply = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                                        "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                        "prompt_logprobs": 2})
    [choice] = reply.json()["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for p in range(1, len(ids)):
        entry = prompt_lps[p][str(ids[p])]
        assert abs(entry["logprob"] - expected[p][ids[p]].logprob) < 1e-4 and entry["rank"] == expected[p][ids[p]].rank


async def _chat_and_errors(gw) -> None:
    reply = await gw.http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2,
                                                             "prompt_logprobs": 1})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(any(e["rank"] == 1 for e in entry.values()) for entry in body["prompt_logprobs"][1:])
    bad = [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
           ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
           ({"prompt": "x", "logprobs": -1}, "logprobs")]
    for fields, param in bad:
        reply = await gw.http.post("/v1/completions", json={"model": MODEL, **fields})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (fields, reply.text)


async def _forced_call_cut_short(gw) -> None:
    body = {"model": MODEL, "messages": QUESTION, "tools": [WEATHER], "max_tokens": 9, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"thinking": False}}
    reply = (await gw.http.post("/v1/chat/completions", json=body)).json()
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length" and "<|" not in (choice["message"]["content"] or ""), choice
    assert not choice["message"].get("tool_calls")
    streamed = await gw.http.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in sse_events(streamed.text) if c["choices"]]
    assert "<|" not in "".join(d.get("content") or "" for d in deltas)
    assert not any(d.get("tool_calls") for d in deltas)


@pytest.mark.parametrize("colocated", [False, True])
def test_prompt_logprobs_through_the_mesh(tiny_k3, offline, colocated):
    async def main():
        async with Mesh(tiny_k3, engine={"max_num_batched_tokens": 16}) as mesh:  # chunked prefill
            async with running_gateway(mesh, tiny_k3, colocated=colocated) as gw:
                await _completions(gw, offline)
                await _chat_and_errors(gw)
                if not colocated:
                    await _forced_call_cut_short(gw)
    run(main(), timeout_s=240)
