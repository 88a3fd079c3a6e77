"""Integration fixtures: a real Redis server, and free ports.

`redis_url` points at `KDAMESH_TEST_REDIS_URL` (default `redis://127.0.0.1:6379/15`, a database kept for tests;
started by the session when nothing answers there: tests/redis_server.py) and flushes that database before and after
the test; `redis_cluster_url` is the shared 3-master test Redis Cluster (tests/redis_cluster.py: started with
deploy/redis_cluster.sh when it is not running). Nothing is skipped: when Redis cannot be started or reached the
test fails and says why.
"""

import socket
import subprocess
import time

import pytest
import redis

from tests.redis_cluster import RedisCluster, shared_cluster
from tests.redis_server import TEST_REDIS_URL as REDIS_URL
from tests.redis_server import redis_binary


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_client(shared_redis) -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"integration tests need a Redis server at {REDIS_URL} ({exc})", pytrace=False)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def redis_url(redis_client) -> str:
    return REDIS_URL


@pytest.fixture
def closed_port() -> int:
    return free_port()


class PrivateRedis:
    """A redis-server of our own on a free port, which a test may stop and restart."""

    def __init__(self):
        self.binary = redis_binary("redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"private redis-server on port {self.port} did not start", pytrace=False)
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_redis() -> PrivateRedis:
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster() -> RedisCluster:
    """The shared test Redis Cluster (tests/redis_cluster.py), started when it is not running, flushed around the
    test."""
    cluster = shared_cluster()
    cluster.flush()
    yield cluster
    cluster.flush()


@pytest.fixture
def redis_cluster_url(redis_cluster) -> str:
    return redis_cluster.url
