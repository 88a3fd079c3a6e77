"""Fault-suite fixtures: a private redis-server per test (never the shared 6379 one: tests pause and stop it), and
the `services` list whose subprocesses are killed after the test, whatever happened."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis

from tests.faults.procs import ServiceProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server on a free port that the test may pause (`CLIENT PAUSE`), stop and start again."""

    def __init__(self):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("the fault suite needs `redis-server` on PATH (apt-get install redis-server)", pytrace=False)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.paused_until = 0.0

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.admin().ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"private redis-server on port {self.port} did not start", pytrace=False)
                time.sleep(0.05)

    def pause(self, seconds: float) -> None:
        """Every client's commands wait for `seconds` (the server stays up and accepts connections). CLIENT UNPAUSE
        would wait too, so the pause just runs out (`wait_unpaused`)."""
        self.admin().execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        self.paused_until = time.monotonic() + seconds

    def wait_unpaused(self) -> None:
        time.sleep(max(0.0, self.paused_until - time.monotonic()) + 0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def own_redis() -> OwnRedis:
    server = OwnRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def services() -> list[ServiceProcess]:
    started: list[ServiceProcess] = []
    yield started
    for service in started:
        service.kill()
