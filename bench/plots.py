"""The plots of docs/benchmarks.md (matplotlib PNGs in docs/img/), measured in one run.

Run: `python -m bench.plots [--preset small-k3 | --model DIR] [--rates 0.5 1 2 4] [--input-len 128] [--output-len 16]
[--prefix-lens 512 1088 2176 3264] [--threads 1] [--img-dir docs/img] [--data-dir DIR] [--only rate prefix decode]`;
`--from-data DIR` redraws from a previous run's `plots.json` without measuring. About 4 minutes on 2 cores.

1. `serve_ttft_itl_vs_rate.png` — `kdamesh bench serve` (random dataset, `--input-len` in / `--output-len` out,
   Poisson arrivals, no concurrency cap) against `kdamesh up` in colocated and in disaggregated mode
   (`--pd-min-uncached-tokens 0`: every request prefills on the prefill worker), one mesh per mode, at each
   `--rates` request rate: median and p90 TTFT and ITL vs the offered rate. Each rate point uses its own prompts
   (seeded by the rate), so no point hits the prefix cache of another; each mesh is warmed up first.
2. `prefix_cache_ttft.png` — TTFT of a prompt whose prefix of P tokens is new (cold) and of two prompts that share it
   (warm), P in `--prefix-lens`, 32 more tokens and 4 output tokens each (the prefix_repetition dataset, token-id
   prompts, one request at a time), in both modes; the usage's `cached_tokens` shows the hit.
3. `decode_step_vs_context.png` — one decode step of one sequence vs its context length: a KDA layer
   (`bench.bench_kda.bench_decode`, H=32, K=V=128: Kimi Linear's width) is flat, one MLA layer's paged attention
   (`bench.bench_attention.bench_decode`, H=32, Dk=576, bf16 cache) and plain softmax attention over the same context
   (bench_kda's contrast, H=32, D=128) grow linearly. Torch runs with `--threads` threads, as the mesh workers.
The measured numbers go to `DATA_DIR/plots.json` (and each bench serve result JSON to `DATA_DIR/rates/`); the
markdown tables are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import model_folder

MODES = ("colocated", "disaggregated")
PLOTS = ("rate", "prefix", "decode")
STARTUP_TIMEOUT_S = 600


@contextlib.contextmanager
def mesh(model: Path, mode: str, threads: int, log_dir: Path):
    """`kdamesh up` in a subprocess on a free port; yields the gateway's base URL; SIGTERM on exit."""
    from deploy.launcher import free_port

    port = free_port()
    log_path = log_dir / f"up-{mode}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "up", "--model", str(model), "--mode", mode,
           "--http-port", str(port), "--pd-min-uncached-tokens", "0", "--torch-threads", str(threads),
           "--max-num-seqs", "32"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not any(line.startswith("endpoints ") for line in log_path.read_text().splitlines()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kdamesh up ({mode}) did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- 1. TTFT / ITL vs request rate -----------------------------------------------------------------------------------


async def bench_serve(flags: list[str]) -> dict:
    """One `kdamesh bench serve` run in this process (its summary goes to stderr); the result dict."""
    from servebench.cli import build_parser, main_async

    with contextlib.redirect_stdout(sys.stderr):
        return await main_async(build_parser().parse_args(flags))


def num_prompts(rate: float) -> int:
    return max(8, min(32, round(12 * rate)))


async def rate_sweep(base_url: str, mode: str, args: argparse.Namespace, data_dir: Path) -> list[dict]:
    common = ["--base-url", base_url, "--dataset-name", "random", "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--disable-tqdm", "--temperature", "0",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    await bench_serve([*common, "--num-prompts", "4", "--max-concurrency", "2", "--seed", "999"])  # warm-up
    rows = []
    for rate in args.rates:
        result = await bench_serve([*common, "--num-prompts", str(num_prompts(rate)), "--request-rate", str(rate),
                                    "--seed", str(int(rate * 1000)), "--save-result", "--result-dir",
                                    str(data_dir / "rates"), "--result-filename", f"{mode}-{rate:g}.json",
                                    "--label", f"kdamesh-{mode}"])
        keys = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
                "p90_ttft_ms", "mean_ttft_ms", "median_itl_ms", "p90_itl_ms", "mean_itl_ms", "median_tpot_ms",
                "mean_tpot_ms", "median_e2el_ms")
        rows.append({"mode": mode, "rate": rate, "num_prompts": num_prompts(rate), **{k: result[k] for k in keys}})
        _log(f"{mode} rate {rate:g}: TTFT p50 {result['median_ttft_ms']:.0f} ms, ITL p50 "
             f"{result['median_itl_ms']:.1f} ms, {result['failed']} failed")
    return rows


# -- 2. prefix cache: cold vs warm TTFT ------------------------------------------------------------------------------


async def prefix_sweep(base_url: str, mode: str, model: Path, args: argparse.Namespace) -> list[dict]:
    from servebench.client import fetch_first_model, make_client, request_completions
    from servebench.datasets import sample_prefix_repetition
    from servebench.runner import RunConfig, run_requests
    from engine.tokenizer import KimiTokenizer

    tokenizer = KimiTokenizer.from_pretrained(model)
    rows = []
    async with make_client(1) as client:
        name, _ = await fetch_first_model(base_url, client)
        config = RunConfig(api_url=f"{base_url}/v1/completions", model_id=name, model_name=None,
                           request_func=request_completions, max_concurrency=1, ignore_eos=True,
                           extra_body={"temperature": 0}, log=lambda s: None)
        warm_up = sample_prefix_repetition(tokenizer, 2, prefix_len=64, suffix_len=16, num_prefixes=1,
                                           output_len=4, seed=7, token_ids=True, shuffle=False)
        await run_requests(config, warm_up, client)
        for prefix_len in args.prefix_lens:
            # a seed per length: prefixes of different lengths must not share their first tokens
            requests = sample_prefix_repetition(tokenizer, 3, prefix_len=prefix_len, suffix_len=32, num_prefixes=1,
                                                output_len=4, seed=10_000 + prefix_len, token_ids=True,
                                                shuffle=False)
            run = await run_requests(config, requests, client)
            failed = [o.error for o in run.outputs if not o.success]
            if failed:
                raise RuntimeError(f"prefix sweep ({mode}, {prefix_len}): {failed[0][-2000:]}")
            cold, warm = run.outputs[0], run.outputs[1:]
            rows.append({"mode": mode, "prefix_len": prefix_len, "prompt_len": requests[0].prompt_len,
                         "cold_ttft_ms": cold.ttft * 1e3,
                         "warm_ttft_ms": statistics.mean(o.ttft for o in warm) * 1e3,
                         "cold_cached_tokens": cold.cached_tokens,
                         "warm_cached_tokens": [o.cached_tokens for o in warm]})
            r = rows[-1]
            _log(f"{mode} prefix {prefix_len}: cold {r['cold_ttft_ms']:.0f} ms, warm {r['warm_ttft_ms']:.0f} ms, "
                 f"cached {r['warm_cached_tokens']}")
    return rows


# -- 3. decode step vs context -------------------------------------------------------------------------------------


def decode_sweep(args: argparse.Namespace) -> list[dict]:
    import torch

    from bench import bench_attention, bench_kda

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the model forward sets
    torch.manual_seed(0)
    mla = {ctx: ms for ctx, ms, _naive in bench_attention.bench_decode()}
    kda_args = argparse.Namespace(lengths=sorted(mla), heads=32, dim=128, decode_steps=30)
    with torch.inference_mode():
        kda = bench_kda.bench_decode(kda_args, torch.Generator().manual_seed(0))
    return [{"context": r.context, "kda_step_ms": r.kda_step_ms, "softmax_attention_step_ms": r.attention_step_ms,
             "mla_paged_step_ms": mla[r.context]} for r in kda]


# -- drawing -------------------------------------------------------------------------------------------------------


COLORS = {"colocated": "tab:blue", "disaggregated": "tab:orange"}


def draw(data: dict, img_dir: Path) -> list[Path]:
    """The figures of the measured parts of `data` -> the files written (PNG, in `img_dir`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for part, figure, name in (("rate", _rate_figure, "serve_ttft_itl_vs_rate.png"),
                               ("prefix", _prefix_figure, "prefix_cache_ttft.png"),
                               ("decode", _decode_figure, "decode_step_vs_context.png")):
        if data.get(part):
            fig = figure(plt, data)
            fig.tight_layout(rect=(0, 0.03, 1, 1))
            written.append(_save(fig, img_dir / name))
    return written


def _log_y(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _label(ax, title: str, xlabel: str, ylabel: str, grid_which: str = "major") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3, which=grid_which)
    ax.legend(fontsize=8)


def _rate_figure(plt, data: dict):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        rows = sorted((r for r in data["rate"] if r["mode"] == mode), key=lambda r: r["rate"])
        if not rows:
            continue
        x = [r["rate"] for r in rows]
        for ax, metric in zip(axes, ("ttft", "itl")):
            ax.plot(x, [r[f"median_{metric}_ms"] for r in rows], "o-", color=COLORS[mode], label=f"{mode} p50")
            ax.plot(x, [r[f"p90_{metric}_ms"] for r in rows], "s--", color=COLORS[mode], alpha=0.6,
                    label=f"{mode} p90")
    spec = data["rate_spec"]
    for ax, title in zip(axes, ("Time to first token", "Inter-token latency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["rates"], [f"{r:g}" for r in data["rates"]])
        _label(ax, title, "request rate (req/s, Poisson)", "ms")
        _log_y(ax)
    fig.suptitle(f"kdamesh bench serve: random {spec['input_len']} in / {spec['output_len']} out, "
                 f"colocated vs disaggregated", fontsize=11)
    fig.text(0.01, 0.01, f"{data['model']} · {data['machine']}", fontsize=7, alpha=0.7)
    return fig


def _prefix_figure(plt, data: dict):
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in MODES:
        rows = sorted((r for r in data["prefix"] if r["mode"] == mode), key=lambda r: r["prefix_len"])
        if not rows:
            continue
        x = [r["prefix_len"] for r in rows]
        ax.plot(x, [r["cold_ttft_ms"] for r in rows], "o-", color=COLORS[mode], label=f"{mode}, cold")
        ax.plot(x, [r["warm_ttft_ms"] for r in rows], "s--", color=COLORS[mode], label=f"{mode}, warm (cached)")
    misses = sorted({r["prefix_len"] for r in data["prefix"] if not any(r["warm_cached_tokens"] or [])})
    if misses:
        ax.text(0.02, 0.04, f"no hit at {', '.join(map(str, misses))}: shorter than\nthe KDA state snapshot "
                "interval", transform=ax.transAxes, fontsize=7, alpha=0.8)
    ax.set_xscale("log", base=2)
    _log_y(ax)
    lens = sorted({r["prefix_len"] for r in data["prefix"]})
    ax.set_xticks(lens, [str(p) for p in lens])
    _label(ax, "Prefix cache: TTFT cold vs warm", "shared prefix length (tokens; + 32 new tokens)", "TTFT (ms)",
           "both")
    fig.text(0.01, 0.01, f"{data['model']} · {data['machine']}", fontsize=7, alpha=0.7)
    return fig


def _decode_figure(plt, data: dict):
    rows = sorted(data["decode"], key=lambda r: r["context"])
    x = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(x, [r["kda_step_ms"] for r in rows], "o-", label="KDA layer (state 32×128×128, fp32)")
    ax.plot(x, [r["mla_paged_step_ms"] for r in rows], "s-", label="MLA layer, paged (H=32, Dk=576, bf16)")
    ax.plot(x, [r["softmax_attention_step_ms"] for r in rows], "^--", alpha=0.7,
            label="softmax attention (H=32, D=128, fp32)")
    ax.set_xscale("log", base=2)
    _log_y(ax)
    ax.set_xticks(x, [f"{c // 1024}K" for c in x])
    _label(ax, "Decode step vs context: KDA is flat, attention grows", "context length (tokens)",
           "decode step (ms, one sequence)", "both")
    fig.text(0.01, 0.01, f"{data['machine']} · torch threads {data['threads']}", fontsize=7, alpha=0.7)
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no matplotlib version: reruns diff only on data
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def tables(data: dict) -> str:
    lines = []
    if data.get("rate"):
        lines += ["| mode | rate (req/s) | prompts | req/s done | out tok/s | TTFT p50 (ms) | TTFT p90 (ms) | "
                  "ITL p50 (ms) | ITL p90 (ms) | TPOT p50 (ms) | failed |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(data["rate"], key=lambda r: (r["rate"], r["mode"])):
            lines.append(f"| {r['mode']} | {r['rate']:g} | {r['num_prompts']} | {r['request_throughput']:.2f} | "
                         f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} | "
                         f"{r['median_itl_ms']:.1f} | {r['p90_itl_ms']:.1f} | {r['median_tpot_ms']:.1f} | "
                         f"{r['failed']} |")
        lines.append("")
    if data.get("prefix"):
        lines += ["| mode | prefix (tokens) | cold TTFT (ms) | warm TTFT (ms) | cold / warm | cached tokens (warm) |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in sorted(data["prefix"], key=lambda r: (r["prefix_len"], r["mode"])):
            lines.append(f"| {r['mode']} | {r['prefix_len']} | {r['cold_ttft_ms']:.0f} | {r['warm_ttft_ms']:.0f} | "
                         f"{r['cold_ttft_ms'] / r['warm_ttft_ms']:.1f}× | {r['warm_cached_tokens']} |")
        lines.append("")
    if data.get("decode"):
        lines += ["| context | KDA step (ms) | MLA paged step (ms) | softmax attention step (ms) | MLA / KDA |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(data["decode"], key=lambda r: r["context"]):
            lines.append(f"| {r['context']:,} | {r['kda_step_ms']:.3f} | {r['mla_paged_step_ms']:.2f} | "
                         f"{r['softmax_attention_step_ms']:.2f} | {r['mla_paged_step_ms'] / r['kda_step_ms']:.0f}× |")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, data_dir: Path) -> dict:
    only = set(args.only)
    data: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": args.threads,
                  "rates": args.rates, "rate_spec": {"input_len": args.input_len, "output_len": args.output_len},
                  "rate": [], "prefix": [], "decode": []}
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    if only & {"rate", "prefix"}:
        model = model_folder(args)
        data["model"] = model.name
        for mode in MODES:
            with mesh(model, mode, args.threads, data_dir) as base_url:
                _log(f"== {mode} mesh up at {base_url} ({time.monotonic() - started:.0f} s)")
                if "rate" in only:
                    data["rate"] += asyncio.run(rate_sweep(base_url, mode, args, data_dir))
                if "prefix" in only:
                    data["prefix"] += asyncio.run(prefix_sweep(base_url, mode, model, args))
    else:
        data["model"] = args.model or args.preset
    if "decode" in only:
        _log(f"== decode step microbenchmarks ({time.monotonic() - started:.0f} s)")
        data["decode"] = decode_sweep(args)
    data["seconds"] = time.monotonic() - started
    data["loadavg_1m_start_end"] = [load_start, os.getloadavg()[0]]  # other jobs sharing the cores
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the preset, generated once)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[512, 1088, 2176, 3264],
                        help="shared prefix lengths; small-k3 (fp32) snapshots its KDA state every 1088 tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (and for the decode steps)")
    parser.add_argument("--only", nargs="+", choices=PLOTS, default=list(PLOTS))
    parser.add_argument("--img-dir", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the numbers go (default: a temp dir)")
    parser.add_argument("--from-data", type=Path, default=None, help="redraw from DIR/plots.json, measure nothing")
    args = parser.parse_args(argv)
    if args.from_data:
        data = json.loads((args.from_data / "plots.json").read_text())
    else:
        data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="kdamesh-plots-"))
        data_dir.mkdir(parents=True, exist_ok=True)
        data = measure(args, data_dir)
        (data_dir / "plots.json").write_text(json.dumps(data, indent=2))
        _log(f"numbers in {data_dir / 'plots.json'} ({data['seconds']:.0f} s)")
    for path in draw(data, args.img_dir):
        _log(f"wrote {path}")
    print(tables(data))
    return 0 if not any(r["failed"] for r in data.get("rate", [])) and not math.isnan(data.get("seconds", 0)) else 1


if __name__ == "__main__":
    sys.exit(main())
