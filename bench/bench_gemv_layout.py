"""Small-batch products on CPU: a decode step's weights read row-major vs input-major by MKL, and by our kernel.

Usage: `python -m bench.bench_gemv_layout [--presets small-linear-kda12,demo-k3] [--rows 1] [--threads 1] [--repeats 7]
[--out FILE]`

For each preset (`demo-k3`: its architecture, `engine.model.presets.demo_k3_config`; `NAME-kda12`: the preset
with as many KDA heads as attention heads, as bench/llamacpp.py compares it), the model is built on the meta
device and every dense product a decode token runs is listed as it runs: a fused group's members as one product of
the group's width (`engine.model.fused.product_rows`), MLA's reshaped `kv_b_proj`, tied and MoE expert weights
left out. Each distinct shape `[rows, in] x [in, out]` (`--rows`: 1 for a decode token, k + 1 for a verification
of k drafts; several values give a table each) is timed as `torch.mm` with the weight row-major (the checkpoint's
layout: `F.linear` on `[out, in]`) and input-major (`[in, out]` contiguous) through MKL, and input-major through
kernels/cpu/small_gemm.py where it is built and `takes` the shape (`small_gemm us`; at one row and one thread too,
where `runs` leaves the product to MKL), on enough copies of the weight to exceed the caches
(cold weights, as in a step), interleaved, best of `--repeats`. Reported per shape: how many the step runs, the
times, GB/s of the fastest MKL layout, which MKL layout is faster and which `prefers_input_major` picks; and the
step's total for all-input-major, all-row-major, the rule, the per-shape best MKL layout and the kernel.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import report

COLD_BYTES = 96 << 20  # weight copies per shape: at least this many bytes, so each product reads from memory


def product_shapes(preset: str) -> Counter:
    """(out, in) -> how many of a decode token's dense products have that shape."""
    from torch import nn

    from engine.model.config import ModelConfig
    from engine.model.fused import ROW_MAJOR_WEIGHTS, embedding_weights, product_rows
    from engine.model.model import KimiForCausalLM
    from engine.model.presets import demo_k3_config, preset_config

    if preset == "demo-k3":
        raw = demo_k3_config()
    else:
        raw = preset_config(preset.removesuffix("-kda12"))
        if preset.endswith("-kda12"):  # bench/llamacpp.py's variant: as many KDA heads as attention heads
            raw["linear_attn_config"] = dict(raw["linear_attn_config"], num_heads=raw["num_attention_heads"])
    with torch.device("meta"):
        model = KimiForCausalLM(ModelConfig.from_dict(raw))
    rows = product_rows(model)
    tied = embedding_weights(model)
    counted: set[tuple[int, int]] = set()  # (group width, id of the group's first member) already counted
    shapes: Counter = Counter()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or id(weight) in tied or name.endswith(ROW_MAJOR_WEIGHTS):
            continue
        if "vision" in name or "mtp" in name or weight.shape[0] == 1:  # a one-output weight: both layouts alike
            continue
        width = rows.get(id(weight))
        key = (name.rsplit(".", 1)[0], width) if width else (name, weight.shape[0])
        if width and key in counted:
            continue
        counted.add(key)
        shapes[(width or weight.shape[0], weight.shape[1])] += 1
    return shapes


def time_layouts(out: int, inp: int, repeats: int, rows: int = 1) -> tuple[float, float, float | None]:
    """(MKL row-major s, MKL input-major s, small_gemm s or None where it is not built) of one
    `[rows, inp] x [inp, out]` product, cold weights, best of `repeats`."""
    from kernels.cpu import small_gemm

    copies = max(2, COLD_BYTES // (out * inp * 4))
    row_major = [torch.randn(out, inp) for _ in range(copies)]
    input_major = [torch.randn(inp, out) for _ in range(copies)]
    x = torch.randn(rows, inp)
    runs = [(row_major, lambda w: F.linear(x, w)), (input_major, lambda w: torch.mm(x, w))]
    if small_gemm.available() and small_gemm.takes(out, inp, torch.float32, "cpu"):  # timed at one row and thread
        # too, where `runs` leaves the product to MKL; it reads the input-major weight, as MKL's GEMV does
        runs.append((input_major, lambda w: small_gemm.linear(x, w.t())))
    best = [float("inf")] * len(runs)
    for _ in range(repeats):  # interleaved: every path sees the same load
        for i, (weights, run) in enumerate(runs):
            start = time.perf_counter()
            for w in weights:
                run(w)
            best[i] = min(best[i], (time.perf_counter() - start) / len(weights))
    return best[0], best[1], best[2] if len(best) > 2 else None


def measure(preset: str, repeats: int, rows: int = 1) -> list[dict]:
    from engine.model.fused import prefers_input_major

    out_rows = []
    for (out, inp), count in sorted(product_shapes(preset).items()):
        row_s, input_s, kernel_s = time_layouts(out, inp, repeats, rows)
        out_rows.append({"preset": preset, "rows": rows, "out": out, "in": inp, "count": count,
                         "row_major_us": row_s * 1e6, "input_major_us": input_s * 1e6,
                         "small_gemm_us": None if kernel_s is None else kernel_s * 1e6,
                         "gb_s": out * inp * 4 / min(row_s, input_s) / 1e9,
                         "faster": "input" if input_s < row_s else "row",
                         "rule": "input" if prefers_input_major(out, inp) else "row"})
    return out_rows


def totals(rows: list[dict]) -> dict[str, float]:
    """A token's product time (us) under each layout policy."""
    pick = {"input": "input_major_us", "row": "row_major_us"}
    sums = {"all input-major": sum(r["count"] * r["input_major_us"] for r in rows),
            "all row-major": sum(r["count"] * r["row_major_us"] for r in rows),
            "the rule": sum(r["count"] * r[pick[r["rule"]]] for r in rows),
            "best per shape": sum(r["count"] * min(r["row_major_us"], r["input_major_us"]) for r in rows)}
    if rows and all(r["small_gemm_us"] is not None for r in rows):
        sums["small_gemm"] = sum(r["count"] * r["small_gemm_us"] for r in rows)
    return sums


def table(rows: list[dict]) -> str:
    lines = ["| preset | rows | product [rows, in] x [in, out] | per token | row-major us | input-major us | "
             "small_gemm us | GB/s | faster | rule |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        kernel = "-" if r["small_gemm_us"] is None else f"{r['small_gemm_us']:.1f}"
        lines.append(f"| {r['preset']} | {r['rows']} | {r['in']} -> {r['out']} | {r['count']} | "
                     f"{r['row_major_us']:.1f} | {r['input_major_us']:.1f} | {kernel} | {r['gb_s']:.1f} | "
                     f"{r['faster']} | {r['rule']} |")
    for preset, n in dict.fromkeys((r["preset"], r["rows"]) for r in rows):
        sums = totals([r for r in rows if (r["preset"], r["rows"]) == (preset, n)])
        lines.append(f"\n{preset}, {n} row(s), a token's products: "
                     + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in sums.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="small-linear-kda12,demo-k3")
    parser.add_argument("--rows", default="1", help="comma-separated row counts (1: decode; k + 1: a verification)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [row for preset in args.presets.split(",") for n in map(int, args.rows.split(","))
            for row in measure(preset, args.repeats, n)]
    return report(table(rows), args, rows)


if __name__ == "__main__":
    raise SystemExit(main())
