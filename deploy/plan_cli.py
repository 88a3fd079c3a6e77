"""`kdamesh plan MODEL_DIR`: per-rank memory (weights, drafter, vision, runtime, activations, requests), the
concurrency that fits, load peak, handoff cost.

Contract: `add_arguments(parser)` adds the flags (`--tensor-parallel-size`, `--enable-expert-parallel`,
`--kv-cache-dtype`, `--decode-context-parallel-size`, `--gpus`, `--gpu-memory`, `--gpu-memory-utilization`, `--context-len`, `--link-gbps`, `--dtype`,
`--experts-format`, `--pipeline-parallel-size`, `--speculative-method`, `--num-speculative-tokens`, `--drafter-dir`,
`--vision-bytes`, `--runtime-memory`, `--max-num-batched-tokens`, `--shard-bytes`, `--json`, `--gpus-per-node`,
`--max-nodes`) and the positional
MODEL_DIR (a folder with `config.json`; no weights are read: a `--drafter-dir` DSpark folder's tensor sizes come
from its safetensors headers); `run(args)` prints the plan (engine/plan.py) and returns 0 when it fits, 1 when it
does not; `main(argv)` parses and runs. A split that does not divide (heads, vocabulary, experts) is reported as an
error naming the dimension (exit 2), as is a combination the planner refuses (e.g. `--speculative-method dspark`
without `--drafter-dir`). The vision tower's bytes default to its parameters counted on the meta device when the
config has a `vision_config` (else 0: pass `--vision-bytes`). With `--gpus-per-node G`, `run` proposes a layout
instead: TP = G inside a node and PP = the fewest nodes (1..`--max-nodes`) whose plan fits, listing every
candidate's verdict, then the chosen plan and its flags (exit 1 when none fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.config import EngineArgs, parse_bytes
from engine.model.config import ModelConfig, load_model_config
from engine.parallel.config import ParallelError
from engine.plan import SPECULATIVE_METHODS, DrafterBytes, PlanArgs, format_plan, plan
from telemetry.options import add_options

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlanArgs()
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="folder with config.json (weights are not read)")
    add_options(parser, EngineArgs, only=("tensor_parallel_size", "enable_expert_parallel", "kv_cache_dtype",
                                          "decode_context_parallel_size"))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: one replica)")
    parser.add_argument("--gpu-memory", default="141GB", help="memory per GPU, e.g. 141GB (H200), 288GB (B300)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--context-len", type=int, default=d.context_len, help="tokens per request")
    parser.add_argument("--link-gbps", type=float, default=d.link_gbps, help="prefill -> decode link, Gb/s")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="weights and KV")
    parser.add_argument("--experts-format", choices=["auto", "dense", "mxfp4"], default="auto")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="layer stages (computed per stage; the engine's --pipeline-parallel-size)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="propose a layout instead: TP = this node size, PP = the fewest nodes (up to "
                             "--max-nodes) whose plan fits; the others' verdicts are listed")
    parser.add_argument("--max-nodes", type=int, default=4, help="the most nodes --gpus-per-node tries")
    parser.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default="none")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="k: 1 + k state slots per request")
    parser.add_argument("--drafter-dir", default=None, help="a DSpark drafter folder (--speculative-method dspark)")
    parser.add_argument("--vision-bytes", default=None, help="vision tower bytes on the lead rank (default: counted "
                                                             "from the config's vision_config, else 0)")
    parser.add_argument("--runtime-memory", default="2GB", help="per GPU: CUDA context, NCCL buffers (assumed)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="the largest prefill step (its activations stay reserved)")
    parser.add_argument("--shard-bytes", default="5GB", help="the largest checkpoint file (load peak)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def vision_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """The vision tower + projector's parameters (counted on the meta device: nothing allocated) x dtype bytes."""
    if config.vision is None:
        return 0
    import torch

    from engine.vision.encoder import VisionEncoder

    with torch.device("meta"):
        encoder = VisionEncoder(config.vision)
    return sum(p.numel() for p in encoder.parameters()) * dtype_bytes


def drafter_bytes(folder: str, dtype_bytes: int) -> DrafterBytes:
    """A DSpark folder: its tensors at `dtype_bytes` (from the safetensors headers) and its context rows per token
    (every layer's latent `[kv_lora + rope]`)."""
    from engine.model.loader import checkpoint_files, read_header

    raw = json.loads((Path(folder) / "config.json").read_text())
    header = read_header(checkpoint_files(Path(folder)))
    weights = sum(_numel(shape) for _, shape in header.values()) * dtype_bytes
    row = int(raw["num_hidden_layers"]) * (int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])) * dtype_bytes
    return DrafterBytes(weights, row)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_args(args: argparse.Namespace, config: ModelConfig) -> PlanArgs:
    d = DTYPE_BYTES[args.dtype]
    return PlanArgs(tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                    gpus=args.gpus, gpu_memory=parse_bytes(args.gpu_memory, "gpu_memory"),
                    gpu_memory_utilization=args.gpu_memory_utilization, context_len=args.context_len,
                    link_gbps=args.link_gbps, dtype_bytes=d, experts_format=args.experts_format,
                    kv_cache_dtype=args.kv_cache_dtype, pipeline_parallel_size=args.pipeline_parallel_size,
                    decode_context_parallel_size=args.decode_context_parallel_size,
                    num_speculative_tokens=args.num_speculative_tokens, speculative_method=args.speculative_method,
                    drafter=drafter_bytes(args.drafter_dir, d) if args.drafter_dir else None,
                    vision_bytes=(parse_bytes(args.vision_bytes, "vision_bytes") if args.vision_bytes is not None
                                  else vision_bytes(config, d)),
                    runtime_bytes=parse_bytes(args.runtime_memory, "runtime_memory"),
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    shard_bytes=parse_bytes(args.shard_bytes, "shard_bytes"))


def propose(config: ModelConfig, args: argparse.Namespace) -> list[tuple[int, int, object]]:
    """(tp, pp, plan or the refusal's message) per node count 1..max_nodes: TP inside a node (its NVLink), PP across
    nodes, as vLLM's multi-node recipes lay out a model that does not fit one node."""
    out = []
    for nodes in range(1, args.max_nodes + 1):
        trial = argparse.Namespace(**{**vars(args), "tensor_parallel_size": args.gpus_per_node,
                                      "pipeline_parallel_size": nodes, "gpus": None})
        try:
            out.append((args.gpus_per_node, nodes, plan(config, plan_args(trial, config))))
        except (ParallelError, ValueError) as exc:
            out.append((args.gpus_per_node, nodes, str(exc)))
    return out


def run_proposal(config: ModelConfig, args: argparse.Namespace) -> int:
    """Prints each candidate's verdict and the proposed layout (the fewest nodes that fit): 0, or 1 if none fits."""
    chosen = None
    for tp, pp, result in propose(config, args):
        if isinstance(result, str):
            print(f"TP{tp} x PP{pp} ({pp} node(s) of {tp}): cannot split: {result}")
            continue
        verdict = (f"fits, {result.concurrency} requests of {args.context_len} tokens per replica" if result.fits
                   else f"does not fit: {result.reason}")
        print(f"TP{tp} x PP{pp} ({pp} node(s) of {tp}): {verdict}")
        if result.fits and chosen is None:
            chosen = (tp, pp, result)
    if chosen is None:
        print(f"proposed: none within {args.max_nodes} node(s) of {args.gpus_per_node}")
        return 1
    tp, pp, result = chosen
    print(f"proposed: --tensor-parallel-size {tp} --pipeline-parallel-size {pp} --nnodes {pp}\n")
    print(format_plan(result))
    return 0


def run(args: argparse.Namespace) -> int:
    config = load_model_config(args.model_dir)
    if args.gpus_per_node is not None:
        return run_proposal(config, args)
    try:
        result = plan(config, plan_args(args, config))
    except (ParallelError, ValueError) as exc:
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
