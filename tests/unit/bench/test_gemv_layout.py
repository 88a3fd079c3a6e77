"""bench/bench_gemv_layout.py: a decode token's products listed as they run (a fused group once, at its width), and
the totals per layout policy computed from the rows (the rule's total picks the rule's column)."""

from __future__ import annotations

import torch

from bench import bench_gemv_layout as bench


def test_products_listed_as_they_run():
    shapes = bench.product_shapes("small-linear-kda12")
    # KDA's q/k/v/gates and beta as one fused product, once per KDA layer (6 of 8 layers), at the padded width
    fused = [(out, inp) for (out, inp), n in shapes.items() if inp == 768 and out > 4 * 1536 // 2 and n == 6]
    assert fused and all(out % 16 == 0 for out, _ in fused)
    assert shapes[(8192, 768)] == 1  # the LM head
    assert (1536, 768) not in shapes  # negative control: a fused member is not listed on its own
    assert bench.product_shapes("small-linear") != shapes  # the -kda12 variant has other KDA widths


def test_totals_follow_each_policy(monkeypatch):
    monkeypatch.setattr(bench, "COLD_BYTES", 1 << 16)
    rows = bench.measure("tiny-linear", repeats=1)
    assert rows and all(r["row_major_us"] > 0 and r["input_major_us"] > 0 for r in rows)
    rows = [dict(r, row_major_us=1.0, input_major_us=3.0, small_gemm_us=None, count=2) for r in rows]
    sums = bench.totals(rows)
    inputs = sum(r["rule"] == "input" for r in rows)
    assert sums["all row-major"] == 2.0 * len(rows) and sums["all input-major"] == 6.0 * len(rows)
    assert sums["the rule"] == 2.0 * (len(rows) - inputs) + 6.0 * inputs
    assert sums["best per shape"] == sums["all row-major"]
    assert "tiny-linear, 1 row(s), a token's products" in bench.table(rows)
    assert "small_gemm" not in sums  # negative control below: only rows that timed the kernel total it


def test_the_kernel_column_at_several_rows(monkeypatch):
    from kernels.cpu import small_gemm

    monkeypatch.setattr(bench, "COLD_BYTES", 1 << 16)
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT_ELEMS", 1)  # tiny-linear's products, all of them
    rows = bench.measure("tiny-linear", repeats=1, rows=4)
    assert rows and all(r["rows"] == 4 for r in rows)
    assert all((r["small_gemm_us"] is not None) == (small_gemm.available()
                                                     and small_gemm.takes(r["out"], r["in"], torch.float32, "cpu"))
               for r in rows)
    timed = [dict(r, small_gemm_us=5.0, count=1) for r in rows]
    assert bench.totals(timed)["small_gemm"] == 5.0 * len(rows)
    assert "tiny-linear, 4 row(s)" in bench.table(timed)
