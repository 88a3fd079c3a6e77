"""GPU validation: every kernel backend against the reference at the released models' sizes, and TP=1 / TP=2 model
steps on CUDA, timed; a JSON and a markdown summary at `--out`.

Run: `python -m bench.gpu_validate --out results/gpu_validate.json` (writes `.json` and `.md`, again after each
section, so a run stopped at its time limit keeps what finished). Meant for one H200
in under 5 minutes; with `--quick`, smaller sizes. Without CUDA it records every check as skipped and exits 0 (the
CPU-skipping path; tests/unit/bench runs it). Nothing here is part of the test suite's GPU requirements.

Checks (each: backend, max |got − ref| / max |ref|, median milliseconds, pass/fail at its tolerance, or why it could
not run):
- kernels, every backend registered in kernels.registry (flashinfer, triton, torch) that imports here:
  `kda_prefill` (vs kernels/kda/naive.py) and `kda_decode`, `conv_prefill`, `conv_decode` (vs the torch backend)
  at Kimi-Linear-48B's KDA (32 heads × 128, conv over 3·32·128 channels); `mla_attention` (vs naive) at 32 heads
  × (512 + 64); `moe_experts` (vs naive) at Kimi-Linear's 256 experts top-8 × 1024 × 2304 in bf16 and
  `moe_experts_mxfp4` (vs the torch path) at K3's per-rank EP8 share: 112 of 896 experts (top-16) × 3072 × 3584.
- model steps: `small-k3` (generated, fp32) prefill on CUDA vs CPU, then bf16 prefill + decode timed at TP=1; TP=2
  over NCCL on two GPUs against TP=1 (skipped, and said so, with fewer than two).
- sync: host synchronisations counted with `torch.cuda.set_sync_debug_mode("warn")` (each warning is one call that
  `"error"` mode would refuse; the first ones are named in the note) around, on `tiny-k3`: a model decode forward
  whose batch is already on the device (budget 0), one `EngineCore.step` of a steady greedy decode at batch 4 and
  one of an MTP verification (k = 2) (budget 2 each: issue 25's target of one read-back per step, plus one).
- engine: `EngineCore` decode tok/s (greedy, EOS ignored, the tokens after each request's first over the time after
  the last first token) at batch 1, 16 and 64 on a K3-shaped config with random (`dummy`) bf16 weights: the
  released K3 layer (hidden 7168, 96 KDA and MLA heads, Q-LoRA 1536, latent MoE 3584 × 3072, top-16) with fewer
  layers and experts (`--engine-layers`, `--engine-experts`) so it fits one GPU, and an 8K vocabulary; the note
  extrapolates per-user tok/s to 93 layers from the milliseconds per layer (embedding and LM head included, so it
  is a lower bound). Eager vs graph: the same at batch 1 with `EngineArgs(enforce_eager=True/False)`, reported
  "skipped" while `EngineArgs` has no `enforce_eager` field.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from bench.gpu_checks import (Check, Report, _decode_batch, _prefill_batch, median_ms, model_steps,  # noqa: F401
                             rel_err)
from bench.gpu_validate_engine import (count_syncs, eager_vs_graph_check, engine_checks,  # noqa: F401
                                       k3_shaped_config, sync_checks)
from kernels.registry import _IMPLS, backend_available


def implementation(op: str, backend: str):
    module, name = _IMPLS[op][backend].split(":")
    return getattr(importlib.import_module(module), name)


def run_backends(report: Report, op: str, label: str, make, reference, tol: float, device: str = "cuda") -> None:
    """`make()` -> fresh (args, outputs_of(result, args)); `reference(args)` -> expected outputs."""
    args, outputs = make()
    expected = reference(args)
    for backend in _IMPLS[op]:
        if not backend_available(backend, torch.device(device).type):
            report.add(Check(label, backend, "skipped", note=f"{backend} not available here"))
            continue
        try:
            fn = implementation(op, backend)
            args, outputs = make()
            got = outputs(fn(*args), args)
            err = max(rel_err(g, e) for g, e in zip(got, expected))
            timed = make()[0]
            ms = median_ms(lambda: fn(*timed))
            report.add(Check(label, backend, "pass" if err <= tol else "fail", err, ms))
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported, not fatal
            report.add(Check(label, backend, "error", note=f"{type(exc).__name__}: {exc}"[:300]))


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_checks(report: Report, heads: int, dim: int, lengths: list[int], decode_seqs: int,
               dev: str = "cuda") -> None:
    from kernels.kda.naive import kda_naive

    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    slots = torch.arange(len(lengths), device=dev)

    def make_prefill():
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k = (_l2(torch.randn(T, heads, dim, device=dev, generator=gen)) for _ in range(2))
        v = torch.randn(T, heads, dim, device=dev, generator=gen)
        g = -5.0 * torch.sigmoid(2 * torch.randn(T, heads, dim, device=dev, generator=gen))
        beta = torch.sigmoid(torch.randn(T, heads, device=dev, generator=gen))
        pool = torch.zeros(len(lengths), heads, dim, dim, device=dev)
        return (q, k, v, g, beta, dim ** -0.5, cu, pool, slots), lambda o, a: (o, a[7])

    def ref_prefill(a):
        o, final = kda_naive(*a[:6], None, a[6])
        return o, final

    run_backends(report, "kda_prefill", f"kda_prefill H{heads} T{T}", make_prefill, ref_prefill, 2e-3, dev)

    def make_decode():
        gen = torch.Generator(device=dev).manual_seed(1)
        n = decode_seqs
        q, k = (_l2(torch.randn(n, heads, dim, device=dev, generator=gen)) for _ in range(2))
        v = torch.randn(n, heads, dim, device=dev, generator=gen)
        g = -5.0 * torch.sigmoid(2 * torch.randn(n, heads, dim, device=dev, generator=gen))
        beta = torch.sigmoid(torch.randn(n, heads, device=dev, generator=gen))
        pool = torch.randn(n, heads, dim, dim, device=dev, generator=gen) * 0.1
        return (q, k, v, g, beta, dim ** -0.5, pool, torch.arange(n, device=dev)), lambda o, a: (o, a[6])

    run_backends(report, "kda_decode", f"kda_decode H{heads} N{decode_seqs}", make_decode,
                 lambda a: _torch_outputs("kda_decode", make_decode, 6), 1e-4, dev)


def _torch_outputs(op: str, make, pool_arg: int):
    args, _ = make()
    return implementation(op, "torch")(*args), args[pool_arg]


def conv_checks(report: Report, channels: int, lengths: list[int], width: int = 4, dev: str = "cuda") -> None:
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    n = len(lengths)

    def make_prefill():
        gen = torch.Generator(device=dev).manual_seed(2)
        x = torch.randn(T, channels, device=dev, generator=gen).bfloat16()
        w = torch.randn(channels, width, device=dev, generator=gen) / width ** 0.5
        pool = torch.randn(n, channels, width - 1, device=dev, generator=gen).bfloat16()
        return (x, w, pool, torch.arange(n, device=dev), cu), lambda y, a: (y, a[2])

    def make_decode():
        args, _ = make_prefill()
        return (args[0][:n].contiguous(), args[1], args[2], args[3]), lambda y, a: (y, a[2])

    run_backends(report, "conv_prefill", f"conv_prefill C{channels} T{T}", make_prefill,
                 lambda a: _torch_outputs("conv_prefill", make_prefill, 2), 2e-2, dev)
    run_backends(report, "conv_decode", f"conv_decode C{channels} N{n}", make_decode,
                 lambda a: _torch_outputs("conv_decode", make_decode, 2), 2e-2, dev)


def mla_checks(report: Report, heads: int, lengths: list[int], context: list[int], block: int = 16,
               dev: str = "cuda") -> None:
    from kernels.attention.naive import mla_paged_attention_naive

    lora, rope = 512, 64
    blocks_per_seq = -(-max(context) // block)

    def make():
        gen = torch.Generator(device=dev).manual_seed(3)
        kv = torch.randn(len(context) * blocks_per_seq, block, lora + rope, device=dev, generator=gen).bfloat16()
        q = torch.randn(sum(lengths), heads, lora + rope, device=dev, generator=gen).bfloat16()
        tables = torch.arange(len(context) * blocks_per_seq, device=dev, dtype=torch.int32).view(len(context), -1)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
        seq = torch.tensor(context, device=dev)
        return (q, kv, tables, cu, seq, (128 + 64) ** -0.5, lora), lambda o, a: (o,)

    label = f"mla_attention H{heads} q{sum(lengths)} ctx{max(context)}"
    run_backends(report, "mla_attention", label, make, lambda a: (mla_paged_attention_naive(*a),), 2e-2, dev)


def moe_checks(report: Report, dense: tuple[int, int, int, int, int], packed: tuple[int, int, int, int, int, int],
               dev: str = "cuda") -> None:
    from kernels.moe.activation import GatedActivation
    from kernels.moe.mxfp4 import MXFP4Weight, moe_experts_mxfp4
    from kernels.moe.naive import moe_experts_naive
    from kernels.moe.router import route

    T, E, k, inter, width = dense

    def make_dense():
        gen = torch.Generator(device=dev).manual_seed(4)
        x = torch.randn(T, width, device=dev, generator=gen).bfloat16()
        w1, w3 = (torch.randn(E, inter, width, device=dev, generator=gen).bfloat16() / width ** 0.5 for _ in "ab")
        w2 = torch.randn(E, width, inter, device=dev, generator=gen).bfloat16() / inter ** 0.5
        weights, ids = route(torch.randn(T, E, device=dev, generator=gen), torch.zeros(E, device=dev), k, 1, 1, True,
                             2.446)
        return (x, w1, w3, w2, weights, ids, GatedActivation("silu")), lambda y, a: (y,)

    run_backends(report, "moe_experts", f"moe_experts bf16 E{E} T{T}", make_dense,
                 lambda a: (moe_experts_naive(*a),), 3e-2, dev)
    T, E_all, E, k, inter, width = packed

    def make_packed():
        gen = torch.Generator(device=dev).manual_seed(5)
        x = torch.randn(T, width, device=dev, generator=gen).bfloat16()

        def weight(n, kk):
            return MXFP4Weight(torch.randint(0, 256, (E, n, kk // 2), device=dev, generator=gen, dtype=torch.uint8),
                               torch.randint(118, 124, (E, n, kk // 32), device=dev, generator=gen, dtype=torch.uint8))

        weights, ids = route(torch.randn(T, E_all, device=dev, generator=gen), torch.zeros(E_all, device=dev), k, 1,
                             1, True, 2.5)
        act = GatedActivation("situ", beta=4.0, linear_beta=25.0)
        return (x, weight(inter, width), weight(inter, width), weight(width, inter), weights, ids, act), \
            lambda y, a: (y,)

    run_backends(report, "moe_experts_mxfp4", f"moe_mxfp4 E{E}/{E_all} T{T}", make_packed,
                 lambda a: (moe_experts_mxfp4(*a),), 3e-2, dev)


def _tp_rank(comm, rank: int, folder: str, prompts: list[list[int]]) -> torch.Tensor:
    from engine.model.loader import LoadConfig, load_model
    from engine.parallel.comm import RankContext
    from engine.parallel.config import ParallelConfig

    ctx = RankContext(ParallelConfig(comm.size, rank), comm)
    model = load_model(folder, LoadConfig(device=f"cuda:{rank}", dtype="float32"), ctx)
    return model_steps(model, prompts, 0)["logits"]


def model_checks(report: Report, preset: str, prompt_len: int, seqs: int, decode_steps: int) -> None:
    from engine.model.checkpoint import make_checkpoint
    from engine.model.loader import LoadConfig, load_model
    from engine.parallel.launch import run_ranks

    prompts = [[(31 * i + 7 * s) % 7900 for i in range(prompt_len)] for s in range(seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_checkpoint(preset, Path(tmp) / preset, seed=0))
        cpu = model_steps(load_model(folder), prompts, 0)["logits"]
        fp32 = model_steps(load_model(folder, LoadConfig(device="cuda", dtype="float32")), prompts, 0)
        err = rel_err(fp32["logits"], cpu)
        report.add(Check(f"model {preset} TP1 fp32 vs CPU", "cuda", "pass" if err <= 1e-3 else "fail", err,
                         fp32["prefill_ms"]))
        bf16 = model_steps(load_model(folder, LoadConfig(device="cuda", dtype="bfloat16")), prompts, decode_steps)
        report.add(Check(f"model {preset} TP1 bf16 prefill {seqs}x{prompt_len}", "cuda", "pass",
                         rel_err(bf16["logits"], cpu), bf16["prefill_ms"], "timing; error vs fp32 CPU for info"))
        report.add(Check(f"model {preset} TP1 bf16 decode step x{seqs}", "cuda", "pass", None, bf16["decode_ms"]))
        if torch.cuda.device_count() < 2:
            report.add(Check(f"model {preset} TP2 vs TP1", "nccl", "skipped",
                             note=f"TP=2 needs 2 GPUs, {torch.cuda.device_count()} here"))
            return
        start = time.perf_counter()
        ranks = run_ranks(_tp_rank, 2, (folder, prompts), backend="nccl", timeout_s=180)
        err = max(rel_err(r, fp32["logits"]) for r in ranks)
        report.add(Check(f"model {preset} TP2 vs TP1 fp32", "nccl", "pass" if err <= 1e-3 else "fail", err,
                         (time.perf_counter() - start) * 1e3, "ms: whole run incl. process start and load"))


def markdown(report: Report) -> str:
    lines = [f"# GPU validation on {report.device}", "", "| check | backend | status | max rel err | ms | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in report.checks:
        err = "" if c.rel_err is None else f"{c.rel_err:.2e}"
        ms = "" if c.ms is None else f"{c.ms:.2f}"
        lines.append(f"| {c.name} | {c.backend} | {c.status} | {err} | {ms} | {c.note} |")
    missing = [c for c in report.checks if c.status in ("skipped", "error")]
    lines += ["", f"Could not run: {len(missing)} check(s)" + (":" if missing else ".")]
    lines += [f"- {c.name} [{c.backend}]: {c.note}" for c in missing]
    return "\n".join(lines) + "\n"


SECTIONS = ("kda", "conv", "mla", "moe", "model", "sync", "engine")


def run_all(report: Report, quick: bool, engine_layers: int = 4, engine_experts: int = 64,
            after_section=lambda: None) -> None:
    """Every section in order; `after_section()` is called after each (main writes the report then, so a call
    stopped at its time limit keeps the sections that finished)."""
    s = 4 if quick else 1  # --quick: smaller sizes
    steps = {
        "kda": lambda: kda_checks(report, 32, 128, [1024 // s, 1024 // s], 64 // s),
        "conv": lambda: conv_checks(report, 3 * 32 * 128, [1024 // s, 1024 // s]),
        "mla": lambda: (mla_checks(report, 32, [1024 // s, 1024 // s], [1024 // s, 1024 // s]),
                        mla_checks(report, 32, [1] * (64 // s), [2048 // s] * (64 // s))),
        "moe": lambda: moe_checks(report, (512 // s, 256, 8, 1024, 2304), (256 // s, 896, 112, 16, 3072, 3584)),
        "model": lambda: model_checks(report, "small-k3", 256 // s, 4, 16),
        "sync": lambda: sync_checks(report),
        "engine": lambda: engine_checks(report, k3_shaped_config(engine_layers, engine_experts // s),
                                        (1, 16, 64), 32 // s),
    }
    for name in SECTIONS:
        try:
            steps[name]()
        except Exception:  # noqa: BLE001 - one section's failure must not hide the others
            report.add(Check(name, "-", "error", note=traceback.format_exc(limit=3)[-300:]))
        after_section()


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="summary path; writes .json and .md")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--engine-layers", type=int, default=4, help="layers of the K3-shaped engine config")
    parser.add_argument("--engine-experts", type=int, default=64, help="routed experts of the K3-shaped config")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    report = Report(torch.cuda.get_device_name(0) if cuda else f"no CUDA device ({platform.machine()} CPU)")
    start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write = lambda: write_report(report, out, time.perf_counter() - start)  # noqa: E731
    if cuda:
        run_all(report, args.quick, args.engine_layers, args.engine_experts, after_section=write)
    else:
        for name in SECTIONS:
            report.add(Check(name, "-", "skipped", note="no CUDA device"))
    write()
    return report


def write_report(report: Report, out: Path, seconds: float) -> None:
    """The report so far as `out`'s `.json` and `.md`."""
    summary = {"device": report.device, "seconds": seconds, "torch": torch.__version__,
               "checks": [asdict(c) for c in report.checks]}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    out.with_suffix(".md").write_text(markdown(report))


if __name__ == "__main__":
    main()
