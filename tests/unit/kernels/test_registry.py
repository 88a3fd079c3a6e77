"""Kernel registry: backend choice per device, forced backends, per-op fallback with a warning, log-once."""

import logging

import pytest

import kernels.registry as registry

MY_OPS = ["conv_prefill", "conv_decode", "mla_attention", "moe_experts"]
ALL_OPS = MY_OPS + ["kda_prefill", "kda_decode"]


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_FORCE, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == registry.__name__ and r.levelno == level]


@pytest.mark.parametrize("interpret", [False, True])
def test_cpu_picks_torch_for_every_op(monkeypatch, interpret):
    if interpret:  # the interpreter is for tests: never picked without being forced
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in ALL_OPS:
        assert registry.chosen_backend(op, "cpu") == "torch"
    for op in MY_OPS:
        assert registry.get_kernel(op, "cpu").__module__.split(".")[-1] in {"torch_ops", "torch_paged", "grouped"}


def test_forced_triton_under_interpreter_picks_triton_and_falls_back_per_op(monkeypatch, caplog):
    monkeypatch.setenv(registry.ENV_FORCE, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caplog.set_level(logging.INFO, logger=registry.__name__)
    assert registry.chosen_backend("conv_prefill", "cpu") == "triton"
    assert registry.chosen_backend("kda_decode", "cpu") == "triton"
    assert registry.get_kernel("conv_decode").__module__ == "kernels.conv.triton_ops"
    assert registry.get_kernel("mla_attention").__module__ == "kernels.attention.triton_paged"
    assert not _messages(caplog, logging.WARNING)

    assert registry.chosen_backend("moe_experts_mxfp4", "cpu") == "triton"
    assert not _messages(caplog, logging.WARNING)
    # an op the triton backend lacks: moe_experts as registered before it had a Triton kernel
    monkeypatch.setitem(registry._IMPLS, "moe_experts", {"torch": registry._IMPLS["moe_experts"]["torch"]})
    moe = registry.get_kernel("moe_experts", "cpu")
    assert moe.__module__ == "kernels.moe.grouped"
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and "moe_experts" in warnings[0] and "torch" in warnings[0]


def test_forced_triton_without_interpreter_falls_back_on_cpu(monkeypatch, caplog):
    monkeypatch.setenv(registry.ENV_FORCE, "triton")
    caplog.set_level(logging.WARNING, logger=registry.__name__)
    assert registry.get_kernel("conv_prefill", "cpu").__module__ == "kernels.conv.torch_ops"
    assert len(_messages(caplog, logging.WARNING)) == 1


@pytest.mark.parametrize("op", ["mla_attention", "conv_prefill"])
def test_forced_flashinfer_on_cpu_falls_back_to_torch(monkeypatch, caplog, op):
    monkeypatch.setenv(registry.ENV_FORCE, "flashinfer")
    caplog.set_level(logging.WARNING, logger=registry.__name__)
    fn = registry.get_kernel(op, "cpu")
    assert registry.chosen_backend(op, "cpu") == "torch"
    assert fn.__module__ in {"kernels.attention.torch_paged", "kernels.conv.torch_ops"}
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and "flashinfer" in warnings[0] and "torch" in warnings[0]


def test_flashinfer_never_picked_on_cpu_even_if_importable(monkeypatch):
    monkeypatch.setattr(registry, "_flashinfer_importable", lambda: True)
    assert not registry.backend_available("flashinfer", "cpu")
    assert registry.chosen_backend("mla_attention", "cpu") == "torch"
    monkeypatch.setenv(registry.ENV_FORCE, "flashinfer")
    assert registry.chosen_backend("mla_attention", "cpu") == "torch"


def test_choice_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger=registry.__name__)
    first = registry.get_kernel("mla_attention", "cpu")
    second = registry.get_kernel("mla_attention", "cpu")
    assert first is second
    infos = [m for m in _messages(caplog, logging.INFO) if "mla_attention" in m]
    assert len(infos) == 1 and "torch" in infos[0]


def test_unknown_op_and_bad_force_value(monkeypatch):
    with pytest.raises(KeyError):
        registry.chosen_backend("no_such_op", "cpu")
    monkeypatch.setenv(registry.ENV_FORCE, "cuda-magic")
    with pytest.raises(ValueError):
        registry.chosen_backend("conv_prefill", "cpu")
