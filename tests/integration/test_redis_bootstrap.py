"""The suite starts the Redis it needs (tests/redis_server.py, tests/redis_cluster.py): on a port where nothing runs,
`SharedRedis.ensure()` starts a server that answers and `stop()` ends it; where one already runs it is reused and
left alone; a remote URL that does not answer is a failed test, never a server started elsewhere."""

from __future__ import annotations

import pytest

from tests.integration.conftest import free_port
from tests.redis_server import SharedRedis, answers


def test_starts_a_redis_where_none_runs_and_stops_it():
    port = free_port()
    assert not answers("127.0.0.1", port)  # the control: nothing there before
    server = SharedRedis(f"redis://127.0.0.1:{port}/15")
    server.ensure()
    try:
        assert answers("127.0.0.1", port) and server.proc is not None
    finally:
        server.stop()
    assert not answers("127.0.0.1", port)


def test_reuses_a_running_redis_and_leaves_it_running():
    owner = SharedRedis(f"redis://127.0.0.1:{free_port()}/15")
    owner.ensure()
    try:
        guest = SharedRedis(owner.url)
        guest.ensure()
        assert guest.proc is None  # nothing started
        guest.stop()
        assert answers(owner.host, owner.port)
    finally:
        owner.stop()


def test_a_remote_url_that_does_not_answer_fails():
    server = SharedRedis("redis://192.0.2.1:6379/15")  # TEST-NET-1: nothing answers
    with pytest.raises(pytest.fail.Exception, match="no Redis answers"):
        server.ensure()
    assert server.proc is None
