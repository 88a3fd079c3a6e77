"""Phase 2 of tensor parallelism through the engine API: `LLM(..., tensor_parallel_size=2)` on CPU gloo.

Checked: greedy tokens equal TP=1's, with prefix-cache hits (a second round of prompts that share the first
round's prefixes) and snapshots copied between slots; a state exported at TP=2 continues at TP=1 and the other way
round (read_state returns all heads, write_state keeps a rank's own); a rank killed with SIGKILL or hung (SIGSTOP)
makes the next step raise `RankFailedError` within the collective timeout; an idle group outlives the collective
timeout (the heartbeat) and a rank hung while idle is noticed; after `close()` no rank process is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.parallel.executor import RankFailedError
from engine.sampling import SamplingParams
from tests.unit.parallel.engine_prompts import GREEDY, PROMPTS, engine_args, output_tokens

ARGS = engine_args(collective_timeout_s=20.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tp") / "tiny-k3", seed=5))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def _rounds(llm: LLM) -> tuple[list[list[int]], int]:
    first = llm.generate(PROMPTS[:1], GREEDY)
    second = llm.generate(PROMPTS, GREEDY)  # the shared prefix now comes from the cache
    return output_tokens(first) + output_tokens(second), sum(o.num_cached_tokens for o in second)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **ARGS)
    tokens, cached = _rounds(llm)
    exported = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), export=True)
    resumed = output_tokens(llm.resume([exported[0].exported], GREEDY))
    return tokens, cached, exported[0].exported, resumed


def test_tp2_with_prefix_hits_equals_tp1(model_dir, reference, monkeypatch):
    """Also: after start-up no command goes through `broadcast_object_list` (tensor payloads only, see
    engine/parallel/channel.py) — steps, prefix hits, slot copies and a state import included."""
    import torch.distributed as dist

    tokens, cached, state, resumed = reference
    assert cached > 0
    llm = LLM(model_dir, tensor_parallel_size=2, **ARGS)
    pickled = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: pickled.append(a))
    try:
        got, got_cached = _rounds(llm)
        assert got == tokens and got_cached == cached
        assert output_tokens(llm.resume([state], GREEDY)) == resumed  # a TP=1 export continues at TP=2
        back = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), export=True)
        assert not pickled and llm.engine.executor.channel.commands > 10
    finally:
        monkeypatch.undo()
        llm.close()
    assert not any(_alive(pid) for pid in llm.engine.executor.rank_pids)
    one = LLM(model_dir, **ARGS)
    assert output_tokens(one.resume([back[0].exported], GREEDY)) == resumed  # a TP=2 export continues at TP=1


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_failed_rank_fails_the_step_and_leaves_no_process(model_dir, fault):
    llm = LLM(model_dir, tensor_parallel_size=2, **{**ARGS, "collective_timeout_s": 5.0})
    pids = llm.engine.executor.rank_pids
    try:
        assert output_tokens(llm.generate(PROMPTS[:1], GREEDY))
        os.kill(pids[0], fault)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError):
            llm.generate(PROMPTS[1:2], GREEDY)
        assert time.monotonic() - t0 < 15.0
        with pytest.raises(RankFailedError):  # and stays failed
            llm.generate(PROMPTS[1:2], GREEDY)
    finally:
        llm.close()
    assert not any(_alive(pid) for pid in pids)


def test_an_idle_group_stays_up_and_a_rank_hung_while_idle_is_noticed(model_dir):
    timeout_s = 3.0
    llm = LLM(model_dir, tensor_parallel_size=2, **{**ARGS, "collective_timeout_s": timeout_s})
    executor = llm.engine.executor
    try:
        first = output_tokens(llm.generate(PROMPTS[:1], GREEDY))
        time.sleep(2.5 * timeout_s)  # the ranks wait in a collective that times out: the heartbeat keeps it fed
        assert executor.healthy()
        assert output_tokens(llm.generate(PROMPTS[:1], GREEDY)) == first
        os.kill(executor.rank_pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        while executor.healthy() and time.monotonic() - t0 < 4 * timeout_s:
            time.sleep(0.1)
        assert not executor.healthy()  # noticed by the heartbeat's barrier, with no request running
    finally:
        llm.close()
    assert not any(_alive(pid) for pid in executor.rank_pids)
