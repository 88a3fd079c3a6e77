"""The `kdamesh` command line.

Subcommands: `make-checkpoint` (a generated checkpoint in the official layout), `up` (the whole mesh on localhost,
deploy/launcher.py) and `serve --role cache|prefill|decode|gateway` (one service, deploy/serve.py: each role parses
its own flags, `kdamesh serve --role R --help` lists them) and `bench serve` (servebench/: `vllm bench serve`'s flags,
metrics and result JSON). Each subcommand calls one function; no logic lives here.

Global flags (before the subcommand): `--log-level`, `--log-format text|json` (telemetry/logs.py: JSON lines carry
the request id and trace id) and `--trace-exporter auto|none|console|otlp` (telemetry/tracing.py: "auto" exports over
OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, else nothing), set up once per `serve` process; `up` passes all three
to every service it starts.
"""

from __future__ import annotations

import argparse
import sys


def _make_checkpoint(args: argparse.Namespace) -> int:
    from engine.model.checkpoint import make_checkpoint

    make_checkpoint(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype,
                    max_shard_bytes=int(args.max_shard_mb * (1 << 20)), experts_format=args.experts_format)
    print(args.out_dir)
    return 0


def _up(args: argparse.Namespace) -> int:
    from deploy.launcher import LaunchConfig, up

    return up(LaunchConfig(
        model=args.model, mode=args.mode, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        cache_backend=args.cache_backend, cache_byte_budget=args.cache_byte_budget,
        pd_min_uncached_tokens=args.pd_min_uncached_tokens, kv_load_failure_policy=args.kv_load_failure_policy,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
        enable_prefix_caching=args.enable_prefix_caching, torch_threads=args.torch_threads,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        served_model_name=args.served_model_name, gateway_grpc_port=args.gateway_grpc_port,
        api_keys_file=args.api_keys_file, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
        log_level=args.log_level.upper(), log_format=args.log_format, trace_exporter=args.trace_exporter,
        metrics_port=args.metrics_port, grace_s=args.grace_s))


def _serve(args: argparse.Namespace) -> int:
    from deploy.serve import run_role

    return run_role(args.role, args.role_args, log_level=args.log_level)


def _plan(args: argparse.Namespace) -> int:
    from deploy import plan_cli

    return plan_cli.main(args.plan_args)


def _bench_serve(args: argparse.Namespace) -> int:
    from servebench.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdamesh", description="Serve Kimi K3 and Kimi Linear models.")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text or one JSON object per line (with request id and trace id)")
    parser.add_argument("--trace-exporter", default="auto", choices=["auto", "none", "console", "otlp"],
                        help="serve (and every service `up` starts): where spans go; auto: OTLP when "
                             "OTEL_EXPORTER_OTLP_ENDPOINT is set, else none")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_checkpoint(sub)
    _add_up(sub)
    sub.add_parser("plan", help="MODEL_DIR [-tp N ...]: per-rank memory, the concurrency that fits, handoff cost",
                   add_help=False).set_defaults(func=_plan)  # its flags: deploy/plan_cli.py
    sv = sub.add_parser("serve", help="run one service: --role cache|prefill|decode|gateway [its flags]",
                        add_help=False)
    sv.add_argument("--role", required=True, choices=["cache", "prefill", "decode", "gateway"])
    sv.set_defaults(func=_serve)
    from servebench.cli import add_cli_args  # argparse only: cheap to import

    bench = sub.add_parser("bench", help="benchmarks: `bench serve` (the flags and metrics of `vllm bench serve`)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible endpoint")
    add_cli_args(bs).set_defaults(func=_bench_serve)
    return parser


def _add_make_checkpoint(sub) -> None:
    from engine.model.presets import PRESETS

    mk = sub.add_parser("make-checkpoint", help="write a random, seeded checkpoint in the official layout")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS))
    mk.add_argument("out_dir")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--max-shard-mb", type=float, default=2048.0, help="shard the weights above this size")
    mk.add_argument("--experts-format", default="dense", choices=["dense", "mxfp4"])
    mk.set_defaults(func=_make_checkpoint)


def _add_up(sub) -> None:
    u = sub.add_parser("up", help="start cache, prefill, decode and gateway on localhost; Ctrl-C stops them")
    u.add_argument("--model", default=None, help="checkpoint folder (default: small-k3, generated on first run)")
    u.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--http-port", type=int, default=8000, help="the gateway's REST port")
    u.add_argument("--grpc-port", type=int, default=None,
                   help="first of three consecutive ports for the cache, prefill and decode services (default: free)")
    u.add_argument("--cache-backend", default="memory", help="'memory' or redis://host:port/db")
    u.add_argument("--cache-byte-budget", default=None, help="memory backend budget, e.g. 4GiB")
    u.add_argument("--pd-min-uncached-tokens", type=int, default=256,
                   help="prefill remotely only when at least this many prompt tokens are uncached")
    u.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    _add_up_engine_flags(u)
    u.add_argument("--served-model-name", default=None)
    u.add_argument("--metrics-port", type=int, default=None,
                   help="first of three consecutive Prometheus /metrics ports for the cache, prefill and decode "
                        "services (default: free); the gateway's /metrics is on its REST port")
    u.add_argument("--grace-s", type=float, default=None,
                   help="on Ctrl-C/SIGTERM: how long every service lets calls and streams in flight finish (seconds; "
                        "default: each service's own, 5 s)")
    u.add_argument("--gateway-grpc-port", type=int, default=None,
                   help="the gateway's public gRPC API (default: --grpc-port + 3, or a free port)")
    u.add_argument("--api-keys-file", default=None,
                   help="JSON object of API key -> tenant for the gateway (KDAMESH_API_KEYS is passed through too)")
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        u.add_argument(flag, default="auto", help="'auto' (the model family's format), 'none', kimi_k3 or kimi_k2")
    u.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help='tool_choice "auto" (needs a tool-call parser)')
    u.set_defaults(func=_up)


def _add_up_engine_flags(u: argparse.ArgumentParser) -> None:
    """The engine options `up` passes to both workers (unset: the engine's defaults)."""
    u.add_argument("--max-num-seqs", type=int, default=None)
    u.add_argument("--max-num-batched-tokens", type=int, default=None)
    u.add_argument("--kv-cache-memory", default=None, help="per worker, e.g. 1GiB")
    u.add_argument("--max-model-len", type=int, default=None)
    u.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    u.add_argument("--device", default=None)
    u.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    u.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker process")
    u.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="rank processes per worker")
    u.add_argument("--enable-expert-parallel", action="store_true", help="split the routed experts by expert")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        args.role_args = rest  # the role's own flags, parsed by deploy/serve.py
    elif args.command == "plan":
        args.plan_args = rest  # parsed by deploy/plan_cli.py
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from telemetry.logs import setup_logging

    service = f"kdamesh-{args.role}" if args.command == "serve" else "kdamesh"
    setup_logging(args.log_level, args.log_format, service)
    if args.command == "serve":
        from telemetry.tracing import setup_tracing

        setup_tracing(service, args.trace_exporter)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
