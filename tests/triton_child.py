"""Runs a test module's Triton checks in a child process with `TRITON_INTERPRET=1`.

Triton reads the flag only when it is first imported, and the parent test process has usually imported it already
(transformers does), so interpreter-mode checks run in a fresh interpreter. A module keeps its checks in a dict
`{name: fn}`, exposes `_run_checks_here(path)` calling `run_checks_here`, and gets `{name: [ok, traceback]}` back
from `run_in_child`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_checks_here(checks: dict[str, Callable[[], None]], result_path: str) -> None:
    """Child side: runs every check (seeded), writes {name: [ok, traceback]} as JSON."""
    results = {}
    for name, check in checks.items():
        torch.manual_seed(0)
        try:
            check()
            results[name] = [True, ""]
        except Exception:  # noqa: BLE001 - reported back to the parent test
            results[name] = [False, traceback.format_exc()]
    Path(result_path).write_text(json.dumps(results))


def run_in_child(module_name: str, tmp_dir: Path, timeout_s: float = 240) -> dict[str, list]:
    """Parent side: imports `module_name` in a TRITON_INTERPRET=1 child and returns its results."""
    importlib.import_module("triton")
    out = tmp_dir / "results.json"
    code = f"import {module_name} as m; m._run_checks_here({str(out)!r})"
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
