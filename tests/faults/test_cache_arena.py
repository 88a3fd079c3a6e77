"""The cache service's shared-memory arena on every exit path (issue 16 item 7), against real `python -m
cache_service` processes: SIGTERM removes it; a start that fails (address in use) leaves none; SIGKILL leaves it
behind, and the next start removes it (its pid is gone) while an arena of a live process is never touched."""

from __future__ import annotations

import os
import socket

from cache_service.shm_arena import ARENA_PREFIX, remove_stale_arenas
from tests.faults.procs import ServiceProcess


def _cache(shm_dir, address: str = "127.0.0.1:0") -> ServiceProcess:
    return ServiceProcess("cache_service", ["--address", address, "--shm-dir", str(shm_dir), "--byte-budget", "8MiB",
                                            "--grace-s", "0.5", "--log-level", "WARNING"], start_timeout_s=60)


def _arenas(shm_dir) -> dict[int, str]:
    """pid -> file name of every arena in `shm_dir`."""
    return {int(p.name[len(ARENA_PREFIX):].split("-")[0]): p.name for p in shm_dir.glob(f"{ARENA_PREFIX}*")}


def test_sigterm_removes_the_arena(tmp_path, services):
    cache = _cache(tmp_path)
    services.append(cache)
    cache.start()
    assert list(_arenas(tmp_path)) == [cache.pid]
    assert cache.terminate() == 0
    assert _arenas(tmp_path) == {}


def test_a_killed_service_s_arena_is_removed_by_the_next_start(tmp_path, services):
    first = _cache(tmp_path)
    services.append(first)
    first.start()
    first.kill()  # SIGKILL: nothing of the service runs
    assert list(_arenas(tmp_path)) == [first.pid]  # the defect: left behind, holding its memory
    live = tmp_path / f"{ARENA_PREFIX}{os.getpid()}-000000000000"  # a live process's (ours): must survive
    live.write_bytes(b"")
    second = _cache(tmp_path)
    services.append(second)
    second.start()
    assert set(_arenas(tmp_path)) == {second.pid, os.getpid()}
    assert second.terminate() == 0
    assert set(_arenas(tmp_path)) == {os.getpid()}


def test_a_failed_start_leaves_no_arena(tmp_path, services):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cache = _cache(tmp_path, f"127.0.0.1:{taken.getsockname()[1]}")
        services.append(cache)
        try:
            cache.start()
        except AssertionError:
            pass  # it exited: the address is in use
        else:
            raise AssertionError("a cache service started on an address in use")
        assert cache.proc.poll() not in (None, 0)
    assert _arenas(tmp_path) == {}


def test_remove_stale_arenas_skips_odd_names(tmp_path):
    (tmp_path / f"{ARENA_PREFIX}notapid-1").write_bytes(b"")
    dead = tmp_path / f"{ARENA_PREFIX}{2 ** 22 + 12345}-abc"  # above the default pid_max: never a live pid
    dead.write_bytes(b"")
    assert remove_stale_arenas(tmp_path) == [dead]
    assert [p.name for p in tmp_path.iterdir()] == [f"{ARENA_PREFIX}notapid-1"]
    assert remove_stale_arenas(tmp_path / "missing") == []
