"""Fault-suite fixtures: a private redis-server per test (never the shared 6379 one: tests pause and stop it), and
the `services` list whose subprocesses are killed after the test, whatever happened."""

from __future__ import annotations

import time

import pytest
import redis

from tests.faults.procs import ServiceProcess
from tests.integration.conftest import PrivateRedis, free_port  # noqa: F401 - free_port: for the fault tests


class OwnRedis(PrivateRedis):
    """A redis-server on a free port that the test may pause (`CLIENT PAUSE`), stop and start again."""

    def __init__(self):
        super().__init__()
        self.paused_until = 0.0

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def pause(self, seconds: float) -> None:
        """Every client's commands wait for `seconds` (the server stays up and accepts connections). CLIENT UNPAUSE
        would wait too, so the pause just runs out (`wait_unpaused`)."""
        self.admin().execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        self.paused_until = time.monotonic() + seconds

    def wait_unpaused(self) -> None:
        time.sleep(max(0.0, self.paused_until - time.monotonic()) + 0.05)


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
