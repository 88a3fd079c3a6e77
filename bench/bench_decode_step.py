"""The decode step: eager vs compiled, at batch 1 and 32, on both families — time, CPU time and ops per step.

Usage: `python -m bench.bench_decode_step [--models demo-k3,small-linear] [--batches 1,32] [--threads 1]
[--modes eager,inductor] [--steps 40] [--repeats 3] [--out FILE]`

For each model (`demo-k3`: the shipped trained checkpoint at deploy/models/demo-k3; any other name: the generated
preset under $KDAMESH_HOME) and batch size, one engine per mode (`eager`: `enforce_eager=True`; `inductor` /
`aot_eager`: `compilation_config={"level": 3, "backend": ...}` with the batch size as its one bucket) serves
`batch` greedy requests of a 64-token prompt; after a warm-up (which, compiled, includes torch.compile's build,
reported as `compile s`) the modes' timed windows of `--steps` engine steps are interleaved `--repeats` times and
the best window of each is kept (the machine is shared: best-of is the least disturbed). Reported per step: wall
milliseconds, CPU milliseconds of this process (`time.process_time`, less sensitive to other load), output tokens/s
(batch / wall), and aten ops dispatched in one step (a dispatch-mode count: what a GPU would launch, before
fusion). The ratio column is each mode's tokens/s over eager's in the same run. A mode `<backend>-fp32` loads
without exact bf16 weight copies (`KDAMESH_COMPACT_WEIGHTS=0`): the small-batch kernel reads the fp32 weights, as
it did before such copies existed (A/B of the copies on a bf16 checkpoint such as demo-k3).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.common import op_counter, report
from kernels.cpu.small_gemm import COMPACT_ENV

DEMO = Path(__file__).resolve().parents[1] / "deploy" / "models" / "demo-k3"
PROMPT_LEN = 64


def model_dir(name: str) -> Path:
    if name == "demo-k3":
        return DEMO
    from deploy.checkpoints import default_model_dir

    return Path(default_model_dir(name))


def open_engine(path: Path, mode: str, batch: int):
    from engine import LLM, SamplingParams

    backend, _, variant = mode.partition("-")
    config = None if backend == "eager" else {"level": 3, "backend": backend, "cudagraph_capture_sizes": [batch]}
    if variant not in ("", "fp32"):
        raise SystemExit(f"--modes: unknown variant {mode!r} (a backend, or a backend followed by -fp32)")
    os.environ[COMPACT_ENV] = "0" if variant == "fp32" else "1"  # read as the weights load
    llm = LLM(str(path), kv_cache_memory="512MiB", max_num_seqs=max(batch, 1), enforce_eager=backend == "eager",
              compilation_config=config)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"r{i}", [100 + (i * 7 + j) % 7000 for j in range(PROMPT_LEN)], params)
    llm.engine.step()  # prefill
    start = time.perf_counter()
    for _ in range(3):
        llm.engine.step()  # the first decode steps (compiled: the build)
    return llm, time.perf_counter() - start


def window(llm, steps: int) -> tuple[float, float]:
    """(wall s, CPU s) per step over `steps` engine steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def ops_per_step(llm) -> int:
    with op_counter() as counter:
        llm.engine.step()
    return counter.count


def measure(name: str, batch: int, modes: list[str], steps: int, repeats: int) -> list[dict]:
    path = model_dir(name)
    engines = {mode: open_engine(path, mode, batch) for mode in modes}
    best = {mode: (float("inf"), float("inf")) for mode in modes}
    for _ in range(repeats):
        for mode, (llm, _) in engines.items():  # interleaved: each mode's windows see the same load
            wall, cpu = window(llm, steps)
            best[mode] = (min(best[mode][0], wall), min(best[mode][1], cpu))
    eager_rate = batch / best["eager"][0] if "eager" in best else None
    rows = []
    for mode, (llm, warmup) in engines.items():
        wall, cpu = best[mode]
        rows.append({"model": name, "batch": batch, "mode": mode, "ms_per_step": wall * 1e3,
                     "cpu_ms_per_step": cpu * 1e3, "tok_s": batch / wall, "ops_per_step": ops_per_step(llm),
                     "warmup_s": warmup, "vs_eager": (batch / wall) / eager_rate if eager_rate else None})
        llm.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | mode | ms/step | CPU ms/step | tok/s | vs eager | aten ops/step | warm-up s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['vs_eager']:.2f}x" if r["vs_eager"] is not None else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['ms_per_step']:.2f} | "
                     f"{r['cpu_ms_per_step']:.2f} | {r['tok_s']:.1f} | {ratio} | {r['ops_per_step']} | "
                     f"{r['warmup_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo-k3,small-linear")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--modes", default="eager,inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    rows = [row for name in args.models.split(",") for batch in map(int, args.batches.split(","))
            for row in measure(name, batch, modes, args.steps, args.repeats)]
    return report(table(rows), args, rows)


if __name__ == "__main__":
    raise SystemExit(main())
