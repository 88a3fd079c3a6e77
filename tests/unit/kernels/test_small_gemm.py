"""kernels/cpu/small_gemm.py: the AVX-512/AVX2 small-batch product equals `F.linear`, is batch-invariant, is taken
exactly where `runs` says (eagerly and inside a compiled graph, without a graph break), and a failed build or the
off switch leaves every product on MKL with one log line."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import small_gemm
from kernels.linear import linear


def _cpu_has_vector_fma() -> bool:
    """AVX-512F, or AVX2 with FMA: what the kernel's source builds on (read here, not from the module)."""
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def test_built_exactly_where_the_cpu_and_a_compiler_allow():
    assert small_gemm.available() == (_cpu_has_vector_fma() and shutil.which("c++") is not None)


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same `[out, in]` weight stored input-major, as the loader stores the weights the kernel takes."""
    return weight.t().contiguous().t()


def kernel_here() -> bool:
    """Whether this machine builds the kernel; where it cannot, a test of the kernel checks the fallback instead."""
    if _cpu_has_vector_fma():
        return True
    assert not small_gemm.available() and not small_gemm.runs(torch.randn(1, 512), input_major(torch.randn(512, 512)))
    return False


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features,in_features",  # tails; under 1,024 outputs and rows x outputs <= 4096
                         # streamed (2+ rows through the padded buffer), others in register tiles (1110: a one-vector
                         # tile and scalars after the last whole tile); the last: MKL
                         [(512, 768), (515, 521), (257, 1030), (1024, 384), (1110, 256), (2053, 64), (4099, 64),
                          (256, 64)])
def test_equals_f_linear_and_a_row_does_not_depend_on_its_batch(rows, out_features, in_features):
    if not kernel_here():
        return
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = input_major(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    taken = (small_gemm.takes(out_features, in_features, torch.float32, "cpu")
             and (rows == 1 or weight.numel() >= small_gemm.MIN_MULTI_ROW_ELEMS))
    assert small_gemm.runs(x, weight) == taken
    got = small_gemm.linear(x, weight)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-4, rtol=1e-5)
    alone = torch.cat([small_gemm.linear(x[i:i + 1], weight) for i in range(rows)])
    assert torch.equal(got, alone)  # bitwise: each output is the same chain of multiply-adds
    swapped = weight.clone()
    swapped[[0, -1]] = weight[[-1, 0]]  # negative control: two output rows exchanged are caught
    assert not torch.allclose(small_gemm.linear(x, swapped), F.linear(x, weight), atol=1e-4)


def test_leading_dimensions_and_linear_routing():
    if not kernel_here():
        return
    weight = input_major(torch.randn(520, 512))
    x = torch.randn(2, 3, 512)  # 6 rows
    assert small_gemm.runs(x, weight)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert linear(x, weight).shape == (2, 3, 520)


def test_runs_only_where_the_kernel_applies(monkeypatch):
    monkeypatch.setattr(small_gemm, "available", lambda: True)
    weight, x = input_major(torch.randn(512, 512)), torch.randn(4, 512)
    assert small_gemm.runs(x, weight)
    assert not small_gemm.runs(torch.randn(small_gemm.MAX_ROWS + 1, 512), weight)
    assert not small_gemm.runs(x.bfloat16(), weight.bfloat16())
    assert not small_gemm.runs(x, weight.contiguous())  # row-major: the kernel reads the weight input-major
    assert small_gemm.runs(torch.randn(4, 64), input_major(torch.randn(4096, 64)))  # short rows are no exception
    assert not small_gemm.runs(x, input_major(torch.randn(96, 512)))  # 4 rows under MIN_MULTI_ROW_ELEMS: MKL
    assert not small_gemm.takes(64, 128, torch.float32, "cpu")  # under MIN_WEIGHT_ELEMS: MKL whatever the rows
    with torch.enable_grad():
        assert not small_gemm.runs(x, weight.clone().requires_grad_())
    small = input_major(torch.randn(96, 512))  # under MIN_MULTI_ROW_ELEMS, over MIN_WEIGHT_ELEMS
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):  # one row takes the kernel at any thread count (it streams the weight)
            torch.set_num_threads(count)
            assert small_gemm.runs(x[:1], weight) and small_gemm.runs(x[:1], small) and not small_gemm.runs(x, small)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    assert not small_gemm.runs(x[:2], weight)


def compiled_calls(step, *args) -> tuple[torch.Tensor, set[str]]:
    """`step(*args)` compiled as one graph (`fullgraph`: a break fails) -> (its result, the names of the graph's
    calls, overloads dropped: "kdamesh_cpu.small_gemm")."""
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(step, backend=recording, fullgraph=True)(*args)
    [graph] = graphs
    return got, {str(n.target).removesuffix(".default") for n in graph.graph.nodes if n.op == "call_function"}


def test_a_compiled_graph_calls_the_kernel_without_a_break():
    if not kernel_here():
        return
    weight = input_major(torch.randn(520, 512))

    def step(x):
        return linear(x, weight).relu() + 1

    x = torch.randn(4, 512)
    got, calls = compiled_calls(step, x)
    torch.testing.assert_close(got, F.linear(x, weight).relu() + 1, atol=1e-4, rtol=1e-5)
    assert "kdamesh_cpu.small_gemm" in calls


def test_a_failed_build_leaves_products_on_mkl_and_says_why(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(small_gemm, "build_name", lambda: "kdamesh_small_gemm_test_failed_build")
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    small_gemm._loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=small_gemm.__name__):
            assert not small_gemm._loaded()
        assert any("small_gemm: not built" in r.getMessage() for r in caplog.records)
    finally:
        small_gemm._loaded.cache_clear()


def test_the_off_switch_is_honoured():
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO)\n"
            "from kernels.cpu import small_gemm\n"
            "from kernels.linear import linear\n"
            "w, x = torch.randn(512, 512).t().contiguous().t(), torch.randn(1, 512)\n"
            "assert not small_gemm.available() and not small_gemm.runs(x, w)\n"
            "torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, small_gemm.DISABLE_ENV: "0"})
    assert done.returncode == 0, done.stderr
    assert f"small_gemm: off ({small_gemm.DISABLE_ENV}=0)" in done.stderr


def test_threads_split_the_outputs_and_change_no_bit():
    if not kernel_here():
        return
    gen = torch.Generator().manual_seed(3)
    weight = input_major(torch.randn(1030, 768, generator=gen))  # 65 runs of 16 outputs: split over the threads
    x = torch.randn(3, 768, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = small_gemm.linear(x, weight)
        torch.set_num_threads(2)
        assert torch.equal(small_gemm.linear(x, weight), alone)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, F.linear(x, weight), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize("out_features,in_features", [(512, 768), (515, 521), (1110, 256), (4099, 64)])
def test_an_exact_bf16_copy_gives_the_fp32_weights_bits(rows, out_features, in_features):
    """A weight whose values are bf16 values (a bf16 checkpoint upcast) and its bf16 copy give bitwise the same
    products, streamed or tiled, whole or split over threads; a weight that is not gets no copy."""
    if not kernel_here():
        return
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = input_major(torch.randn(out_features, in_features, generator=gen).bfloat16().float())
    x = torch.randn(rows, in_features, generator=gen)
    compact = small_gemm.compact_copy(weight)
    assert compact is not None and compact.dtype == torch.bfloat16 and small_gemm.input_major(compact)
    assert torch.equal(small_gemm.linear(x, compact), small_gemm.linear(x, weight))
    assert torch.equal(linear(x, weight, compact), small_gemm.linear(x, weight))
    changed = compact.clone()
    changed[0, 0] = changed[0, 0] * 2 + 1  # negative control: the copy is what the kernel reads
    assert not torch.equal(linear(x, weight, changed), linear(x, weight))
    inexact = weight.clone()
    inexact[-1, -1] += 2.0 ** -20  # one value off the bf16 grid: no copy
    assert small_gemm.compact_copy(inexact) is None


def test_a_copy_is_not_used_where_the_weight_learns_or_the_switch_is_off(monkeypatch):
    if not kernel_here():
        return
    weight = input_major(torch.randn(512, 512).bfloat16().float())
    compact = small_gemm.compact_copy(weight)
    changed = compact.clone()
    changed[0, 0] += 1.0
    x = torch.randn(2, 512)
    with torch.enable_grad():  # a weight that learns: its gradient must flow, so the fp32 weight is multiplied
        learning = weight.clone().requires_grad_()
        out = linear(x, learning, changed)
        torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-5)
        assert out.requires_grad
    monkeypatch.setenv(small_gemm.COMPACT_ENV, "0")
    assert small_gemm.compact_copy(weight) is None
