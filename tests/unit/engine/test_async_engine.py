"""`AsyncEngine`: streaming deltas off the event loop, abort, cancellation, deadlines, bad requests beside good ones,
and the service API the worker services use."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from engine import AsyncEngine, EngineArgs, SamplingParams
from engine.errors import InvalidRequestError, RequestTimeoutError
from engine.memory.hashing import BlockHasher, root_hash
from tests.unit.engine.conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_args(tiny_linear_dir):
    return EngineArgs(model=str(tiny_linear_dir), kv_cache_memory=4 << 20, max_num_seqs=8)


def run(coro):
    return asyncio.run(coro)


async def collect(engine, request_id, prompt, params, **kwargs):
    outs = []
    async for out in engine.generate(request_id, prompt, params, **kwargs):
        outs.append(out)
    return outs


def test_streams_deltas_that_add_up(engine_args):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            prompts = random_prompts(4, 5, 40, seed=40)
            params = SamplingParams(max_tokens=8, logprobs=1, **GREEDY)
            streams = await asyncio.gather(*[collect(engine, f"r{i}", {"prompt_token_ids": p}, params)
                                             for i, p in enumerate(prompts)])
            await engine.check_integrity()
            return streams

    for outs in run(main()):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        final = outs[-1].outputs[0]
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == final.text
        assert sum(len(o.outputs[0].delta_logprobs) for o in outs) == 8
        assert final.finish_reason == "length" and len(outs) > 1


def test_stop_strings_are_never_streamed(engine_args, tiny_linear_dir):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            prompt = {"prompt_token_ids": random_prompts(1, 20, 21, seed=41)[0]}
            full = await collect(engine, "full", prompt, SamplingParams(max_tokens=20, **GREEDY))
            text = full[-1].outputs[0].text
            stop = text[8:12]
            cut = await collect(engine, "cut", prompt, SamplingParams(max_tokens=20, stop=[stop], **GREEDY))
            return text, stop, cut

    text, stop, cut = run(main())
    streamed = "".join(o.outputs[0].delta_text for o in cut)
    assert streamed == text[: text.find(stop)] and stop not in streamed
    assert cut[-1].outputs[0].stop_reason == stop


def test_abort_and_cancellation(engine_args):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            long = SamplingParams(max_tokens=None, **GREEDY)
            prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
            gen = engine.generate("aborted", prompt, long)
            first = await gen.__anext__()
            assert not first.finished
            assert await engine.abort("aborted")
            rest = [o async for o in gen]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

            async def consume():
                async for _ in engine.generate("cancelled", prompt, long):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async for _ in engine.generate("broken", prompt, long):
                break  # leaving the loop early aborts too
            await asyncio.sleep(0)  # let the generator close
            for _ in range(100):
                stats = await engine.stats()
                if stats.num_running == 0 and stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats.num_running == 0 and stats.num_waiting == 0
            await engine.check_integrity()
            assert not engine.core.has_unfinished_requests()

    run(main())


def test_a_cancellation_while_the_step_thread_adds_still_aborts(engine_args, monkeypatch):
    """The race of a client that goes away while the step thread runs its `add_request`: the add completes after
    the awaiting task was cancelled, and the stream must still abort the request (it used to run to the context
    limit: the step count says which)."""
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            started, added = threading.Event(), threading.Event()
            real_add = engine.core.add_request

            def slow_add(*args, **kwargs):
                started.set()
                time.sleep(0.3)  # the client goes away meanwhile
                try:
                    return real_add(*args, **kwargs)
                finally:
                    added.set()

            monkeypatch.setattr(engine.core, "add_request", slow_add)
            long = SamplingParams(max_tokens=None, **GREEDY)

            async def consume():
                async for _ in engine.generate("raced", {"prompt_token_ids": [1, 2, 3]}, long):
                    pass

            steps = engine.core.num_steps
            task = asyncio.create_task(consume())
            while not started.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while not added.is_set():
                await asyncio.sleep(0.01)
            for _ in range(200):
                await asyncio.sleep(0.02)
                if not engine.core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            assert not engine.core.has_unfinished_requests(), "the raced request was never aborted"
            assert engine.core.num_steps - steps < 20, "the raced request ran on after its stream was cancelled"
            await engine.check_integrity()

    run(main())


def test_bad_requests_fail_alone(engine_args):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            good = asyncio.create_task(collect(engine, "good", {"prompt_token_ids": [5, 6, 7]},
                                               SamplingParams(max_tokens=30, **GREEDY)))
            await asyncio.sleep(0.05)
            with pytest.raises(InvalidRequestError):
                await collect(engine, "too-long", {"prompt_token_ids": [1] * 10 ** 6}, SamplingParams())
            with pytest.raises(InvalidRequestError):
                await collect(engine, "empty", {"prompt_token_ids": []}, SamplingParams())
            with pytest.raises(InvalidRequestError):
                SamplingParams(top_p=2.0)
            outs = await good
            assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 30
            after = await collect(engine, "after", "Hello", SamplingParams(max_tokens=3, **GREEDY))
            assert after[-1].finished

    run(main())


def test_step_loop_runs_off_the_event_loop(engine_args):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            ticks = 0
            done = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not done.is_set():
                    ticks += 1
                    await asyncio.sleep(0.001)

            t = asyncio.create_task(ticker())
            outs = await collect(engine, "r", {"prompt_token_ids": list(range(60))},
                                 SamplingParams(max_tokens=40, **GREEDY))
            done.set()
            await t
            assert engine._thread is not threading.current_thread()
            return ticks, outs

    ticks, outs = run(main())
    assert outs[-1].finished and ticks > 10


def test_deadline_aborts(engine_args):
    async def main():
        async with await AsyncEngine.create(engine_args) as engine:
            with pytest.raises(RequestTimeoutError):
                await collect(engine, "slow", {"prompt_token_ids": [1, 2, 3]},
                              SamplingParams(max_tokens=None, **GREEDY),
                              deadline=time.monotonic() + 0.3)
            for _ in range(100):
                if not (await engine.stats()).num_running:
                    break
                await asyncio.sleep(0.02)
            assert (await engine.stats()).num_running == 0

    run(main())


def test_service_api_answers_from_the_step_thread(engine_args):
    """The worker services' API: a prefix probe by the admission rule, presence, and a stats snapshot the step
    thread publishes (read without waiting); `validate_prompt` checks like admission without queueing anything."""
    async def main():
        prompt = random_prompts(1, 40, 41, seed=12)[0]
        async with await AsyncEngine.create(dataclasses.replace(engine_args, snapshot_interval=16)) as engine:
            layout = engine.layout
            hashes: list[bytes] = []
            BlockHasher(layout.block_size, root_hash(layout.fingerprint, None)).extend(hashes, prompt)
            assert await engine.probe_prefix(hashes, len(prompt)) == (0, engine.stats_snapshot())
            assert engine.validate_prompt(prompt, SamplingParams(max_tokens=4))[1:] == (prompt, 4)
            with pytest.raises(InvalidRequestError):
                engine.validate_prompt(prompt, SamplingParams(max_tokens=10 ** 6))
            await collect(engine, "warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, **GREEDY))
            cached, stats = await engine.probe_prefix(hashes, len(prompt))
            assert cached == 32 and stats.num_running == stats.num_waiting == 0  # 2 blocks + their snapshot
            presence = await engine.prefix_presence(hashes)
            assert presence.blocks == [True, True] and presence.snapshots == [True, True]
            assert engine.stats_snapshot().prefix_lookup_tokens == len(prompt)
    run(main())
