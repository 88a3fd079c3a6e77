"""Triton KDA kernels (CPU interpreter, `TRITON_INTERPRET=1`) against the torch ones, on tiny shapes.

Triton must be imported with `TRITON_INTERPRET=1` already set (its own `tl.*` helpers are decorated at import), and
the variable changes what the kernel registry reports for the whole process. So, unless this session already runs with
`TRITON_INTERPRET=1`, the Triton tests below are deselected in-process and `test_triton_kernels_in_interpreter` reruns
this file in a child pytest with the variable set.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.kda.chunked import kda_prefill_pooled as torch_prefill
from kernels.kda.naive import kda_naive
from kernels.kda.recurrent import kda_decode_pooled as torch_decode
from kernels.registry import _IMPLS

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.triton_interpreter  # selected only in the TRITON_INTERPRET=1 child (tests/conftest.py)
REPO_ROOT = Path(__file__).resolve().parents[3]
H, K = 2, 16


@pytest.mark.triton_parent
def test_triton_kernels_in_interpreter():
    importlib.import_module("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    this_file = str(Path(__file__).resolve())
    cmd = [sys.executable, "-m", "pytest", this_file, "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = re.search(r"(\d+) passed", result.stdout)
    assert summary and int(summary.group(1)) >= 8 and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.fixture(scope="module")
def triton_kda():
    """(triton_chunked, triton_recurrent), imported in interpreter mode."""
    importlib.import_module("triton")
    chunked = importlib.import_module("kernels.kda.triton_chunked")
    return chunked, importlib.import_module("kernels.kda.triton_recurrent")


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def make_inputs(T, V, dtype=torch.float32):
    q = l2norm(torch.randn(T, H, K)).to(dtype)
    k = l2norm(torch.randn(T, H, K)).to(dtype)
    v = torch.randn(T, H, V).to(dtype)
    g = (-5.0 * torch.sigmoid(2.0 * torch.randn(T, H, K))).to(dtype)
    beta = torch.sigmoid(torch.randn(T, H)).to(dtype)
    return q, k, v, g, beta


def poisoned_pool(num_slots, V, slots):
    pool = torch.full((num_slots, H, K, V), float("nan"))
    pool[slots] = torch.randn(len(slots), H, K, V)
    return pool


@in_interpreter
@pytest.mark.parametrize("lengths,V", [([1, 5, 34], 16), ([40], 16), ([3, 0, 20], 80)])
def test_triton_prefill_matches_torch(triton_kda, lengths, V):
    chunked, _ = triton_kda
    q, k, v, g, beta = make_inputs(sum(lengths), V)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    slots = torch.tensor([4, 0, 2][: len(lengths)])
    pool = poisoned_pool(6, V, slots)
    pool_ref = pool.clone()
    o = chunked.kda_prefill_pooled(q, k, v, g, beta, 0.25, cu, pool, slots)
    o_ref = torch_prefill(q, k, v, g, beta, 0.25, cu, pool_ref, slots)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (pool[slots] - pool_ref[slots]).abs().max() <= 1e-5
    unused = torch.tensor([i for i in range(6) if i not in slots.tolist()])
    assert torch.isnan(pool[unused]).all()


@in_interpreter
def test_triton_prefill_bf16(triton_kda):
    chunked, _ = triton_kda
    q, k, v, g, beta = make_inputs(37, 16, torch.bfloat16)
    cu = torch.tensor([0, 37])
    pool = torch.zeros(1, H, K, 16)
    o = chunked.kda_prefill_pooled(q, k, v, g, beta, 0.25, cu, pool, torch.tensor([0]))
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.25, None, cu)
    assert o.dtype == torch.bfloat16
    assert (o.float() - o_ref.float()).abs().max() <= 2e-2
    assert (pool - s_ref).abs().max() <= 1e-5


@in_interpreter
def test_triton_decode_steps_match_naive(triton_kda):
    _, recurrent = triton_kda
    N, T, V = 3, 6, 24
    q, k, v, g, beta = (x.view(N, T, *x.shape[1:]) for x in make_inputs(N * T, V))  # [N, T, ...]
    slots = torch.tensor([2, 4, 0])
    pool = poisoned_pool(5, V, slots)
    s0 = pool[slots].clone()
    pool_ref = pool.clone()
    outs = []
    for t in range(T):
        step = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(recurrent.kda_decode_pooled(*step, 0.25, pool, slots))
        assert (outs[-1] - torch_decode(*step, 0.25, pool_ref, slots)).abs().max() <= 1e-5
    o_ref, s_ref = kda_naive(*(x.flatten(0, 1) for x in (q, k, v, g, beta)), 0.25, s0, torch.arange(N + 1) * T)
    assert (torch.stack(outs, 1).flatten(0, 1) - o_ref).abs().max() <= 1e-5
    assert (pool[slots] - s_ref).abs().max() <= 1e-5
    assert torch.isnan(pool[torch.tensor([1, 3])]).all()


@in_interpreter
def test_triton_rejects_fp64(triton_kda):
    _, recurrent = triton_kda
    q, k, v, g, beta = (x.double() for x in make_inputs(2, 16))
    with pytest.raises(TypeError):
        recurrent.kda_decode_pooled(q, k, v, g, beta, 0.25, torch.zeros(2, H, K, 16), torch.tensor([0, 1]))


@in_interpreter
@pytest.mark.parametrize("op", ["kda_prefill", "kda_decode"])
def test_registry_triton_targets_resolve(triton_kda, op):
    module_name, func_name = _IMPLS[op]["triton"].split(":")
    assert callable(getattr(importlib.import_module(module_name), func_name))
