"""`kdamesh plan MODEL_DIR`: per-rank weights, KV and state sizes, the concurrency that fits, handoff cost.

Contract: `add_arguments(parser)` adds the flags (`--tensor-parallel-size`, `--enable-expert-parallel`,
`--kv-cache-dtype`, `--gpus`,
`--gpu-memory`, `--gpu-memory-utilization`, `--context-len`, `--link-gbps`, `--dtype`, `--experts-format`, `--json`)
and the positional MODEL_DIR (a folder with `config.json`; no weights are read); `run(args)` prints the plan
(engine/plan.py) and returns 0 when it fits, 1 when it does not; `main(argv)` parses and runs. A split that does not
divide (heads, vocabulary, experts) is reported as an error naming the dimension (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine.config import EngineArgs, parse_bytes
from engine.model.config import load_model_config
from engine.parallel.config import ParallelError
from engine.plan import PlanArgs, format_plan, plan
from telemetry.options import add_options

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlanArgs()
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="folder with config.json (weights are not read)")
    add_options(parser, EngineArgs, only=("tensor_parallel_size", "enable_expert_parallel", "kv_cache_dtype"))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: one replica)")
    parser.add_argument("--gpu-memory", default="141GB", help="memory per GPU, e.g. 141GB (H200), 288GB (B300)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--context-len", type=int, default=d.context_len, help="tokens per request")
    parser.add_argument("--link-gbps", type=float, default=d.link_gbps, help="prefill -> decode link, Gb/s")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="weights and KV")
    parser.add_argument("--experts-format", choices=["auto", "dense", "mxfp4"], default="auto")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_args(args: argparse.Namespace) -> PlanArgs:
    return PlanArgs(tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                    gpus=args.gpus, gpu_memory=parse_bytes(args.gpu_memory),
                    gpu_memory_utilization=args.gpu_memory_utilization, context_len=args.context_len,
                    link_gbps=args.link_gbps, dtype_bytes=DTYPE_BYTES[args.dtype], experts_format=args.experts_format,
                    kv_cache_dtype=args.kv_cache_dtype)


def run(args: argparse.Namespace) -> int:
    config = load_model_config(args.model_dir)
    try:
        result = plan(config, plan_args(args))
    except ParallelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result) | {"weights_total": result.weights.total}, indent=2))
    else:
        print(format_plan(result))
    return 0 if result.fits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdamesh plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
