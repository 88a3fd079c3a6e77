"""The CPU decode step compiled by inductor with the cache ops inline (kernels/graph_ops.py, `inline=True`).

- compiled (inductor) == eager: greedy tokens and logprobs within 1e-4 on tiny-k3 (KDA and MLA layers; the
  aot_eager tests in test_decode_graphs.py cover both families' tracing), one prompt and a batch, both padding
  the one bucket, decoding across the MLA one-tile bound (the tile made small here, so one generation runs
  the inline MLA decode first and the op's split-KV after a recompile); no graph break;
- the pools are written in place: the same storage before and after, and a state slot no row uses is untouched
  (a functionalised copy-back would keep values right but replace nothing; a lost write changes the tokens);
- negative control: the same compiled step with its pool writes undone after each step (the state a lost write
  leaves) changes the output.
inductor builds C++ for each graph (tens of seconds on two cores): one bucket, one model, two widths.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import graph_ops
from kernels.attention import torch_paged
from tests.unit.engine.conftest import random_prompts
from tests.unit.engine.test_decode_graphs import assert_same, generate

INDUCTOR = {"level": 3, "backend": "inductor", "cudagraph_capture_sizes": [4]}
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
ONE_TILE_BLOCKS = 3  # the tile made to hold 4 rows x 3 blocks: 38-40-token prompts cross it while decoding


def counting(op, calls: list):
    def wrapper(*args):
        calls.append(args[3].shape)  # block_tables
        return op(*args)
    return wrapper


def storages(cache) -> list[int]:
    """Where every pool tensor's memory is (per layer: recurrent states, conv windows, MLA latents)."""
    pools = [*cache.recurrent.values(), *cache.conv.values(), *cache.kv.values()]
    return [t.untyped_storage().data_ptr() for t in pools]


@pytest.fixture(scope="module")
def pair(tiny_k3_dir):
    path = tiny_k3_dir
    eager = LLM(path, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True)
    compiled = LLM(path, kv_cache_memory=8 << 20, max_num_seqs=4, compilation_config=INDUCTOR)
    return eager, compiled


def test_inductor_inline_equals_eager(pair, monkeypatch):
    eager, compiled = pair
    graphs = compiled.engine.runner.runner.graphs
    cache = compiled.engine.runner.runner.cache
    kv = next(iter(cache.kv.values()))  # [blocks, block_size, row]
    monkeypatch.setattr(torch_paged, "ONE_TILE_KEY_ELEMS", 4 * ONE_TILE_BLOCKS * kv.shape[1] * kv.shape[2])
    assert graphs.inline_cache_ops and 38 <= ONE_TILE_BLOCKS * kv.shape[1] < 40 + PARAMS.max_tokens
    torch._dynamo.utils.counters.clear()
    wide = []
    monkeypatch.setattr(graph_ops, "mla_decode", counting(graph_ops.mla_decode, wide))
    pools = storages(cache)
    prompts = random_prompts(3, 38, 41, seed=23)
    runs_before = graphs.num_runs
    assert_same(generate(compiled, prompts[:1], PARAMS), generate(eager, prompts[:1], PARAMS))
    assert_same(generate(compiled, prompts, PARAMS), generate(eager, prompts, PARAMS))  # 3 rows pad the bucket of 4
    assert graphs.num_runs - runs_before >= 2 * (PARAMS.max_tokens - 1)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert storages(cache) == pools
    assert wide  # the op's split-KV ran once the tables outgrew the tile (traced calls: at each build)
    # the equalities above held while settled variants ran without Dynamo's full guard check, and with Dynamo's
    # bytecode called directly (no frame hook, no guard)
    assert graphs.guards.skipped_calls > 0 and (4, 1, True) in graphs.guards.settled and not graphs.guards.specialised
    assert graphs.guards.direct_calls > 0 and (4, 1, True) in graphs.guards.direct
    print("settled", graphs.guards.settled, "skipped", graphs.guards.skipped_calls, "direct", graphs.guards.direct_calls)


def test_inline_writes_only_the_rows_slots(pair, monkeypatch):
    """Each compiled step changes only its rows' state slots and the scratch slot (padding rows) of each pool."""
    _, compiled = pair
    graphs = compiled.engine.runner.runner.graphs
    cache = compiled.engine.runner.runner.cache
    real, checked = graphs.run, []

    def checking(rows):
        before = [pool.clone() for pool in (*cache.recurrent.values(), *cache.conv.values())]
        out = real(rows)
        keep = torch.ones(before[0].shape[0], dtype=torch.bool)
        keep[[*rows.state_slots, graphs.scratch_slot]] = False
        for pool, old in zip((*cache.recurrent.values(), *cache.conv.values()), before):
            assert torch.equal(pool[keep], old[keep])
            assert not torch.equal(pool[rows.state_slots], old[rows.state_slots])
        checked.append(len(rows.ids))
        return out

    monkeypatch.setattr(graphs, "run", checking)
    generate(compiled, random_prompts(2, 8, 9, seed=3), PARAMS)
    assert checked


def test_inline_with_its_writes_undone_differs(pair, monkeypatch):
    """Negative control: the compiled step's KDA pool writes undone after each step give other tokens."""
    eager, compiled = pair
    graphs = compiled.engine.runner.runner.graphs
    cache = compiled.engine.runner.runner.cache
    real = graphs.run

    def forgetting(rows):
        saved = [pool.clone() for pool in cache.recurrent.values()]
        out = real(rows)
        for pool, old in zip(cache.recurrent.values(), saved):
            pool.copy_(old)
        return out

    prompt = random_prompts(1, 20, 21, seed=29)
    want = generate(eager, prompt, PARAMS)
    monkeypatch.setattr(graphs, "run", forgetting)
    got = generate(compiled, prompt, PARAMS)
    assert [t for t, _ in got] != [t for t, _ in want] or not torch.allclose(
        torch.tensor(got[0][1]), torch.tensor(want[0][1]), atol=1e-4)
