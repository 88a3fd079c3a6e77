"""Supervision of the local mesh's processes (`kdamesh up` / `kdamesh serve MODEL`).

Contract:
- `Supervisor(services, policy, is_ready, start).watch()` polls the started services until one exits. With
  `policy.enabled` it restarts that one — same command line, same ports, so its peers' gRPC channels reconnect to
  it — after a backoff that starts at `first_backoff_s` and doubles up to `max_backoff_s` while the service keeps
  failing (a service that ran `stable_after_s` starts again from `first_backoff_s`). Every exit and restart is
  logged to stderr with the service's name, its exit code, the backoff and the restart counts; a restarted service
  is logged again once `is_ready` says it serves. Without `policy.enabled`, `watch()` raises
  `ServiceExited` (the launcher then stops the whole mesh and exits 1). `restarts` counts restarts per service name (a replica's `role-i`).
- `watch()` never returns on its own: the launcher leaves it through its signal handler's exception.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


class ServiceExited(RuntimeError):
    """A supervised service exited and restarts are off."""


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a service that ran this long restarts after first_backoff_s again
    poll_s: float = 0.5


@dataclass
class _Child:
    started_at: float
    backoff_s: float
    restart_at: float | None = None  # set while it is down and waiting for its restart
    awaiting_ready: bool = False


class Supervisor:
    def __init__(self, services: list, policy: RestartPolicy, is_ready: Callable[[object], bool],
                 start: Callable[[object], None]):
        self.services, self.policy, self.is_ready, self.start = services, policy, is_ready, start
        now = time.monotonic()
        self._children = {s.name: _Child(now, policy.first_backoff_s) for s in services}
        self.restarts = {s.name: 0 for s in services}

    def watch(self) -> None:
        while True:
            for service in self.services:
                self.check(service, time.monotonic())
            time.sleep(self.policy.poll_s)

    def check(self, service, now: float) -> None:
        """One look at `service`: notes an exit, restarts it when its backoff has passed, logs it ready again."""
        child = self._children[service.name]
        if service.alive:
            if child.awaiting_ready and self.is_ready(service):
                child.awaiting_ready = False
                _log(f"the {service.name} service is serving again")
            return
        if child.restart_at is None:
            self._exited(service, child, now)
        elif now >= child.restart_at:
            child.restart_at, child.started_at, child.awaiting_ready = None, now, True
            self.restarts[service.name] += 1
            self.start(service)
            _log(f"restarted the {service.name} service (pid {service.proc.pid}; restart "
                 f"{self.restarts[service.name]} of it, {sum(self.restarts.values())} in total)")

    def _exited(self, service, child: _Child, now: float) -> None:
        code = service.proc.returncode
        if not self.policy.enabled:
            raise ServiceExited(f"the {service.name} service exited (code {code})")
        if now - child.started_at >= self.policy.stable_after_s:
            child.backoff_s = self.policy.first_backoff_s
        child.restart_at = now + child.backoff_s
        _log(f"the {service.name} service exited (code {code}); restarting it in {child.backoff_s:.1f} s")
        child.backoff_s = min(child.backoff_s * 2, self.policy.max_backoff_s)


def _log(message: str) -> None:
    print(f"kdamesh up: {message}", file=sys.stderr, flush=True)
