"""The Redis servers the test suite needs, started by the suite itself (so `make test` passes on a fresh machine).

- `redis_binary(name)`: `redis-server` / `redis-cli` from PATH (`make test` installs the system's package when they
  are missing), else a failed test that says how to get them. The cache service needs Redis >= 7
  (`PEXPIRE ... GT`): an older `redis-server` fails the test with its version.
- `SharedRedis(url)`: the single Redis of `TEST_REDIS_URL` (`KDAMESH_TEST_REDIS_URL`, default
  `redis://127.0.0.1:6379/15`). `ensure()` reuses a server that answers PING;
  otherwise, for a 127.0.0.1 / localhost URL, it starts `redis-server` on that port (nothing on disk) and waits for
  it, within `START_TIMEOUT_S`. `stop()` stops only a server it started. A remote URL that does not answer fails.
tests/conftest.py holds one `SharedRedis` and the shared cluster (tests/redis_cluster.py) per session and stops at
the session's end what the session started.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from urllib.parse import urlparse

import pytest
import redis

TEST_REDIS_URL = os.environ.get("KDAMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")  # db 15: kept for tests
START_TIMEOUT_S = 15.0
LOCAL_HOSTS = ("127.0.0.1", "localhost")
MIN_MAJOR = 7
HOW = "`make test` installs it (apt-get install redis-server), or install Redis >= 7 yourself"


def redis_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"the tests need `{name}` on PATH: {HOW}", pytrace=False)
    if name == "redis-server" and _major(found) < MIN_MAJOR:
        pytest.fail(f"{found} is Redis {_major(found)}; the cache service needs Redis >= {MIN_MAJOR}: {HOW}",
                    pytrace=False)
    return found


@functools.cache
def _major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else 0


def answers(host: str, port: int) -> bool:
    try:
        return bool(redis.Redis(host=host, port=port, socket_connect_timeout=0.5, socket_timeout=2).ping())
    except redis.RedisError:
        return False


class SharedRedis:
    """The suite's single Redis (see the module docstring)."""

    def __init__(self, url: str):
        parsed = urlparse(url)
        self.url = url
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 6379
        self.proc: subprocess.Popen | None = None

    def ensure(self) -> None:
        if self.proc is not None or answers(self.host, self.port):
            return
        if self.host not in LOCAL_HOSTS:
            pytest.fail(f"no Redis answers at {self.url} (KDAMESH_TEST_REDIS_URL); the tests start one only on "
                        f"127.0.0.1", pytrace=False)
        self.proc = subprocess.Popen([redis_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers(self.host, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on 127.0.0.1:{self.port} did not answer PING within {START_TIMEOUT_S} s "
                            f"(is the port taken?)", pytrace=False)
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None
