"""What the benchmark scripts share: timing a call, the generated checkpoint of a preset, the JSON they write."""

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
    from deploy.launcher import default_model_dir

    return Path(args.model) if args.model else default_model_dir(args.preset)


def write_rows(path: Path, args: argparse.Namespace, rows: dict | list) -> None:
    """The run's flags (as strings) and its rows, as JSON."""
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
