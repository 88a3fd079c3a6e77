"""Services as real subprocesses for the fault suite: start one with its `python -m` entry point, wait for its
"listening on HOST:PORT" line, then stop, SIGTERM or SIGKILL it.

`ServiceProcess(module, args)` is one service; `start()` returns its port; `kill()` is SIGKILL (no cleanup runs),
`terminate()` SIGTERM (a clean stop), both waiting for the exit; `restart()` starts it again with the same
arguments (a supervisor restarting a crashed service would do the same; a launcher with restarts can replace this
class behind the same three calls). Its output is kept (`output`) for failure messages. Every process is killed
at the end of the test by the `services` fixture (conftest), whatever happened.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on \S+:(\d+)")


class ServiceProcess:
    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None,
                 start_timeout_s: float = 60.0):
        self.module = module
        self.args = list(args)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> int:
        """Starts the process and waits for its "listening" line -> the port. AssertionError when it exits or
        stays silent for `start_timeout_s`."""
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env, cwd=ROOT)
        self._lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self._lines), daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            match = _LISTENING.search(line)
            if match:
                self.port = int(match.group(1))
                return self.port
        self.kill()
        raise AssertionError(f"{self.module} did not start:\n" + "".join(self.output[-40:]))

    def _pump(self, proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            self.output.append(line)
            lines.put(line)
        lines.put(None)

    def wait_exit(self, timeout_s: float = 20.0) -> int:
        """Waits for the exit -> the return code (the output is read to its end)."""
        code = self.proc.wait(timeout=timeout_s)
        return code

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=20)

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then the exit code (SIGKILL after `timeout_s`)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.module} ignored SIGTERM for {timeout_s} s") from None

    def restart(self) -> int:
        self.kill()
        return self.start()
