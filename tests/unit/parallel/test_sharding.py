"""How a model splits across ranks: clear errors for what does not divide, slice-only reads, the state layouts,
and fastsafetensors' sharded loading giving the same rank parameters as safetensors slices."""

from __future__ import annotations

import pytest
import torch

import engine.model.sources as sources
from engine.model.checkpoint import make_checkpoint
from engine.model.config import ModelConfig
from engine.model.loader import LoadConfig, build_empty_model, load_model
from engine.model.presets import preset_config
from engine.parallel.comm import RankContext
from engine.parallel.config import ParallelConfig, ParallelError
from engine.parallel.launch import run_ranks
from engine.parallel.state import gather_state, scatter_state
from tests.unit.parallel.ranks import load_both_formats


class FakeComm:
    """A communicator of `size` ranks for building and loading (no collectives are called then)."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def all_reduce(self, x):
        raise AssertionError("no collectives expected")

    all_gather = broadcast_object = barrier = all_reduce


def _ctx(size: int, rank: int = 0, ep: bool = False) -> RankContext:
    return RankContext(ParallelConfig(size, rank, ep), FakeComm(size))


def _config(preset: str = "tiny-linear", **text) -> ModelConfig:
    raw = preset_config(preset)
    target = raw.get("text_config", raw)
    for key, value in text.items():
        if key.startswith("lac_"):
            target["linear_attn_config"][key[4:]] = value
        else:
            target[key] = value
    return ModelConfig.from_dict(raw)


@pytest.mark.parametrize("field,value,named", [
    ("lac_num_heads", 3, "KDA heads"),
    ("num_attention_heads", 3, "MLA heads"),
    ("vocab_size", 8191, "vocab_size"),
    ("moe_intermediate_size", 33, "moe_intermediate_size"),
])
def test_indivisible_dimension_is_a_clear_error(field, value, named):
    config = _config(**{field: value})
    with pytest.raises(ParallelError, match=named) as err:
        build_empty_model(config, torch.float32, "cpu", _ctx(2))
    assert "--tensor-parallel-size 2" in str(err.value)


def test_mxfp4_split_below_a_scale_group_points_to_expert_parallelism():
    config = _config("tiny-k3")  # moe_intermediate 32: 16 per rank, half an MXFP4 group
    with pytest.raises(ParallelError, match="enable-expert-parallel"):
        build_empty_model(config, torch.float32, "cpu", _ctx(2), experts_format="mxfp4")
    build_empty_model(config, torch.float32, "cpu", _ctx(2, ep=True), experts_format="mxfp4")  # whole experts


def test_parallel_config_checks_its_fields():
    with pytest.raises(ParallelError, match="rank"):
        ParallelConfig(2, 2)
    with pytest.raises(ParallelError, match="tensor_parallel_size"):
        ParallelConfig(0, 0)
    with pytest.raises(ParallelError, match="process group"):
        RankContext(ParallelConfig(2, 0), FakeComm(4))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tp") / "tiny-k3", seed=4)


def test_rank_reads_only_its_slices(tiny_dir, monkeypatch):
    """Through `get_slice` only: the bytes read equal the rank's parameter bytes (fp32 checkpoint)."""
    read = {"bytes": 0, "whole": []}
    real_open = sources.safe_open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def get_tensor(self, name):
            read["whole"].append(name)
            return self.handle.get_tensor(name)

        def get_slice(self, name):
            sliced = self.handle.get_slice(name)
            return type("S", (), {"__getitem__": lambda _, index: _count(sliced[index])})()

    def _count(t):
        read["bytes"] += t.numel() * t.element_size()
        return t

    class Opener:
        def __init__(self, *args, **kw):
            self.ctx = real_open(*args, **kw)

        def __enter__(self):
            return Spy(self.ctx.__enter__())

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

    monkeypatch.setattr(sources, "safe_open", Opener)
    model = load_model(tiny_dir, LoadConfig(), _ctx(2, rank=1))
    whole = sum(t.numel() * t.element_size() for t in _whole_tensors(tiny_dir, read["whole"]))
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    a_log_padding = sum(4 * (128 - 1) for n in read["whole"] if n.endswith("A_log"))  # K3 pads A_log to [128]
    assert read["bytes"] + whole == resident + a_log_padding
    assert all(not n.endswith(("q_proj.weight", "o_proj.weight", "embed_tokens.weight", "lm_head.weight"))
               for n in read["whole"])  # split tensors never whole


def _whole_tensors(folder, names):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return [f.get_tensor(n) for n in names]


def test_state_gather_scatter_round_trip():
    gen = torch.Generator().manual_seed(0)
    full = {"conv": torch.randn(3, 3 * 4 * 8, 3, generator=gen), "recurrent": torch.randn(3, 4, 8, 8, generator=gen)}
    pieces = [scatter_state(full, 2, r) for r in range(2)]
    assert pieces[0]["conv"].shape == (3, 3 * 2 * 8, 3) and pieces[1]["recurrent"].shape == (3, 2, 8, 8)
    # rank 1's q channels are the second half of the q block
    assert torch.equal(pieces[1]["conv"][:, :16], full["conv"][:, 16:32])
    back = gather_state(pieces)
    assert all(torch.equal(back[k], full[k]) for k in full)
    assert gather_state([{}, {}]) == {} and scatter_state({}, 2, 0) == {}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_fastsafetensors_sharded_loading_equals_slices(tmp_path, expert_parallel):
    pytest.importorskip("fastsafetensors")
    folder = make_checkpoint("tiny-k3", tmp_path / "sharded", seed=4, max_shard_bytes=1_500_000)  # 3 files
    for rank, (sliced, fast) in enumerate(run_ranks(load_both_formats, 2, (str(folder), expert_parallel))):
        assert sliced.keys() == fast.keys()
        for name in sliced:
            assert torch.equal(sliced[name], fast[name]), (rank, name)
