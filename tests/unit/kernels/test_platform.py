"""Platform choice: a HIP build of torch is ROCm — FlashInfer is never tried there (not even when forced: it falls
back per op with a warning), Triton comes first where it imports; the start-up line names the platform, each op's
backend and what is unavailable and why. Negative control: the same registry on a CUDA build does try FlashInfer."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from kernels import registry


@pytest.fixture
def rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv(registry.ENV_FORCE, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


@pytest.fixture
def nvidia(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv(registry.ENV_FORCE, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


def test_rocm_never_tries_flashinfer(rocm):
    assert registry.platform("cuda") == "rocm" and registry.platform("cpu") == "cpu"
    assert registry.preference("cuda") == ["triton", "torch"]
    assert not registry.backend_available("flashinfer", "cuda")
    triton_here = importlib.util.find_spec("triton") is not None
    assert registry.chosen_backend("mla_attention", "cuda") == ("triton" if triton_here else "torch")
    line = registry.platform_summary("cuda")
    assert line.startswith("kernel platform rocm (HIP 6.2.41133): ") and "flashinfer" not in line.split(";")[0]
    assert "vision_attention" in line and ("triton not installed" in line) != triton_here


def test_forcing_flashinfer_on_rocm_falls_back_with_a_warning(rocm, monkeypatch, caplog):
    monkeypatch.setenv(registry.ENV_FORCE, "flashinfer")
    assert registry.preference("cuda")[0] == "flashinfer"
    with caplog.at_level(logging.WARNING, logger="kernels.registry"):
        registry.get_kernel("mla_attention", "cuda")
    assert "backend flashinfer unavailable" in caplog.text
    assert registry.chosen_backend("mla_attention", "cuda") != "flashinfer"
    assert "flashinfer does not exist on ROCm" in registry.platform_summary("cuda")


def test_a_cuda_build_tries_flashinfer_first(nvidia):
    assert registry.platform("cuda") == "cuda"
    assert registry.preference("cuda") == ["flashinfer", "triton", "torch"]
    line = registry.platform_summary("cuda")
    assert line.startswith("kernel platform cuda (CUDA 12.8)")
    if not registry.backend_available("flashinfer", "cuda"):
        assert "flashinfer not installed or not a CUDA device" in line


def test_the_line_is_logged_once_when_a_model_loads(tmp_path, caplog):
    from engine.model.loader import LoadConfig, load_model
    from engine.model.presets import preset_config
    import json

    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny-linear")))
    registry.clear_cache()
    with caplog.at_level(logging.INFO, logger="kernels.registry"):
        load_model(tmp_path, LoadConfig(load_format="dummy"))
        load_model(tmp_path, LoadConfig(load_format="dummy"))
    assert caplog.text.count("kernel platform cpu: torch: ") == 1
