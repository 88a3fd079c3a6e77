"""The model drafters' compiled steps (engine/spec/draft_graphs.py) on tiny-k3, inductor on CPU.

- Compiled drafts equal eager drafts for a batch of three requests of different lengths (padded to the bucket of
  4) over several steps as every context grows: the graph is built once (the context length is dynamic), and after
  settling its calls run Dynamo's bytecode directly. DSpark's sampled form (compiled block, eager draws) gives the
  eager tokens and distributions.
- Negative controls: noise in a request's own rows changes the compiled drafts (the comparison can fail); without a
  compilation config (`enforce_eager`) nothing is compiled and no graph is called.
inductor builds C++ for each graph: one bucket, one graph per drafter (tens of seconds on two cores).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.compilation import CompilationConfig
from engine.guard_skipping import compiled_graphs
from engine.spec.drafter import DraftQuery
from engine.spec.dspark import build_dspark_drafter
from engine.spec.mtp import build_mtp_drafter
from tests.unit.engine.spec.drafters.conftest import tapped_sequences

K = 3
LENGTHS = (9, 17, 5)  # observed positions of each request before the first proposal
STEPS = 4  # proposals, each followed by observing ACCEPTED + 1 more positions
ACCEPTED = 1
COMPILED = CompilationConfig.parse({"level": 3, "cudagraph_capture_sizes": [4]})


def _build(kind, k3, k3_dir, dspark_dir, compilation, method="greedy"):
    spec = SimpleNamespace(num_speculative_tokens=K, draft_sample_method=method,
                           model=None if kind == "mtp" else str(dspark_dir))
    if kind == "mtp":
        return build_mtp_drafter(k3, k3_dir, spec, max_num_seqs=4, compilation=compilation)
    return build_dspark_drafter(k3, dspark_dir, spec, max_num_seqs=4, compilation=compilation)


@pytest.fixture(scope="module")
def sequences(k3, dspark_dir):
    """Per request: token ids and the tapped rows of (FINAL_TAP,) and of DSpark's taps, long enough for STEPS."""
    return tapped_sequences(k3, dspark_dir, [n + 1 + STEPS * (ACCEPTED + 1) for n in LENGTHS], seed=40)


def _run(drafter, kind, sequences, on_step=None) -> list:
    """STEPS rounds of one batched proposal for every request and the next ACCEPTED + 1 observed positions."""
    ends = list(LENGTHS)
    for i, (ids, taps) in enumerate(sequences):
        drafter.observe(f"r{i}", 0, ids[: ends[i]], taps[kind][: ends[i]])
    proposals = []
    for step in range(STEPS):
        proposals.append(drafter.propose([DraftQuery(f"r{i}", ids[: ends[i] + 1], K)
                                          for i, (ids, _) in enumerate(sequences)]))
        if on_step is not None:
            on_step(step)
        for i, (ids, taps) in enumerate(sequences):
            new = ends[i] + ACCEPTED + 1
            drafter.observe(f"r{i}", ends[i], ids[ends[i]: new], taps[kind][ends[i]: new])
            ends[i] = new
    return proposals


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_compiled_drafts_equal_eager_as_contexts_grow(kind, k3, k3_dir, dspark_dir, sequences):
    want = _run(_build(kind, k3, k3_dir, dspark_dir, None), kind, sequences)
    drafter = _build(kind, k3, k3_dir, dspark_dir, COMPILED)
    graphs_after = {}
    got = _run(drafter, kind, sequences, on_step=lambda step: graphs_after.setdefault(step, compiled_graphs()))
    assert [[d.tokens for d in p] for p in got] == [[d.tokens for d in p] for p in want]
    assert all(len(d.tokens) == K for p in got for d in p) and len({d.tokens for p in got for d in p}) > 1
    assert drafter.graphs.num_calls == STEPS
    assert graphs_after[STEPS - 1] == graphs_after[1]  # longer contexts after the first calls built nothing
    assert drafter.graphs.guards.direct_calls >= STEPS - 2  # settled: Dynamo's bytecode called directly
    if kind == "dspark":  # its context rows are compiled too (a dynamic row count): the eager rows within rounding
        eager_rows = _build(kind, k3, k3_dir, dspark_dir, None)
        _run(eager_rows, kind, sequences)
        assert drafter.context_graphs.num_calls == STEPS  # one flush a proposal
        for i in range(len(sequences)):
            torch.testing.assert_close(drafter.context_rows(f"r{i}"), eager_rows.context_rows(f"r{i}"),
                                       rtol=1e-5, atol=1e-5)
    # negative control: noise in a request's own rows changes its compiled drafts
    slot = drafter.cache.slot_of["r1"]
    drafter.cache.buffer[slot, :4] = torch.randn(drafter.cache.buffer[slot, :4].shape,
                                                 generator=torch.Generator().manual_seed(0)) * 50
    query = DraftQuery("r1", sequences[1][0][: LENGTHS[1] + STEPS * (ACCEPTED + 1) + 1], K)
    eager = _build(kind, k3, k3_dir, dspark_dir, None)
    _run(eager, kind, sequences)
    assert drafter.propose([query])[0].tokens != eager.propose([query])[0].tokens


def test_compiled_dspark_sampled_drafts_equal_eager(k3, k3_dir, dspark_dir, sequences):
    want = _run(_build("dspark", k3, k3_dir, dspark_dir, None, "probabilistic"), "dspark", sequences)
    drafter = _build("dspark", k3, k3_dir, dspark_dir, COMPILED, "probabilistic")
    got = _run(drafter, "dspark", sequences)
    assert drafter.graphs.num_calls == STEPS
    for g, w in zip((d for p in got for d in p), (d for p in want for d in p)):
        assert g.tokens == w.tokens
        torch.testing.assert_close(g.probs, w.probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_enforce_eager_compiles_no_drafter(kind, k3, k3_dir, dspark_dir, sequences):
    drafter = _build(kind, k3, k3_dir, dspark_dir, None)
    before = compiled_graphs()
    _run(drafter, kind, sequences)
    assert not drafter.graphs.compiled and drafter.graphs.num_calls == 0 and compiled_graphs() == before
