"""KDA kernel benchmark: chunked prefill vs token-by-token recurrence, and decode-step time vs context length.

Run: `python -m bench.bench_kda [--lengths 1024 4096 16384] [--heads 4] [--dim 128] [--threads 2] [--out FILE]`.

Prints markdown tables to stdout (and writes the same numbers as JSON with `--out`):
1. Prefill of one sequence of T tokens: `chunk_kda` (chunkwise WY form, fp32 exponents) against the previous chunked
   implementation (`bench.baselines.kda_chunked_fp64`: fp64 exponents, exact [sub, sub, K] diagonal blocks when a 16-token
   block decays by more than 80) and the baselines `kda_naive` (the readable oracle) and `fused_recurrent_kda` (the
   vectorised time loop), all in the same process with the same torch thread count and denormals flushed (as the
   model forward sets). Each row is timed with two gate regimes: the default lower-bound gate in (-5, 0) (Kimi K3),
   and strong softplus gates (Kimi Linear with a large A_log: some 16-token block decays by more than 80, which sends
   the previous implementation down its exact path; the lower-bound gate never does, 16 * 5 = 80); the naive and recurrent baselines are timed on the default gates. Every timing is a full run over all T tokens unless the table says "extrapolated": a baseline whose
   estimated run time exceeds `--max-baseline-s` is timed on its first `--probe-tokens` tokens and scaled linearly
   (its cost is linear in T by construction), and the row is marked as such. Times are the best of `--repeats` interleaved runs
   for `chunk_kda` and the previous version, and of 2 for the baselines: the minimum is what survives noise from other processes.
2. One decode step (`kda_decode_pooled`, batch 1) on the state left by prefills of different lengths, against a
   full-softmax-attention decode step over a KV cache of the same length as the contrast: KDA's step is flat in
   context length, attention's grows with it.
Inputs are random with realistic magnitudes (L2-normalised q/k, sigmoid beta, lower-bound gate in (-5, 0)).
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kernels.kda.chunked import chunk_kda, kda_prefill_pooled
from bench.baselines.kda_chunked_fp64 import chunk_kda as chunk_kda_previous
from bench.common import best_time
from kernels.kda.naive import kda_naive
from kernels.kda.recurrent import fused_recurrent_kda, kda_decode_pooled


@dataclass(frozen=True)
class PrefillRow:
    tokens: int
    chunked_s: float
    previous_s: float
    chunked_strong_s: float
    previous_strong_s: float
    naive_s: float
    naive_extrapolated: bool
    recurrent_s: float
    recurrent_extrapolated: bool


@dataclass(frozen=True)
class DecodeRow:
    context: int
    kda_step_ms: float
    attention_step_ms: float


def make_inputs(T: int, H: int, D: int, generator: torch.Generator, strong: bool = False):
    """q, k, v, g, beta for one sequence of T tokens, H heads, head dim D (`strong`: softplus gates with a large
    A_log, -4 * softplus(2 x + 1), x ~ N(0, 1): some 16-token block decays by more than 80 in some channel)."""

    def l2norm(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q = l2norm(torch.randn(T, H, D, generator=generator))
    k = l2norm(torch.randn(T, H, D, generator=generator))
    v = torch.randn(T, H, D, generator=generator)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, D, generator=generator))  # [T, H, D] in (-5, 0)
    if strong:
        g = -4.0 * F.softplus(2.0 * torch.randn(T, H, D, generator=generator) + 1.0)
    beta = torch.sigmoid(torch.randn(T, H, generator=generator))
    return q, k, v, g, beta


def time_baseline(fn, inputs, scale, probe_tokens: int, max_seconds: float) -> tuple[float, bool]:
    """Best of 2 runs of `fn` over all tokens, or over a prefix scaled linearly when a full run would exceed
    `max_seconds`; returns (seconds, extrapolated)."""
    T = inputs[0].shape[0]
    probe = min(T, probe_tokens)
    probe_s = best_time(lambda: fn(*(x[:probe] for x in inputs), scale), repeats=2)
    if probe == T:
        return probe_s, False
    if probe_s * T / probe <= max_seconds:
        return best_time(lambda: fn(*inputs, scale), repeats=2), False
    return probe_s * T / probe, True


def time_interleaved(fns, repeats: int) -> list[float]:
    """Best wall time of each function over `repeats` rounds that call each once, in turn (so noise from other
    processes hits all of them alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_time(fn))
    return best


def bench_prefill(args, generator) -> list[PrefillRow]:
    rows = []
    scale = args.dim**-0.5
    warm = make_inputs(256, args.heads, args.dim, generator)
    chunk_kda(*warm, scale)  # first-call allocations
    chunk_kda_previous(*warm, scale)
    for T in args.lengths:
        inputs = make_inputs(T, args.heads, args.dim, generator)
        strong = make_inputs(T, args.heads, args.dim, generator, strong=True)
        chunked_s, previous_s, chunked_strong_s, previous_strong_s = time_interleaved(
            [lambda: chunk_kda(*inputs, scale), lambda: chunk_kda_previous(*inputs, scale),
             lambda: chunk_kda(*strong, scale), lambda: chunk_kda_previous(*strong, scale)], args.repeats)
        naive_s, naive_ex = time_baseline(kda_naive, inputs, scale, args.probe_tokens, args.max_baseline_s)
        rec_s, rec_ex = time_baseline(fused_recurrent_kda, inputs, scale, args.probe_tokens, args.max_baseline_s)
        rows.append(PrefillRow(T, chunked_s, previous_s, chunked_strong_s, previous_strong_s, naive_s, naive_ex, rec_s,
                               rec_ex))
    return rows


def bench_decode(args, generator) -> list[DecodeRow]:
    rows = []
    H, D = args.heads, args.dim
    scale = D**-0.5
    for T in args.lengths:
        pool = torch.zeros(1, H, D, D)
        slot = torch.zeros(1, dtype=torch.int64)
        kda_prefill_pooled(*make_inputs(T, H, D, generator), scale, torch.tensor([0, T]), pool, slot)
        step = [x[:1] for x in make_inputs(1, H, D, generator)]  # [1, H, *]: one token of one sequence
        kda_ms = _best_ms(lambda: kda_decode_pooled(*step, scale, pool, slot), args.decode_steps)
        q = torch.randn(1, H, 1, D, generator=generator)
        kv = torch.randn(2, 1, H, T, D, generator=generator)
        attn_ms = _best_ms(lambda: F.scaled_dot_product_attention(q, kv[0], kv[1]), args.decode_steps)
        rows.append(DecodeRow(T, kda_ms, attn_ms))
    return rows


def _best_ms(fn, steps: int) -> float:
    """Fastest of `steps` calls, in ms (the decode step is short enough for the minimum to be the clean number)."""
    fn()
    return best_time(fn, repeats=steps) * 1e3


def render(args, prefill: list[PrefillRow], decode: list[DecodeRow]) -> str:
    def mark(seconds: float, extrapolated: bool) -> str:
        return f"{seconds:.2f}" + (" (extrapolated)" if extrapolated else "")

    lines = [
        f"## KDA prefill, one sequence, H={args.heads}, K=V={args.dim}, fp32, torch threads={args.threads}",
        "",
        "| T | chunk_kda (s) | previous chunked (s) | previous / chunked | chunk_kda, strong gates (s) | "
        "previous, strong gates (s) | previous / chunked, strong | kda_naive (s) | fused_recurrent_kda (s) | "
        "naive / chunked | recurrent / chunked |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in prefill:
        lines.append(
            f"| {r.tokens} | {r.chunked_s:.3f} | {r.previous_s:.3f} | {r.previous_s / r.chunked_s:.1f}x | "
            f"{r.chunked_strong_s:.3f} | {r.previous_strong_s:.3f} | {r.previous_strong_s / r.chunked_strong_s:.1f}x | "
            f"{mark(r.naive_s, r.naive_extrapolated)} | {mark(r.recurrent_s, r.recurrent_extrapolated)} | "
            f"{r.naive_s / r.chunked_s:.1f}x | {r.recurrent_s / r.chunked_s:.1f}x |"
        )
    if any(r.naive_extrapolated or r.recurrent_extrapolated for r in prefill):
        lines += ["", f"Extrapolated: timed on the first {args.probe_tokens} tokens and scaled linearly to T."]
    lines += [
        "",
        f"## Decode step, batch 1, H={args.heads}, D={args.dim}: KDA state vs full attention over the context",
        "",
        "| context | kda_decode_pooled (ms) | softmax attention step (ms) |",
        "| ---: | ---: | ---: |",
    ]
    for r in decode:
        lines.append(f"| {r.context} | {r.kda_step_ms:.3f} | {r.attention_step_ms:.3f} |")
    lines += ["", f"Best of {args.decode_steps} steps. The KDA state is [H, K, V] whatever the context length."]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of the chunked versions (best kept)")
    parser.add_argument("--max-baseline-s", type=float, default=60.0, help="longest full baseline run")
    parser.add_argument("--probe-tokens", type=int, default=2048, help="prefix timed before deciding")
    parser.add_argument("--decode-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the model forward sets
    generator = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        prefill = bench_prefill(args, generator)
        decode = bench_decode(args, generator)
    print(render(args, prefill, decode))
    if args.out:
        result = {
            "config": vars(args),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "prefill": [asdict(r) for r in prefill],
            "decode": [asdict(r) for r in decode],
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
