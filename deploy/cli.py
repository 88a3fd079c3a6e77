"""The `kdamesh` command line.

Subcommands: `make-checkpoint` (a generated checkpoint in the official layout). Later issues add `up`, `serve` and
`bench`. Each subcommand parses its own flags and calls one function; no logic lives here.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _make_checkpoint(args: argparse.Namespace) -> int:
    from engine.model.checkpoint import make_checkpoint

    make_checkpoint(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype,
                    max_shard_bytes=int(args.max_shard_mb * (1 << 20)), experts_format=args.experts_format)
    print(args.out_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.model.presets import PRESETS

    parser = argparse.ArgumentParser(prog="kdamesh", description="Serve Kimi K3 and Kimi Linear models.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a random, seeded checkpoint in the official layout")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS))
    mk.add_argument("out_dir")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--max-shard-mb", type=float, default=2048.0, help="shard the weights above this size")
    mk.add_argument("--experts-format", default="dense", choices=["dense", "mxfp4"])
    mk.set_defaults(func=_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
