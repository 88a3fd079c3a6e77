"""Host synchronisations per engine step (tests/host_syncs.py counts them): the end state of issue 25's sync-free step.

`test_a_step_syncs_at_most_twice`: a decode step — greedy, sampled (top-p, seed, penalties, min_tokens), and
speculative (n-gram; MTP and DSpark on tiny-k3) — reads values back to the host at most `MAX_SYNCS` times, at
batch 1 and at batch 32 alike, on tiny-k3 and tiny-linear. A failure lists where each sync comes from (a short stack
summary): the model forward and the kernels are the lead's (engine/model/, kernels/), the drafters helper
"draft"'s; the step around them (scheduling, sampling, verification, the update) is engine/core.py,
engine/step_sampling.py and engine/sampling.py, which must stay at one read-back
(`test_the_engine_host_part_reads_back_once`).
Negative control: a deliberate `.item()` added to the sampler is caught, and located in engine/sampling.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.sampling import Sampler, SamplingParams
from tests.host_syncs import count_host_syncs
from tests.unit.engine.conftest import CHECKPOINT_SEED, random_prompts

MAX_SYNCS = 2  # per step: the step's one read-back, plus one spare
STEPS = 3
K = 3
# files the step's own host work lives in (the rest of a step's syncs: the model forward, kernels, drafters)
ENGINE_HOST_FILES = ("engine/core.py", "engine/step_sampling.py", "engine/sampling.py", "engine/spec/decoding.py",
                     "engine/spec/accept.py", "engine/scheduler.py", "engine/request.py", "engine/outputs.py",
                     "engine/llm.py")


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3-dspark", tmp_path_factory.mktemp("tiny-k3-dspark"), seed=CHECKPOINT_SEED)


def _spec_config(mode: str, dspark_dir) -> dict | None:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "mtp": {"method": "mtp", "num_speculative_tokens": K},
            "dspark": {"method": "dspark", "num_speculative_tokens": K, "model": str(dspark_dir)}}.get(mode)


def _params(mode: str, i: int) -> SamplingParams:
    if mode == "sampled":
        return SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i, min_tokens=8,
                              presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1)
    if mode == "ngram":  # negative penalties make the output repeat itself, so prompt lookup drafts every step
        return SamplingParams(max_tokens=64, ignore_eos=True, temperature=0, frequency_penalty=-2.0,
                              presence_penalty=-2.0)
    return SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)


def _decoding_engine(model_dir, mode: str, batch: int, dspark_dir):
    spec = _spec_config(mode, dspark_dir)
    llm = LLM(model_dir, max_num_seqs=batch, kv_cache_memory="64MiB", max_num_batched_tokens=512,
              **({"speculative_config": spec} if spec else {}))
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(batch, 8, 13, seed=batch)):
        engine.add_request(str(i), prompt, _params(mode, i))
    for _ in range(6):  # prefill, then a few decode steps (the drafters warm up)
        engine.step()
    assert all(r.num_output_tokens >= 2 for r in engine.scheduler.running)
    return engine


def _count(engine, steps: int = STEPS):
    drafts = engine.spec.num_drafts if engine.spec is not None else 0
    with count_host_syncs(engine.runner.device) as syncs:
        for _ in range(steps):
            engine.step()
    verified = (engine.spec.num_drafts - drafts) if engine.spec is not None else 0
    return syncs, verified


CASES = [(family, mode) for family in ("tiny_k3_dir", "tiny_linear_dir") for mode in ("greedy", "sampled", "ngram")]
CASES += [("tiny_k3_dir", "mtp"), ("tiny_k3_dir", "dspark")]


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("family,mode", CASES)
def test_a_step_syncs_at_most_twice(family, mode, batch, request, dspark_dir):
    engine = _decoding_engine(request.getfixturevalue(family), mode, batch, dspark_dir)
    syncs, verified = _count(engine)
    if mode in ("ngram", "mtp", "dspark"):
        assert verified >= STEPS, "every counted step verifies drafts"
    per_step = len(syncs.events) / STEPS
    assert per_step <= MAX_SYNCS, f"{per_step:.1f} host syncs per step ({family}, {mode}, batch {batch}):\n" \
                                  f"{syncs.report()}"


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("family,mode", CASES)
def test_the_engine_host_part_reads_back_once(family, mode, batch, request, dspark_dir):
    """The part of the step outside the model, kernels and drafters: exactly one read-back per step."""
    engine = _decoding_engine(request.getfixturevalue(family), mode, batch, dspark_dir)
    syncs, _ = _count(engine)
    own = [e for e in syncs.events if e.file.startswith(ENGINE_HOST_FILES)]
    assert len(own) == STEPS, "\n".join(f"{e.kind}: {e.where}" for e in own)


def test_a_deliberate_item_in_the_sampler_is_caught(tiny_k3_dir, dspark_dir, monkeypatch):
    engine = _decoding_engine(tiny_k3_dir, "greedy", 1, dspark_dir)
    clean, _ = _count(engine)
    pick = Sampler.pick

    def pick_and_read(x: torch.Tensor, batch):
        x.max().item()  # the deliberate sync
        return pick(x, batch)

    monkeypatch.setattr(Sampler, "pick", staticmethod(pick_and_read))
    dirty, _ = _count(engine)
    extra = [e for e in dirty.events if e.kind == "scalar read" and e.file == "tests/unit/engine/test_host_syncs.py"]
    assert len(dirty.events) - len(clean.events) == STEPS and len(extra) == STEPS
    assert "engine/sampling.py" in extra[0].where  # located: the stack names the sampler that called it
