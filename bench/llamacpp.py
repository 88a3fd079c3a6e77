"""kdamesh vs llama.cpp on CPU: the same checkpoints, the same thread counts, interleaved repetitions, in one run.

Usage: `python -m bench.llamacpp [--models small-linear-kda12,demo-k3] [--threads 1,2] [--reps 3] [--out FILE]
[--compilation-config JSON]`

- llama.cpp is the tree vendored in the PyPI sdist `llama-cpp-python` 0.3.36 (it has the `kimi-linear` and `kimi-k3`
  architectures), built CPU-only once and cached outside the repository (bench/llamacpp_tools.py: ~25 min on two
  cores the first time). Each checkpoint is converted to GGUF f32 with the vendored `convert_hf_to_gguf.py`, patched
  in a copy (the patches are printed: our pre-tokenizer hash is mapped to `kimi-k2`; K3's MTP layer is skipped).
- Models: `small-linear-kda12` is the `small-linear` preset with `linear_attn_config.num_heads` = 12 =
  `num_attention_heads` (llama.cpp's `kimi-linear` takes the KDA head count from `num_attention_heads`), fp32 on
  both sides; `demo-k3` is the shipped trained checkpoint (deploy/models/demo-k3, bf16 files): kdamesh loads it with
  `--dtype auto`, which is fp32 on CPU (engine/model/loader.py `resolve_dtype`), llama.cpp the f32 GGUF.
- Sanity first, per model: llama.cpp's greedy continuation (`llama-simple`, prompt ids from `llama-tokenize`) against
  kdamesh's greedy tokens from the same ids, compared as bytes; a difference is printed, not hidden.
- Measurements (each side at the same thread count: `-t n` / `torch.set_num_threads(n)`; each repetition runs
  both engines back to back, metric by metric, the first alternating, so drift hits both; medians over `--reps`
  and the median of the per-repetition ratios):
  - `decode`: batch-1 decode tok/s of `--decode-tokens` tokens from a 1-token prompt (`llama-bench -p 0 -n N`;
    kdamesh: one greedy request, EOS ignored, the tokens after the first over the time after the first).
  - `decode@depth`: the same for `--depth-tokens` tokens after a `--depth`-token prompt (`llama-bench -d`; each
    llama.cpp repetition is its own process and prefills the depth again, untimed; kdamesh's engine for this one
    keeps prefix caching on, so the same prompt is prefilled once and later repetitions resume at its end).
  - `prefill`: prompt tok/s of a `--prefill-len` prompt (`llama-bench -p N -n 0`; kdamesh: the prompt over the
    time to its first token).
  - `batch`: `--batch` concurrent prompts of `--batch-prompt-len` tokens, `--batch-gen` tokens each
    (`llama-batched-bench -npp -ntg -npl`, its prompts not shared): generated tok/s over the whole run (prefill
    included: `pl*tg / (t_pp + t_tg)`), and over the decode phase only (its `speed_tg`; kdamesh: the tokens after
    each request's first over the time after the last first token).
  - peak RSS: of the llama.cpp processes (`os.wait4`) and of kdamesh's worker processes (`ru_maxrss`), per kind
    of run (batch-1 decode and prefill, decode at depth, the batch run); kdamesh's includes its pre-touched KV pool
    (blocks + KDA state slots, snapshot slots for the depth engine), sized to the workload (`num_kv_blocks`),
    printed apart.
- `--compilation-config` is the engine's (vLLM's JSON, engine/compilation.py) for every kdamesh worker: e.g.
  `'{"level": 3}'` runs decode steps compiled by inductor (CPU's default is eager); the build happens in the
  worker's warm-up, untimed; the printed reproduce line carries the flag.
- kdamesh runs in worker processes (bench/llamacpp_worker.py, JSON lines on stdin/stdout), one engine per kind of
  run and thread count (a worker sets its threads before it builds its engine, as a serving worker does: a compiled
  step's routing, kernels/cpu/small_gemm.py, is traced at that count), so each one's RSS is its own; the launcher
  never imports torch (a child's `ru_maxrss` starts at its launcher's RSS). The depth worker runs its request
  once, untimed, before the repetitions (its prompt cached, its decode graphs built).
Prints a markdown table and the reproducing command; `--out` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import llamacpp_tools as tools
from bench.llamacpp_worker import SANITY_PROMPT, KdameshWorker

REPO = Path(__file__).resolve().parents[1]
DEMO_K3 = REPO / "deploy" / "models" / "demo-k3"
MAKE_KDA12 = """
from engine.model.checkpoint import make_checkpoint
from engine.model.presets import preset_config
text = preset_config("small-linear")
kda = dict(text["linear_attn_config"], num_heads=text["num_attention_heads"])
make_checkpoint("small-linear", {folder!r}, text_overrides={{"linear_attn_config": kda}})
"""
RSS_KINDS = {"single": "batch-1 decode and prefill", "depth": "decode at depth", "batch": "batch run"}
METRICS = ("decode", "decode@depth", "prefill", "batch")


def model_folder(name: str) -> Path:
    """The checkpoint of a bench model (`small-linear-kda12` is generated under $KDAMESH_HOME on first use)."""
    if name == "demo-k3":
        return DEMO_K3
    if name != "small-linear-kda12":
        raise SystemExit(f"unknown --models entry {name!r}: expected small-linear-kda12 or demo-k3")
    folder = _bench_home() / name
    if not folder.is_dir():  # made in a child, so this launcher never holds torch or a model
        partial = folder.with_name(name + ".partial")
        subprocess.run([sys.executable, "-c", MAKE_KDA12.format(folder=str(partial))], cwd=REPO, check=True)
        partial.rename(folder)
    return folder


def gguf_file(name: str, folder: Path) -> tuple[Path, list[str]]:
    """The f32 GGUF of a checkpoint (converted when missing or older than its weights) and the converter's patches."""
    out = _bench_home() / f"{name}.f32.gguf"
    weights = max(p.stat().st_mtime for p in folder.glob("*.safetensors"))
    notes_file = out.with_suffix(".patches.json")
    if out.is_file() and out.stat().st_mtime > weights and notes_file.is_file():
        return out, json.loads(notes_file.read_text())
    with tempfile.TemporaryDirectory() as work:
        notes = tools.convert_to_gguf(folder, out, Path(work))
    notes_file.write_text(json.dumps(notes))
    return out, notes


def _bench_home() -> Path:
    from deploy.checkpoints import kdamesh_home

    home = kdamesh_home() / "llamacpp-bench"
    home.mkdir(parents=True, exist_ok=True)
    return home


# -- llama.cpp side ----------------------------------------------------------------------------------------------


# -- the run -----------------------------------------------------------------------------------------------------


def sanity(llama: tools.LlamaCpp, worker: KdameshWorker, tokens: int, threads: int) -> dict:
    """Greedy tokens of both engines from llama.cpp's prompt ids, compared as the bytes each prints."""
    prompt_ids, llama_bytes = llama.greedy(SANITY_PROMPT, tokens)
    ours = worker.call("greedy", prompt_ids=prompt_ids, tokens=tokens, threads=threads)
    our_bytes = bytes.fromhex(ours["bytes_hex"])
    same = our_bytes == llama_bytes
    first_diff = next((i for i, (a, b) in enumerate(zip(our_bytes, llama_bytes)) if a != b),
                      min(len(our_bytes), len(llama_bytes)))
    return {"equal": same, "tokens": len(ours["ids"]), "prompt_ids_equal": ours["own_prompt_ids"] == prompt_ids,
            "first_differing_byte": None if same else first_diff,
            "kdamesh_text": our_bytes.decode(errors="replace"), "llama_text": llama_bytes.decode(errors="replace")}


def measure(args: argparse.Namespace, llama: tools.LlamaCpp, workers: dict[str, KdameshWorker],
            threads: int) -> dict[str, dict[str, list[dict]]]:
    """`--reps` interleaved repetitions of every metric; -> metric -> side -> one result per repetition."""
    samples = {m: {"llama.cpp": [], "kdamesh": []} for m in METRICS}
    for rep in range(args.reps):
        seed = 1000 * rep
        runs = {
            "decode": (lambda: llama.decode(threads, args.decode_tokens),
                       lambda: workers["single"].call("decode", prompt_len=1, tokens=args.decode_tokens, threads=threads,
                                           seed=seed)),
            "decode@depth": (lambda: llama.decode(threads, args.depth_tokens, args.depth),
                             lambda: workers["depth"].call("decode", prompt_len=args.depth,
                                                           tokens=args.depth_tokens, threads=threads, seed=7)),
            "prefill": (lambda: llama.prefill(threads, args.prefill_len),
                        lambda: workers["single"].call("prefill", prompt_len=args.prefill_len, threads=threads, seed=seed)),
            "batch": (lambda: llama.batch(threads, args.batch, args.batch_prompt_len, args.batch_gen),
                      lambda: workers["batch"].call("batch", n=args.batch, prompt_len=args.batch_prompt_len,
                                         tokens=args.batch_gen, threads=threads, seed=seed)),
        }
        for metric in METRICS:
            ours_first = rep % 2 == 1  # alternate who goes first, so neither always runs on a warmer machine
            llama_run, ours_run = runs[metric]
            for side, run in ((("kdamesh", ours_run), ("llama.cpp", llama_run)) if ours_first
                              else (("llama.cpp", llama_run), ("kdamesh", ours_run))):
                samples[metric][side].append(run())
            print(f"  t={threads} rep {rep + 1}/{args.reps} {metric}: "
                  f"{ {s: samples[metric][s][-1] for s in samples[metric]} }", flush=True)
    return samples


def summarize(samples: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Median per metric and side, their ratio kdamesh / llama.cpp (higher is better for kdamesh), and the median of
    the per-repetition ratios (each pair ran back to back: steadier when the machine's load swings)."""
    rows = []
    for metric, sides in samples.items():
        for key in sides["kdamesh"][0]:
            if key == "ms_per_token":
                continue
            ours = statistics.median(r[key] for r in sides["kdamesh"])
            theirs = statistics.median(r[key] for r in sides["llama.cpp"])
            paired = statistics.median(a[key] / b[key] for a, b in zip(sides["kdamesh"], sides["llama.cpp"]))
            rows.append({"metric": metric if key == "tok_s" else f"{metric} {key}", "kdamesh": ours,
                         "llama.cpp": theirs, "ratio": ours / theirs, "paired_ratio": paired,
                         "reps": len(sides["kdamesh"])})
    return rows


def run_model(args: argparse.Namespace, name: str, bin_dir: Path) -> dict:
    folder = model_folder(name)
    gguf, patches = gguf_file(name, folder)
    print(f"\n## {name}: {folder} -> {gguf}", flush=True)
    for note in patches:
        print(f"  converter patched (a copy): {note}", flush=True)
    llama = tools.LlamaCpp(bin_dir, gguf)
    check, per_threads, memory = None, {}, None
    for threads in args.threads:
        workers = start_workers(args, folder, threads)
        if check is None:
            check = sanity(llama, workers["single"], args.sanity_tokens, threads)
            print(f"  sanity: greedy {'EQUAL' if check['equal'] else 'DIFFERENT'} over {check['tokens']} tokens "
                  f"(prompt ids equal: {check['prompt_ids_equal']}, first differing byte: "
                  f"{check['first_differing_byte']})", flush=True)
        per_threads[threads] = summarize(measure(args, llama, workers, threads))
        closed = {kind: worker.close() for kind, worker in workers.items()}
        memory = memory or closed  # RSS hardly depends on the thread count: the first count's workers
    return {"model": name, "gguf": str(gguf), "patches": patches, "sanity": check, "results": per_threads,
            "rss": {kind: {"kdamesh": memory[kind]["peak_rss"], "kdamesh_pool": memory[kind]["pool_bytes"],
                           "llama.cpp": llama.peak_rss[kind]} for kind in memory}}


def start_workers(args: argparse.Namespace, folder: Path, threads: int) -> dict[str, KdameshWorker]:
    """The kdamesh workers of one thread count, warmed up: each sets its threads before building its engine (as a
    serving worker does), and the depth engine runs the depth request once untimed, so every repetition resumes at
    its cached prompt and finds the decode graphs of that context built."""
    compiled = args.compilation_config
    workers = {"single": KdameshWorker(folder, 1, max(args.prefill_len, args.decode_tokens, 64) + 8, threads,
                                       compilation_config=compiled),
               "depth": KdameshWorker(folder, 1, args.depth + args.depth_tokens + 8, threads, prefix_caching=True,
                                      compilation_config=compiled),
               "batch": KdameshWorker(folder, args.batch, args.batch_prompt_len + args.batch_gen + 8, threads,
                                      compilation_config=compiled)}
    workers["depth"].call("decode", prompt_len=args.depth, tokens=args.depth_tokens, threads=threads, seed=7)
    return workers


def metric_labels(args: argparse.Namespace) -> dict[str, str]:
    return {"decode": f"batch-1 decode tok/s ({args.decode_tokens} tokens)",
            "decode@depth": f"decode tok/s at {args.depth} context ({args.depth_tokens} tokens)",
            "prefill": f"prefill tok/s ({args.prefill_len}-token prompt)",
            "batch gen_tok_s": f"{args.batch} prompts × {args.batch_prompt_len} in, {args.batch_gen} out: "
                               "generated tok/s, whole run",
            "batch decode_tok_s": f"{args.batch} prompts: generated tok/s, decode phase"}


def table(results: list[dict], labels: dict[str, str]) -> str:
    lines = ["| model | threads | metric | kdamesh | llama.cpp | kdamesh / llama.cpp | median of paired ratios |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        for threads, rows in res["results"].items():
            for row in rows:
                lines.append(f"| {res['model']} | {threads} | {labels[row['metric']]} | {row['kdamesh']:.1f} | "
                             f"{row['llama.cpp']:.1f} | {row['ratio']:.2f}× | {row['paired_ratio']:.2f}× |")
    lines += ["", "| model | peak RSS | kdamesh (of it: KV pool) | llama.cpp |", "|---|---|---|---|"]
    for res in results:
        for kind, rss in res["rss"].items():
            lines.append(f"| {res['model']} | {RSS_KINDS[kind]} | "
                         f"{rss['kdamesh'] / 2**20:.0f} MiB ({rss['kdamesh_pool'] / 2**20:.0f} MiB) | "
                         f"{rss['llama.cpp'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def machine() -> dict:
    """CPU model name and count, and the load average (the machines are shared: noisy)."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
    return {"cpu": names[0] if names else platform.machine(), "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="small-linear-kda12,demo-k3")
    p.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=8192)
    p.add_argument("--depth-tokens", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-prompt-len", type=int, default=64)
    p.add_argument("--batch-gen", type=int, default=16)
    p.add_argument("--sanity-tokens", type=int, default=32)
    p.add_argument("--build-jobs", type=int, default=2)
    p.add_argument("--compilation-config", default=None,
                   help="the kdamesh engine's --compilation-config JSON (default: the engine's, eager on CPU)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bin_dir = tools.build_llama_cpp(jobs=args.build_jobs)
    before = machine()
    results = [run_model(args, name, bin_dir) for name in args.models.split(",")]
    facts = {**before, "load_average_1min_end": machine()["load_average_1min"],
             "launcher_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    command = "python -m bench.llamacpp " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\n{table(results, metric_labels(args))}\n\nreproduce: `{command}` (llama.cpp of llama-cpp-python "
          f"{tools.LLAMA_CPP_PYTHON_VERSION}); {facts['cpu']}, {facts['cpus']} CPUs, load average "
          f"{facts['load_average_1min']:.1f} -> {facts['load_average_1min_end']:.1f}; this launcher's peak RSS "
          f"{facts['launcher_peak_rss'] / 2**20:.0f} MiB (a child's RSS counts the launcher's at its start)")
    if args.out:
        args.out.write_text(json.dumps({"command": command, "machine": facts,
                                        "args": {k: str(v) for k, v in vars(args).items()}, "models": results},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
