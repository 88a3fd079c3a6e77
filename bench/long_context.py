"""One request at long context: prefill tok/s and decode ms/token at 1K, 8K, 32K and 128K tokens, with llama.cpp on
the same checkpoint in the same run (issue 30's benchmark).

Usage: `python -m bench.long_context [--models small-linear-kda12,small-k3] [--lengths 1024,8192,32768,131072]
[--decode-tokens 16] [--threads 1] [--compilation-config JSON] [--no-llama MODELS] [--out FILE]`

Per model and context length L, in turn (kdamesh first, then llama.cpp, so each pair runs back to back):
- kdamesh: a fresh `EngineCore` worker process (bench/llamacpp.py's `KdameshWorker`, its KV pool sized for L)
  warms up (a short request at the measured thread count, past the MLA one-tile bound when L is: a compiled
  step builds its graphs there), then runs one greedy request of an L-token random prompt and `--decode-tokens` + 1 output tokens: prefill tok/s = L / time
  to the first token, decode ms/token over the tokens after it; the worker's peak RSS (of it: the KV pool and
  state slots it pre-touches). `--compilation-config` is the worker engines' (default: eager on CPU).
- llama.cpp (`llama-batched-bench -npp L -ntg N -npl 1`, one process: the prompt's prefill then N tokens at depth
  L): its `speed_pp` and `speed_tg`, and the process's peak RSS. Models in `--no-llama` run kdamesh alone (llama.cpp's
  `kimi-linear` takes the KDA head count from `num_attention_heads`, so it runs the `small-linear-kda12` variant,
  not `small-k3`, as bench/llamacpp.py explains).
- The FLOP model beside the measurement: matmul FLOPs per prompt token at L (bench/bench_engine.py
  `prefill_flops`: the weights, the KDA state updates, and MLA's non-absorbed prefill over the context in the
  engine's chunks) against those at the first length — the prefill slowdown a constant FLOP rate would show.
Prints a markdown table; `--out` writes the numbers as JSON. One repetition per cell: a 128K prefill takes minutes a
side on one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import llamacpp as bench_llama
from bench import llamacpp_tools as tools
from bench.llamacpp_worker import KdameshWorker


def ours(folder: Path, length: int, tokens: int, threads: int, compilation_config: str | None) -> dict:
    worker = KdameshWorker(folder, 1, length + tokens + 8, threads, compilation_config=compilation_config)
    # warm-up at the measured thread count and, past the one-tile bound, in the wide-table regime: a compiled
    # step's graphs are built here, not inside the measurement
    past_one_tile = worker.info["one_tile_tokens"] + 2 * BLOCK_MARGIN
    worker.call("decode", prompt_len=min(length, past_one_tile), tokens=2, threads=threads, seed=0)
    result = worker.call("long", prompt_len=length, tokens=tokens, threads=threads, seed=length)
    memory = worker.close()
    return {**result, "peak_rss": memory["peak_rss"], "pool_bytes": memory["pool_bytes"]}


def theirs(llama: tools.LlamaCpp, length: int, tokens: int, threads: int) -> dict:
    out, err, rss = tools.run_measured([str(llama.bin / "llama-batched-bench"), "-m", str(llama.gguf),
                                        "-t", str(threads), "-c", str(length + tokens + 16), "-npp", str(length),
                                        "-ntg", str(tokens), "-npl", "1", "--output-format", "jsonl"],
                                       timeout_s=4 * 3600)
    (row,) = tools.parse_batched_bench_jsonl(out + "\n" + err)
    return {"prefill_tok_s": row["speed_pp"], "decode_ms": 1e3 / row["speed_tg"], "peak_rss": rss}


BLOCK_MARGIN = 16  # tokens: the warm-up's context ends this far past the MLA one-tile bound (bench/llamacpp.py)


def folder_of(name: str) -> Path:
    """bench/llamacpp.py's models, else a generated preset (`small-k3`, made under $KDAMESH_HOME on first use)."""
    if name in ("small-linear-kda12", "demo-k3"):
        return bench_llama.model_folder(name)
    from deploy.checkpoints import default_model_dir

    return Path(default_model_dir(name))


def run_model(args: argparse.Namespace, name: str, bin_dir: Path) -> list[dict]:
    folder = folder_of(name)
    llama = None
    if name not in args.no_llama:
        gguf, patches = bench_llama.gguf_file(name, folder)
        llama = tools.LlamaCpp(bin_dir, gguf)
        for note in patches:
            print(f"  converter patched (a copy): {note}", flush=True)
    rows = []
    for length in args.lengths:
        start = time.perf_counter()
        row = {"model": name, "length": length, "kdamesh": ours(folder, length, args.decode_tokens, args.threads,
                                                                args.compilation_config)}
        if llama is not None:
            row["llama.cpp"] = theirs(llama, length, args.decode_tokens, args.threads)
        print(f"  {name} @ {length}: {row} ({time.perf_counter() - start:.0f} s)", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | context | kdamesh prefill tok/s (vs first) | FLOP model (vs first) | llama.cpp prefill tok/s | "
             "prefill ratio | kdamesh decode ms/token | llama.cpp decode ms/token | decode ratio | peak RSS kdamesh "
             "(of it: pools) / llama.cpp |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    first: dict[str, dict] = {}
    for row in rows:
        ours_row, theirs_row = row["kdamesh"], row.get("llama.cpp")
        base = first.setdefault(row["model"], ours_row)
        relative = ours_row["prefill_tok_s"] / base["prefill_tok_s"]
        flop_model = base["flops_per_prompt_token"] / ours_row["flops_per_prompt_token"]
        mib = 2 ** 20
        rss = f"{ours_row['peak_rss'] / mib:.0f} ({ours_row['pool_bytes'] / mib:.0f}) MiB"
        if theirs_row:
            rss += f" / {theirs_row['peak_rss'] / mib:.0f} MiB"
        cells = [row["model"], f"{row['length']:,}", f"{ours_row['prefill_tok_s']:.1f} ({relative:.2f}×)",
                 f"{flop_model:.2f}×"]
        if theirs_row:
            cells += [f"{theirs_row['prefill_tok_s']:.1f}", f"{ours_row['prefill_tok_s'] / theirs_row['prefill_tok_s']:.2f}×",
                      f"{ours_row['decode_ms']:.1f}", f"{theirs_row['decode_ms']:.1f}",
                      f"{theirs_row['decode_ms'] / ours_row['decode_ms']:.2f}×"]
        else:
            cells += ["—", "—", f"{ours_row['decode_ms']:.1f}", "—", "—"]
        lines.append("| " + " | ".join(cells + [rss]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="small-linear-kda12,small-k3")
    p.add_argument("--lengths", default="1024,8192,32768,131072", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-llama", default="small-k3", type=lambda s: set(filter(None, s.split(","))),
                   help="models run by kdamesh alone")
    p.add_argument("--compilation-config", default=None,
                   help="the kdamesh engine's --compilation-config JSON (default: the engine's, eager on CPU)")
    p.add_argument("--build-jobs", type=int, default=2)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bin_dir = tools.build_llama_cpp(jobs=args.build_jobs)
    before = bench_llama.machine()
    rows = [row for name in args.models.split(",") for row in run_model(args, name, bin_dir)]
    command = "python -m bench.long_context " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\n{table(rows)}\n\nreproduce: `{command}`; {before['cpu']}, load average {before['load_average_1min']:.1f}"
          f" -> {bench_llama.machine()['load_average_1min']:.1f}")
    if args.out:
        args.out.write_text(json.dumps({"command": command, "machine": before, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
