"""A handoff imported block group by block group (issue 30, item 5): the full blocks enter the engine's prefix cache
through `CacheExchange.import_block_tensors` before the request, whose lean state (`lean_handoff`: the KDA state and
the KV after the last full block) then takes them from the cache (`import_request(..., lean=True)`).

Claims, each with its negative control: the streamed import continues exactly like the colocated run (zeroed
imported blocks, or a zeroed KDA state, change the output: both really come from the import); blocks evicted before
admission make the engine compute the request from its tokens (the same output; a zeroed state then changes nothing,
so it was dropped); a lean state is refused without `lean=True`, and mis-shaped block tensors are refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.transfer import RequestState, ShapeMismatchError, lean_handoff
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ARGS = dict(kv_cache_memory=4 << 20, max_num_seqs=4, snapshot_interval=32, num_snapshot_slots=8)


@pytest.fixture(scope="module")
def engines(tiny_linear_dir):
    return LLM(tiny_linear_dir, **ARGS), LLM(tiny_linear_dir, **ARGS)


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(1, 75, 76, seed=31)[0]  # 4 full blocks of 16 and an 11-token tail


@pytest.fixture(scope="module")
def exported(engines, prompt) -> tuple[RequestState, list[int]]:
    a, _ = engines
    colocated = a.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    first = dataclasses.replace(GREEDY, max_tokens=1)
    [out] = a.generate({"prompt_token_ids": prompt}, first, export=True)
    return RequestState.from_bytes(out.exported.to_bytes()), colocated


def stream_in(llm: LLM, state: RequestState, group: int, kv: torch.Tensor | None = None) -> int:
    """The full blocks of `state` into `llm`'s prefix cache, `group` blocks per call (as the decode worker imports
    them) -> how many are cached afterwards."""
    llm.engine.reset_prefix_cache()
    hashes = state.block_hashes
    kv = (state.kv if kv is None else kv)[:, :len(hashes)]  # [layers, full blocks, bs, dim]
    assert not any(llm.engine.manager.block_pool.get_cached(h) is not None for h in hashes)
    for start in range(0, len(hashes), group):
        llm.engine.exchange.import_block_tensors(hashes[start:start + group], kv[:, start:start + group])
    return sum(1 for h in hashes if llm.engine.manager.block_pool.get_cached(h) is not None)


def resume_lean(llm: LLM, state: RequestState) -> list[int]:
    return llm.resume(lean_handoff(state), GREEDY, check_integrity=True, lean=True)[0].outputs[0].token_ids


def test_streamed_import_continues_like_colocated(engines, exported):
    _, b = engines
    state, colocated = exported
    assert len(state.block_hashes) == 4 and lean_handoff(state).kv.shape[1] == 1
    recomputes = b.engine.scheduler.num_import_recomputes
    for group in (1, 3):
        assert stream_in(b, state, group) == 4
        assert resume_lean(b, state) == colocated
    assert b.engine.scheduler.num_import_recomputes == recomputes  # the imported blocks and state were used
    # negative controls: the blocks and the KDA state really come from the import
    assert stream_in(b, state, 2, kv=torch.zeros_like(state.kv)) == 4
    assert resume_lean(b, state) != colocated
    zeroed = dataclasses.replace(state, state={k: torch.zeros_like(v) for k, v in state.state.items()})
    stream_in(b, state, 2)
    assert resume_lean(b, zeroed) != colocated


def test_blocks_evicted_before_admission_make_it_compute_from_tokens(engines, exported):
    _, b = engines
    state, colocated = exported
    zeroed = dataclasses.replace(state, state={k: torch.zeros_like(v) for k, v in state.state.items()})
    stream_in(b, state, 2)
    b.engine.reset_prefix_cache()  # the imported blocks are free and cached: a reset forgets them
    recomputes = b.engine.scheduler.num_import_recomputes
    assert resume_lean(b, zeroed) == colocated  # the (zeroed) carried state was dropped, the prompt computed
    assert b.engine.scheduler.num_import_recomputes == recomputes + 1


def test_lean_states_and_bad_blocks_are_refused(engines, exported):
    _, b = engines
    state, _ = exported
    with pytest.raises(ShapeMismatchError):
        b.resume(lean_handoff(state), GREEDY)  # a lean state without lean=True
    two_missing = dataclasses.replace(lean_handoff(state), block_hashes=state.block_hashes[:2])
    with pytest.raises(ShapeMismatchError):
        b.resume(two_missing, GREEDY, lean=True)  # the state must name every full block
    with pytest.raises(ShapeMismatchError):
        b.engine.exchange.import_block_tensors(state.block_hashes[:2], state.kv[:, :3])
    assert not b.engine.has_unfinished_requests()
