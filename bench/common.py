"""What the benchmark scripts share: timing a call, the generated checkpoint of a preset, the table and JSON they
report."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path


def best_time(fn: Callable[[], object], repeats: int = 1) -> float:
    """Best wall time of `repeats` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def model_folder(args: argparse.Namespace) -> Path:
    """`--model` when given, else the generated checkpoint of `--preset` under $KDAMESH_HOME (made on first use)."""
    from deploy.checkpoints import default_model_dir

    return Path(args.model) if args.model else default_model_dir(args.preset)


def report(table: str, args: argparse.Namespace, rows: dict | list) -> int:
    """Prints the run's markdown table; with `--out`, writes the run's flags (as strings) and rows as JSON there.
    -> 0, the exit status."""
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


def op_counter():
    """A dispatch mode counting the aten calls made under it (`.count`; what a GPU would launch, before fusion)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    return OpCount()
