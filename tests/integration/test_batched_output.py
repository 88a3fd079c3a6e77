"""A request the client reads whole gets its tokens in batches (protos/common.proto `output_interval_ms`): the
decode worker sends the first token at once and holds the rest back, merged per choice, for the stall policy's
output interval — one message per stream and interval on the worker's and the gateway's event loops instead of one
per token — with the same tokens, finish reasons and usage as the token-by-token stream. Through the gateway, a
non-streamed chat asks for it and a streamed one does not.

Negative control: the same request streamed arrives as one event per token, so the event counts can tell."""

from __future__ import annotations

import random
from contextlib import aclosing

import openai
import pytest

from gateway.mesh_client import MeshClient, MeshRequest, PDDecider
from gateway.stall import StallPolicy
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh, greedy, prompt_suite

MODEL = "tiny-k3"
TOKENS = 24
LONG = StallPolicy(timeout_s=600.0)  # an output interval of 60 s: a whole request fits in one, however slow the box


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


async def _events(mesh: Mesh, prompt: list[int], route: str, streamed: bool, n: int = 1):
    client = MeshClient([mesh.decode_address], [mesh.prefill_address] if route == "remote" else (),
                        PDDecider(min_uncached_tokens=0 if route == "remote" else 10 ** 9), stall=LONG)
    request = MeshRequest(request_id=f"batched-{random.getrandbits(48):x}", prompt_token_ids=tuple(prompt),
                          sampling=greedy(TOKENS, n=n), timeout_s=60, streamed=streamed)
    try:
        async with aclosing(client.generate(request)) as events:
            return [event async for event in events]
    finally:
        await client.close()


def _by_choice(events) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for event in events:
        tokens.setdefault(event.index, []).extend(event.token_ids)
    return tokens


@pytest.mark.parametrize("route", ["local", "remote"])
def test_a_whole_response_comes_as_its_first_token_then_one_batch(tiny_k3, route):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompt = prompt_suite()[0]
            streamed = await _events(mesh, prompt, route, streamed=True)
            whole = await _events(mesh, prompt, route, streamed=False)
            assert len(streamed) == TOKENS  # the negative control: one event per token
            assert [len(e.token_ids) for e in whole] == [1, TOKENS - 1]
            assert _by_choice(whole) == _by_choice(streamed)
            assert whole[0].cached_tokens is not None and whole[-1].usage == streamed[-1].usage
            assert whole[-1].finish_reason == streamed[-1].finish_reason == "length"
    run(main())


def test_choices_are_batched_apart(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            prompt = prompt_suite()[1]
            streamed = await _events(mesh, prompt, "local", streamed=True, n=2)
            whole = await _events(mesh, prompt, "local", streamed=False, n=2)
            assert len(whole) < len(streamed)
            assert _by_choice(whole) == _by_choice(streamed) and sorted(_by_choice(whole)) == [0, 1]
            assert {e.index for e in whole if e.finish_reason} == {0, 1} and whole[-1].usage == streamed[-1].usage
    run(main())


def test_the_gateway_asks_for_batches_for_non_streamed_requests_only(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh, \
                running_gateway(mesh, tiny_k3, colocated=True, stall_timeout_s=30.0) as gw:
            worker, intervals = mesh.decode_worker, []
            decode = worker.decode

            def spy(job, handoff=None):
                intervals.append(job.output_interval_s)
                return decode(job, handoff)
            worker.decode = spy
            client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "Name three lighthouses."}]
            whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                         temperature=0, extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = [chunk async for chunk in stream]
            assert intervals == [3.0, 0.0]  # a tenth of the 30 s stall limit, and none for the stream
            assert whole.usage.completion_tokens == 8 and chunks[-1].choices[0].finish_reason == "length"
    run(main())
