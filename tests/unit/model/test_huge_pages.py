"""engine/model/huge_pages.py: a CPU model's weights are loaded into one mapping advised for transparent huge pages
— the same values and the same logits as without it, views still views (fused groups bound), the old copies
freed — and the off switch (or a kernel with THP off) leaves the model as the allocator made it."""

from __future__ import annotations

import re

import pytest
import torch

from engine.model import huge_pages
from engine.model.checkpoint import make_checkpoint
from engine.model.fused import param_groups
from engine.model.loader import LoadConfig, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny-linear", tmp_path_factory.mktemp("ckpt") / "tiny", seed=5)


def _placed(model) -> list[str]:
    """Names of the parameters stored in the model's huge-page mapping (the storage the largest one is in)."""
    params = dict(model.named_parameters())
    largest = max(params.values(), key=lambda p: p.untyped_storage().nbytes())
    arena = largest.untyped_storage().data_ptr()
    return [name for name, p in params.items() if p.untyped_storage().data_ptr() == arena]


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` is eligible for transparent huge pages (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            if match := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
                inside = int(match[1], 16) <= address < int(match[2], 16)
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    return False


def _logits(model, ids: list[int]) -> torch.Tensor:
    from tests.model_driver import SequenceDriver

    return SequenceDriver(model, max_seqs=1).prefill(0, ids)  # [T, V]


def test_weights_load_onto_huge_pages_with_the_same_values(checkpoint, monkeypatch):
    if huge_pages.huge_pages_unavailable() is not None:
        pytest.skip(f"no transparent huge pages here: {huge_pages.huge_pages_unavailable()}")
    placed = load_model(checkpoint)
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    plain = load_model(checkpoint)
    big = [name for name, p in placed.named_parameters()
           if p.untyped_storage().nbytes() >= huge_pages.MIN_STORAGE_BYTES]
    assert big and set(big) <= set(_placed(placed))  # every large weight in the one mapping
    assert _thp_eligible(placed.get_parameter(big[0]).data_ptr())
    assert len(_placed(plain)) < len(big)  # negative control: the allocator's storages are many
    for name, param in placed.named_parameters():
        assert torch.equal(param, plain.get_parameter(name)), name
        assert param.stride() == plain.get_parameter(name).stride(), name  # the same layout (input-major kept)
    for group in param_groups(placed):
        fused = group.tensor()
        assert fused is not None  # still bound: its members are views of it
        assert all(p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in group.params)
    ids = [3, 17, 42, 8, 99]
    assert torch.equal(_logits(placed, ids), _logits(plain, ids))


def test_the_off_switch_places_nothing(checkpoint, monkeypatch):
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    model = load_model(checkpoint)
    assert huge_pages.place_on_huge_pages(model) == 0
    assert huge_pages.huge_pages_unavailable() == f"{huge_pages.DISABLE_ENV}=0"


def test_thp_off_in_the_kernel_places_nothing(checkpoint, monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert "[never]" in huge_pages.huge_pages_unavailable()
    model = load_model(checkpoint, LoadConfig())
    assert huge_pages.place_on_huge_pages(model) == 0
