"""The large lane of the gateway's preparation pool on processes (gateway/prepare.py): heavy CPU work of a request
runs in `processes` spawned preparation processes (gateway/prep_worker.py), off the gateway process's GIL.

Contract:
- `ProcessLane(processes, config, objects)`: `objects` maps the gateway's own tokenizer / renderer / planner to
  their names (gateway/prep_worker.py `OBJECTS`): a job's arguments that are one of them (or a bound method of
  one) are sent by name and the process uses its own. Everything else in a job is pickled: `fn` must be a
  module-level function or such a bound method.
- `await run(fn, *args, max_model_len=...)` waits for an idle process (FIFO), sends the job and returns its result
  or re-raises its exception. Cancelling the call (the client went away, the request's deadline) kills the process
  running it, so the work stops at once and holds nothing; a replacement is started in the background.
- Processes start on the first job (each ~1–2 s: imports and the tokenizer), so a gateway that never sees a large
  request never pays for them; a process that fails to start is logged, the jobs waiting meet their deadline
  (gateway/prepare.py) and the next job starts another. `close()` kills them all.
- Pickling a job and unpickling its result happen on a thread per running job, never on the event loop.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.prep_worker import READY, read_frame, write_frame

log = logging.getLogger(__name__)
REPO_ROOT = str(Path(__file__).resolve().parent.parent)


class _JobPickler(pickle.Pickler):
    def __init__(self, file, names: dict[int, str]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names = names

    def persistent_id(self, obj):
        return self.names.get(id(obj))


class _Process:
    """One preparation process; `call` blocks (run it on a thread)."""

    def __init__(self, config):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH"))
                                                          if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.prep_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT)
        write_frame(self.proc.stdin, pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL))
        answer = read_frame(self.proc.stdout)
        if answer is None or pickle.loads(answer) != READY:
            self.kill()
            raise RuntimeError(f"a preparation process did not start (exit status {self.proc.wait()})")

    def call(self, names: dict[int, str], fn, args: tuple, max_model_len: int | None):
        buffer = io.BytesIO()
        _JobPickler(buffer, names).dump((fn, args, max_model_len))
        try:
            write_frame(self.proc.stdin, buffer.getvalue())
            answer = read_frame(self.proc.stdout)
        except (BrokenPipeError, ValueError, OSError):
            answer = None
        if answer is None:
            raise RuntimeError("the preparation process ended (killed or crashed) before answering")
        kind, value = pickle.loads(answer)
        if kind == "error":
            raise value
        return value

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class ProcessLane:
    def __init__(self, processes: int, config, objects: dict[str, Any]):
        self.processes = processes
        self.config = config
        self.names = {id(obj): name for name, obj in objects.items()}
        self.objects = list(objects.values())  # kept alive: their ids are the names' keys
        self._threads = ThreadPoolExecutor(processes + 1, thread_name_prefix="kdamesh-prepare-io")
        self._idle: asyncio.Queue[_Process] | None = None
        self._live: set[_Process] = set()
        self._starting = 0
        self._closed = False

    async def run(self, fn, *args: Any, max_model_len: int | None = None):
        loop = asyncio.get_running_loop()
        if self._idle is None:
            self._idle = asyncio.Queue()
        while self._starting + len(self._live) < self.processes:
            self._starting += 1
            loop.create_task(self._start_one())
        process = await self._idle.get()
        try:
            result = await loop.run_in_executor(self._threads, process.call, self.names, fn, args, max_model_len)
        except asyncio.CancelledError:
            self._replace(process)
            raise
        except BaseException:
            if process.proc.poll() is not None:
                self._replace(process)
            else:
                self._idle.put_nowait(process)
            raise
        self._idle.put_nowait(process)
        return result

    async def _start_one(self) -> None:
        try:
            process = await asyncio.to_thread(_Process, self.config)
        except Exception:  # noqa: BLE001 - logged; the next job starts another
            log.exception("a preparation process did not start")
            return
        finally:
            self._starting -= 1
        if self._closed:
            process.kill()
            return
        self._live.add(process)
        self._idle.put_nowait(process)

    def _replace(self, process: _Process) -> None:
        """Kills `process` (its work stops) and starts another in its place."""
        self._live.discard(process)
        process.kill()
        if not self._closed:
            self._starting += 1
            asyncio.get_running_loop().create_task(self._start_one())

    def close(self) -> None:
        self._closed = True
        for process in list(self._live):
            process.kill()
        self._live.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
