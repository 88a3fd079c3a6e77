"""Pipeline parallelism through the engine API: `LLM(..., pipeline_parallel_size=2)` on CPU gloo.

Checked: PP=2 and TP=2 x PP=2 (4 ranks) give TP=1's greedy tokens, with prefix-cache hits (a second round whose
prompts share the first round's prefix); a state exported by the PP=2 worker (`read_state` / `read_blocks` gathered
from the owning stages) continues on a TP=2 worker and on TP=1 exactly as the TP=1 export does, and a TP=1 export
continues on PP=2 (`write_*` scattered to the owning stages), also streamed block by block with a lean state
(zeroed blocks change the logprobs). Negative control: a different export (another
prompt's) resumes to different tokens, so the resume comparison can fail. Options a pipeline cannot honour are
refused by name.
"""

from __future__ import annotations

import pytest

from engine.config import EngineArgs, EngineConfigError
from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.sampling import SamplingParams
from tests.unit.parallel.engine_prompts import (GREEDY, PROMPTS, engine_args, output_logprobs, output_tokens,
                                                stream_in)

SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
ARGS = engine_args(collective_timeout_s=30.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("pp") / "tiny-k3", seed=5))


def _rounds(llm: LLM) -> tuple[list[list[int]], int]:
    first = llm.generate(PROMPTS[:1], GREEDY)
    second = llm.generate(PROMPTS, GREEDY)  # the shared prefix now comes from the cache
    return output_tokens(first) + output_tokens(second), sum(o.num_cached_tokens for o in second)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **ARGS)
    tokens, cached = _rounds(llm)
    exported = llm.generate(PROMPTS[:1], SHORT, export=True)[0].exported
    other = llm.generate(PROMPTS[2:], SHORT, export=True)[0].exported
    resumed = output_tokens(llm.resume([exported], GREEDY))
    assert output_tokens(llm.resume([other], GREEDY)) != resumed  # negative control for the resume comparisons
    return tokens, cached, exported, resumed


def test_pp2_with_prefix_hits_and_handoffs(model_dir, reference):
    tokens, cached, exported, resumed = reference
    assert cached > 0
    llm = LLM(model_dir, pipeline_parallel_size=2, **ARGS)
    try:
        assert _rounds(llm) == (tokens, cached)
        assert output_tokens(llm.resume([exported], GREEDY)) == resumed  # a TP=1 export continues at PP=2
        streamed = stream_in(llm, exported, LOGPROBS)  # block by block into both stages, then the lean state
        assert output_tokens(streamed) == resumed
        zeroed = stream_in(llm, exported, LOGPROBS, zero_blocks=True)  # control: the streamed blocks are read
        assert max(abs(a - b) for a, b in zip(output_logprobs(zeroed), output_logprobs(streamed))) > 1e-3
        back = llm.generate(PROMPTS[:1], SHORT, export=True)[0].exported  # gathered from both stages
    finally:
        llm.close()
    tp2 = LLM(model_dir, tensor_parallel_size=2, **ARGS)
    try:
        assert output_tokens(tp2.resume([back], GREEDY)) == resumed  # a PP=2 prefill worker hands off to TP=2 decode
    finally:
        tp2.close()
    assert output_tokens(LLM(model_dir, **ARGS).resume([back], GREEDY)) == resumed


def test_tp2_x_pp2_equals_tp1(model_dir, reference):
    tokens, cached, _, _ = reference
    llm = LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, **ARGS)
    try:
        assert _rounds(llm) == (tokens, cached)
    finally:
        llm.close()


@pytest.mark.parametrize("extra,flag", [
    (dict(gpu_memory_utilization=0.5), "--gpu-memory-utilization"),
    (dict(load_format="fastsafetensors"), "fastsafetensors"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
])
def test_refused_options_name_themselves(model_dir, extra, flag):
    with pytest.raises(EngineConfigError, match=flag):
        EngineArgs(model=model_dir, **{"pipeline_parallel_size": 2, **extra})
