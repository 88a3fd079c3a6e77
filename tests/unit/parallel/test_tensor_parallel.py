"""TP=2 (and EP=2) on CPU with gloo equals TP=1, for both families, the released layer patterns and MXFP4 experts.

Each preset runs once in two spawned rank processes (engine/parallel/launch.py) that load every variant of it,
prefill two prompts as one packed batch and decode greedily (tests/unit/parallel/ranks.py); the TP=1 reference runs
here. Checked: logits within 1e-4 of the reference's largest (fp32), the same greedy tokens, both ranks returning
the same full logits, each rank's KDA state slice gathering to the TP=1 state (engine/parallel/state.py), and each
rank's parameter bytes — exactly half of TP=1 for every split parameter, equal for every replicated one. A
deliberately wrong shard (one o_proj's rank slices swapped) must fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.parallel.comm import SingleProcess
from engine.parallel.launch import run_ranks
from engine.parallel.state import gather_state, scatter_state
from tests.unit.parallel.ranks import Variant, run_single, run_variants, runner_steps

REL_TOL = 1e-4
DECODE_STEPS = 4
PROMPTS = [[(37 * i + 11) % 7900 for i in range(17)], [(53 * i + 5) % 7900 for i in range(5)]]
SWAP = "model.layers.0.self_attn.o_proj.weight"
MXFP4_WIDE = {"moe_intermediate_size": 64}  # 32 per rank: a whole MXFP4 scale group

CASES = {
    "tiny-linear": ("tiny-linear", "dense", None, [Variant(), Variant(expert_parallel=True), Variant(swap=SWAP)]),
    "tiny-k3": ("tiny-k3", "dense", None, [Variant(), Variant(expert_parallel=True)]),
    "linear-48b-pattern": ("linear-48b-pattern", "dense", None, [Variant()]),
    "k3-93-pattern": ("k3-93-pattern", "dense", None, [Variant(), Variant(expert_parallel=True)]),
    "tiny-k3-mxfp4": ("tiny-k3", "mxfp4", MXFP4_WIDE,
                      [Variant(), Variant(expert_parallel=True), Variant(experts_format="dense")]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            preset, experts, overrides, variants = CASES[case]
            folder = make_checkpoint(preset, tmp_path_factory.mktemp(case) / preset, seed=1, experts_format=experts,
                                     text_overrides=overrides)
            ranks = run_ranks(run_variants, 2, (str(folder), variants, PROMPTS, DECODE_STEPS), timeout_s=240)
            refs = {v: run_single(str(folder), Variant(experts_format=v.experts_format), PROMPTS, DECODE_STEPS)
                    for v in variants}
            cache[case] = (variants, ranks, refs)
        return cache[case]

    return get


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _check_logits(rank0: dict, rank1: dict, ref: dict) -> None:
    assert torch.equal(rank0["prefill"], rank1["prefill"]) and torch.equal(rank0["decode"], rank1["decode"])
    assert rank0["prefill"].shape == ref["prefill"].shape  # full vocabulary after the all-gather
    assert rel_err(rank0["prefill"], ref["prefill"]) <= REL_TOL
    assert rel_err(rank0["decode"], ref["decode"]) <= REL_TOL
    assert rank0["tokens"] == ref["tokens"]


def _check_state(rank0: dict, rank1: dict, ref: dict) -> None:
    if not ref["state"]:
        return
    for seq in range(len(PROMPTS)):
        slices = [{k: r["state"][k][:, seq] for k in ("conv", "recurrent")} for r in (rank0, rank1)]
        full = gather_state(slices)
        for k in ("conv", "recurrent"):
            assert full[k].shape == ref["state"][k][:, seq].shape
            assert rel_err(full[k], ref["state"][k][:, seq]) <= REL_TOL, k
        for r, piece in enumerate(slices):
            back = scatter_state(full, 2, r)
            assert all(torch.equal(back[k], piece[k]) for k in piece)


def _check_bytes(rank0: dict, ref: dict) -> None:
    split = [name for name, (_, is_split) in rank0["bytes"].items() if is_split]
    replicated = [name for name, (_, is_split) in rank0["bytes"].items() if not is_split]
    assert split and set(rank0["bytes"]) == set(ref["bytes"])
    for name in split:
        assert 2 * rank0["bytes"][name][0] == ref["bytes"][name][0], name
    for name in replicated:
        assert rank0["bytes"][name][0] == ref["bytes"][name][0], name
    sharded_tp1 = sum(ref["bytes"][n][0] for n in split)
    assert sum(rank0["bytes"][n][0] for n in split) * 2 == sharded_tp1


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(runs, case):
    variants, ranks, refs = runs(case)
    for i, variant in enumerate(variants):
        if variant.swap:
            continue
        rank0, rank1, ref = ranks[0][i], ranks[1][i], refs[variant]
        _check_logits(rank0, rank1, ref)
        _check_state(rank0, rank1, ref)
        _check_bytes(rank0, ref)


def test_swapped_shard_fails_the_comparison(runs):
    """Negative control: layer 0's o_proj with the two ranks' input-column slices exchanged."""
    variants, ranks, refs = runs("tiny-linear")
    i = next(i for i, v in enumerate(variants) if v.swap)
    assert rel_err(ranks[0][i]["prefill"], refs[variants[i]]["prefill"]) > 1e-2


def test_packed_experts_equal_dequantised(runs):
    """Same MXFP4 checkpoint: packed resident experts (dequantised per tile in the MoE) give the dense logits."""
    _, _, refs = runs("tiny-k3-mxfp4")
    packed, dense = refs[Variant()], refs[Variant(experts_format="dense")]
    assert rel_err(packed["prefill"], dense["prefill"]) <= 1e-5
    assert rel_err(packed["decode"], dense["decode"]) <= 1e-5
    assert packed["tokens"] == dense["tokens"]
    packed_bytes = sum(b for n, (b, _) in packed["bytes"].items() if ".experts.w" in n)
    dense_bytes = sum(b for n, (b, _) in dense["bytes"].items() if ".experts.w" in n)
    assert packed_bytes / (dense_bytes / 4) == pytest.approx(0.53125)  # bytes per fp32 parameter's worth


def test_runner_steps_broadcast_from_rank0_equal_tp1(tmp_path):
    """`ModelRunner.run_step` with a `RankStep` rank 0 broadcasts: same logits as TP=1, and a state read in the
    TP-independent layout and loaded into another slot continues exactly like the original sequence."""
    folder = str(make_checkpoint("tiny-k3", tmp_path / "tiny-k3", seed=2))
    ref = runner_steps(SingleProcess(), 0, folder)
    ranks = run_ranks(runner_steps, 2, (folder,), timeout_s=240)
    assert rel_err(ref["decode"][1], ref["decode"][0]) <= 1e-6  # the loaded copy continues the same sequence
    for got in ranks:
        assert rel_err(got["prefill"], ref["prefill"]) <= REL_TOL
        assert rel_err(got["decode"], ref["decode"]) <= REL_TOL
        for k in ("conv", "recurrent"):
            assert got["state"][k].shape == ref["state"][k].shape
            assert rel_err(got["state"][k], ref["state"][k]) <= REL_TOL
