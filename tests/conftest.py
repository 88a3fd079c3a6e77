"""Shared test fixtures: deterministic seeds, small thread counts, and the Redis servers the suite starts itself.

`shared_redis` (session): the single test Redis (tests/redis_server.py), started when nothing answers at
`KDAMESH_TEST_REDIS_URL`; the shared Redis Cluster starts on first use (tests/redis_cluster.py). Whatever the
session started is stopped when it ends, so a fresh machine needs no Redis running (only the dev extra installed).
"""

import os

import pytest
import torch

from tests.redis_cluster import stop_shared_if_started
from tests.redis_server import TEST_REDIS_URL, SharedRedis

torch.set_num_threads(1)  # tiny shapes: thread start-up costs more than it saves


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


_SHARED_REDIS = SharedRedis(TEST_REDIS_URL)


@pytest.fixture(scope="session")
def shared_redis() -> SharedRedis:
    _SHARED_REDIS.ensure()
    return _SHARED_REDIS


def pytest_sessionfinish(session, exitstatus):
    _SHARED_REDIS.stop()
    stop_shared_if_started()


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_interpreter: runs only in a TRITON_INTERPRET=1 child process")
    config.addinivalue_line("markers", "triton_parent: starts the TRITON_INTERPRET=1 child process")


def pytest_collection_modifyitems(config, items):
    """Triton must be imported with TRITON_INTERPRET=1 already set, so its tests run in a child pytest.

    In the parent those tests are deselected (not skipped); in the child the parent-side launcher is deselected.
    """
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    keep, drop = [], []
    for item in items:
        child_only = item.get_closest_marker("triton_interpreter") is not None
        parent_only = item.get_closest_marker("triton_parent") is not None
        (drop if (child_only and not interpreted) or (parent_only and interpreted) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
