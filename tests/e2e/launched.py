"""`kdamesh up` as a subprocess for the end-to-end tests: tiny-k3 generated in the test's folder (or a given model), the gateway on a
free port, every request prefilled remotely (`--pd-min-uncached-tokens 0`), one torch thread per worker.

`launch(root, ...)` starts it (`command="serve"`: as `kdamesh serve MODEL --port P ...`) and waits until it prints
a line starting with `wait_for` (it prints `metrics {...}`, `endpoints {...}` and `gateway_grpc HOST:PORT` once every
service is ready); a launcher that exits or is not ready within STARTUP_TIMEOUT_S fails the test with the end of its
log. `stop(proc)` sends SIGTERM and
kills what does not exit within the timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.launcher import free_port
from engine.model.checkpoint import make_checkpoint

STARTUP_TIMEOUT_S = 150
MODEL = "tiny-k3"


def kdamesh() -> list[str]:
    """The installed `kdamesh` script next to this interpreter, else `python -m deploy.cli`."""
    script = Path(sys.executable).with_name("kdamesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "deploy.cli"]


@dataclass
class Launched:
    proc: subprocess.Popen
    port: int  # the gateway's REST port
    model: Path
    root: Path
    log: Path
    line: str  # the awaited line, after its prefix


def launch(root: Path, wait_for: str, *, global_flags: Sequence[str] = (), up_flags: Sequence[str] = (),
           env: Mapping[str, str] | None = None, command: str = "up", model: Path | None = None) -> Launched:
    """Starts `kdamesh [global_flags] up ... [up_flags]` (or `serve MODEL ...`) with `env` (default: this
    process's) in `root`, on `model` (default: tiny-k3 generated in `root`)."""
    model = model or make_checkpoint(MODEL, root / MODEL, seed=3)
    port = free_port()
    head = ["up", "--model", str(model), "--http-port"] if command == "up" else ["serve", str(model), "--port"]
    log_path = root / "up.log"
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", "KDAMESH_HOME": str(root / "home")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*kdamesh(), *global_flags, *head, str(port),
                                 "--pd-min-uncached-tokens", "0", "--max-num-seqs", "8", "--kv-cache-memory", "32MiB",
                                 "--torch-threads", "1", *up_flags], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=root)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        text = log_path.read_text()
        found = next((line for line in text.splitlines() if line.startswith(wait_for)), None)
        if found is not None:
            return Launched(proc, port, model, root, log_path, found[len(wait_for):])
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"kdamesh up did not come up (exit {proc.poll()}):\n{text[-4000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (the launcher stops its services, which also die with it: PR_SET_PDEATHSIG), SIGKILL after
    `timeout_s`. Nothing to do for a launcher that exited already."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
