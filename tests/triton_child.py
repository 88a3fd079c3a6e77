"""Runs a test module's Triton checks in a child process with `TRITON_INTERPRET=1`.

Triton reads the flag only when it is first imported (its `tl` builtins are built for one mode), and the parent test
process has usually imported it already (any module importing transformers does, at collection time), so
interpreter-mode checks run in a fresh interpreter. A test module keeps its checks in one
`ChildChecks` named `TRITON_CHECKS`:

    TRITON_CHECKS = triton_child.ChildChecks(__name__)
    triton_check = TRITON_CHECKS.check  # decorator: registers a check by its function name

    @triton_check
    def triton_something(): ...

    test_triton_interpreted = TRITON_CHECKS.pytest_test()  # at the end: one test per check

The first of those tests starts one child for the whole module (`run_in_child`); the child runs every check, seeded,
and writes `{name: [ok, traceback]}` back (`run_checks_here`).
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
from types import ModuleType

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


class ChildChecks:
    """One module's Triton checks: registered by name, run together in one interpreter-mode child."""

    def __init__(self, module_name: str, timeout_s: float = 240):
        self.module_name = module_name
        self.timeout_s = timeout_s  # the whole child: every check of the module
        self.checks: dict[str, Callable[[], None]] = {}
        self._results: dict[str, list] | None = None  # the child's report, once it has run

    def check(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.checks[fn.__name__] = fn
        return fn

    def run_here(self, result_path: str) -> None:
        """Child side (see run_in_child)."""
        run_checks_here(self.checks, result_path)

    def results(self, tmp_dir_factory: pytest.TempPathFactory) -> dict[str, list]:
        if self._results is None:
            self._results = run_in_child(self.module_name, tmp_dir_factory.mktemp("triton"), self.timeout_s)
        return self._results

    def pytest_test(self) -> Callable:
        """A test parametrized over the checks registered so far, each reporting its result from the child."""

        @pytest.mark.parametrize("name", sorted(self.checks))
        def test_triton_interpreted(tmp_path_factory, name):
            ok, trace = self.results(tmp_path_factory)[name]
            assert ok, trace

        return test_triton_interpreted


def import_interpreted(module_name: str, kernel: str) -> ModuleType:
    """Child side: imports a Triton backend module, checked to be built for the interpreter (through `kernel`)."""
    module = importlib.import_module(module_name)
    assert type(getattr(module, kernel)).__name__ == "InterpretedFunction"
    return module


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
    """Parent side: imports `module_name` in a TRITON_INTERPRET=1 child, runs its TRITON_CHECKS, returns the results."""
    importlib.import_module("triton")
    out = tmp_dir / "results.json"
    code = f"import {module_name} as m; m.TRITON_CHECKS.run_here({str(out)!r})"
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
