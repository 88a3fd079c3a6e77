"""The `kdamesh` command line.

Subcommands: `make-checkpoint` (a generated checkpoint in the official layout), `train-demo OUT_DIR` (trains the
demo K3 model, trainer/; `python -m bench.demo_eval DIR` measures it), `distill-demo FOLDER` (its drafters again,
flags from `DistillConfig`), `up` (the whole mesh on localhost,
deploy/launcher.py), `serve MODEL [flags]` (the same mesh, a drop-in for `vllm serve MODEL`: its flags and `up`'s
come from `LaunchConfig`, deploy/flags.py), `serve --role cache|prefill|decode|gateway` (one service, deploy/serve.py: each
role parses its own flags, `kdamesh serve --role R --help` lists them) and `bench serve` (servebench/: `vllm bench
serve`'s flags, metrics and result JSON). Each subcommand calls one function; no logic lives here.

Global flags (before the subcommand): `--log-level`, `--log-format text|json` (telemetry/logs.py: JSON lines carry
the request id and trace id) and `--trace-exporter auto|none|console|otlp` (telemetry/tracing.py: "auto" exports over
OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, else nothing), set up once per `serve` process; `up` passes all three
to every service it starts.
"""

from __future__ import annotations

import argparse
import sys

from dataclasses import dataclass

from deploy.flags import refusal
from deploy.mesh_plan import add_mesh_flags, launch_config_from
from telemetry.logs import LOG_FORMATS
from telemetry.options import add_options, log_level_option, option
from telemetry.tracing import EXPORTERS

@dataclass(frozen=True)
class GlobalOptions:
    """The flags before the subcommand, for every service a `kdamesh` process runs or starts."""

    log_level: str = log_level_option()
    log_format: str = option("--log-format", default="text", choices=LOG_FORMATS,
                             help="log lines as text or one JSON object per line (with request id and trace id)")
    trace_exporter: str = option("--trace-exporter", default="auto", choices=EXPORTERS,
                                 help="serve (and every service `up` starts): where spans go; auto: OTLP when "
                                      "OTEL_EXPORTER_OTLP_ENDPOINT is set, else none")


SERVE_MODEL_HELP = ("Serve MODEL with the whole mesh on localhost (cache, prefill, decode, gateway), as `kdamesh up "
                    "--model MODEL` does; takes the `vllm serve` flags that apply and refuses, naming it, a flag "
                    "whose feature is not built yet.")


def _make_checkpoint(args: argparse.Namespace) -> int:
    from engine.model.checkpoint import make_checkpoint

    make_checkpoint(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype,
                    max_shard_bytes=int(args.max_shard_mb * (1 << 20)), experts_format=args.experts_format)
    print(args.out_dir)
    return 0


def _train_demo(args: argparse.Namespace) -> int:
    from trainer.config import TrainConfig
    from trainer.train import train

    given = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name) is not None}
    train(TrainConfig(out_dir=args.out_dir, tiny=args.tiny, **given), command=["kdamesh", *sys.argv[1:]])
    print(args.out_dir)
    return 0


def _distill_demo(args: argparse.Namespace) -> int:
    from trainer.config import DistillConfig
    from trainer.train import redistill

    given = {f.name: getattr(args, f.name) for f in distill_fields() if getattr(args, f.name) is not None}
    try:
        config = DistillConfig(**given)
    except ValueError as exc:
        raise SystemExit(f"kdamesh distill-demo: {exc}") from None
    redistill(args.out_dir, config, command=["kdamesh", *sys.argv[1:]])
    print(args.out_dir)
    return 0


def _up(args: argparse.Namespace) -> int:
    from deploy.launcher import up

    try:
        config = launch_config_from(args, args.log_level, args.log_format, args.trace_exporter)
    except ValueError as exc:  # LaunchConfig's checks (mode, replicas)
        print(f"kdamesh up: {exc}", file=sys.stderr)
        return 2
    return up(config)


def _serve(args: argparse.Namespace) -> int:
    if args.role is None:  # `kdamesh serve MODEL [vllm serve flags]`: the whole mesh, like `up`
        mesh = argparse.ArgumentParser(prog="kdamesh serve", description=SERVE_MODEL_HELP)
        add_mesh_flags(mesh, model_positional=True)
        ns = mesh.parse_args(args.role_args)
        _refuse(mesh, ns)
        return _up(argparse.Namespace(**vars(ns), log_level=args.log_level, log_format=args.log_format,
                                      trace_exporter=args.trace_exporter))
    from deploy.serve import run_role

    return run_role(args.role, args.role_args, log_level=args.log_level)


def _one_machine(ns: argparse.Namespace) -> str | None:
    """The local mesh is one machine: a rank group over several is started per worker role."""
    if getattr(ns, "nnodes", 1) != 1 or getattr(ns, "node_rank", 0) != 0:
        return ("--nnodes/--node-rank: `kdamesh up` runs on one machine; start a rank group over several machines "
                "per worker (kdamesh serve --role decode --nnodes N --node-rank 0 --master-addr ... on rank 0's "
                "machine, kdamesh node --node-rank K on the others; docs/deployment.md)")
    return None


def _refuse(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """argparse's error (exit 2) naming a flag whose feature is not built yet, or whose value an option object
    refuses (the gateway's image URL flags, the engine's options, the replica counts)."""
    message = refusal(ns) or _one_machine(ns)
    if message is None:
        try:
            launch_config_from(ns, "INFO", "text", "none")
        except ValueError as exc:
            message = str(exc)
    if message is not None:
        parser.error(message)


def _plan(args: argparse.Namespace) -> int:
    from deploy import plan_cli

    return plan_cli.main(args.plan_args)


def _node(args: argparse.Namespace) -> int:
    from engine.parallel import node

    return node.main(args.node_args, prog="kdamesh node")


def _bench_serve(args: argparse.Namespace) -> int:
    from servebench.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdamesh", description="Serve Kimi K3 and Kimi Linear models.")
    add_options(parser, GlobalOptions)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_checkpoint(sub)
    _add_train_demo(sub)
    _add_distill_demo(sub)
    _add_up(sub)
    sub.add_parser("plan", help="MODEL_DIR [-tp N ...]: per-rank memory, the concurrency that fits, handoff cost",
                   add_help=False).set_defaults(func=_plan)  # its flags: deploy/plan_cli.py
    sub.add_parser("node", help="--node-rank K [engine flags]: this machine's ranks of a rank group spanning "
                                "several machines (engine/parallel/node.py)",
                   add_help=False).set_defaults(func=_node)  # its flags: the engine's own (NODE_OPTIONS)
    sv = sub.add_parser("serve", help="`serve MODEL [flags]`: the whole mesh (`vllm serve` flags); "
                                      "`serve --role cache|prefill|decode|gateway [its flags]`: one service",
                        add_help=False)
    sv.add_argument("--role", default=None, choices=["cache", "prefill", "decode", "gateway"])
    sv.set_defaults(func=_serve)
    from servebench.cli import add_cli_args  # argparse only: cheap to import

    bench = sub.add_parser("bench", help="benchmarks: `bench serve` (the flags and metrics of `vllm bench serve`)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible endpoint")
    add_cli_args(bs).set_defaults(func=_bench_serve)
    return parser


def _add_make_checkpoint(sub) -> None:
    from engine.model.presets import DRAFTER_PRESETS, PRESETS

    mk = sub.add_parser("make-checkpoint", help="write a random, seeded checkpoint in the official layout")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS | DRAFTER_PRESETS),
                    help="a model, or a drafter (*-dspark: a k3_dspark folder for the matching K3 preset)")
    mk.add_argument("out_dir")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--max-shard-mb", type=float, default=2048.0, help="shard the weights above this size")
    mk.add_argument("--experts-format", default="dense", choices=["dense", "mxfp4"])
    mk.set_defaults(func=_make_checkpoint)


TRAIN_FLAGS = {"steps": int, "time_budget_s": float, "batch_size": int, "seq_len": int, "lr": float, "seed": int,
               "threads": int}


def _add_train_demo(sub) -> None:
    td = sub.add_parser("train-demo", help="train the demo K3 model (torch, CPU) into OUT_DIR; resumes a run there")
    td.add_argument("out_dir")
    for name, kind in TRAIN_FLAGS.items():
        td.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                        help="default: trainer/config.py TrainConfig")
    td.add_argument("--tiny", action="store_true", help="the 4-layer width-64 test configuration")
    td.set_defaults(func=_train_demo)


def distill_fields():
    import dataclasses

    from trainer.config import DistillConfig

    return dataclasses.fields(DistillConfig)


def _add_distill_demo(sub) -> None:
    dd = sub.add_parser("distill-demo", help="distil the drafters (MTP, DSpark) of a trained demo folder again; "
                                             "the target is unchanged")
    dd.add_argument("out_dir", metavar="FOLDER", help="a trained demo folder (train-demo's OUT_DIR)")
    for f in distill_fields():
        dd.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"default {f.default} (trainer/config.py DistillConfig)")
    dd.set_defaults(func=_distill_demo)


def _add_up(sub) -> None:
    u = sub.add_parser("up", help="start cache, prefill, decode and gateway on localhost; Ctrl-C stops them")
    add_mesh_flags(u, model_positional=False)
    u.set_defaults(func=_up, up_parser=u)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        args.role_args = rest  # the role's own flags, parsed by deploy/serve.py
    elif args.command == "plan":
        args.plan_args = rest  # parsed by deploy/plan_cli.py
    elif args.command == "node":
        args.node_args = rest  # parsed by engine/parallel/node.py
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.command == "up":
        _refuse(args.up_parser, args)
    from telemetry.logs import setup_logging

    one_role = args.command == "serve" and args.role is not None
    service = f"kdamesh-{args.role}" if one_role else "kdamesh"
    setup_logging(args.log_level, args.log_format, service)
    if one_role:
        from telemetry.tracing import setup_tracing

        setup_tracing(service, args.trace_exporter)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
