"""Deadlines that hold for a Redis store: a total deadline per store operation and a breaker after a failure.

Why: redis-py's socket timeouts bound one read, not an operation. An operation is several round trips (a get reads
manifests, then chunks, then sends its counters), and a retry after a timeout doubled each of them, so a stalled
Redis (`CLIENT PAUSE`) cost a request 5-12 s although the read timeout is 2 s.

Contract:
- `gated_redis(url, gate, ...)` is a `redis.Redis` whose every command and pipeline round trip goes through `gate`
  (`RedisGate.call`). Its connections retry once on a connection error (a stale pooled connection) and never on a
  timeout: a timed-out read is not repeated.
- `RedisGate.operation()` (a context manager, per thread) gives a store operation its deadline: `op_timeout_s`
  from its first round trip. A round trip is started only before the deadline (past it: `redis.TimeoutError`), and
  each lasts at most one socket read timeout, so an operation ends within `op_timeout_s` + one read timeout
  (2 × 2 s by default) however many round trips it has.
- The breaker: a round trip that times out (a read, or a connect to a host that drops packets) opens the gate for
  `backoff_s`; while it is open every round trip fails at once with `redis.TimeoutError`, without touching Redis, so
  the rest of that request, and every other request meanwhile, is a quick counted miss instead of another wait. A
  refused connection (Redis down, host up) costs no wait and opens nothing: the next call finds a restarted Redis
  at once. `stalled` says the gate is open (Redis not answering: every path to it is stuck, so a caller does not
  retry over another path).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
import redis.client
from redis.backoff import NoBackoff
from redis.retry import Retry

_STALLS = (redis.TimeoutError, TimeoutError)  # socket.timeout is TimeoutError


class RedisGate:
    """Per-operation deadlines and the failure breaker of one store's Redis client (see the module docstring)."""

    def __init__(self, op_timeout_s: float, backoff_s: float, clock: Callable[[], float] = time.monotonic):
        if op_timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"need op_timeout_s > 0 and backoff_s >= 0, got {op_timeout_s}, {backoff_s}")
        self.op_timeout_s = op_timeout_s
        self.backoff_s = backoff_s
        self._clock = clock  # monotonic seconds
        self._local = threading.local()  # .deadline: the current operation's (this thread's), or None
        self._open_until = 0.0

    @property
    def stalled(self) -> bool:
        """The gate is open (a round trip timed out less than `backoff_s` ago)."""
        return self._clock() < self._open_until

    @contextmanager
    def operation(self) -> Iterator[None]:
        """One store operation: its round trips share one deadline (nested operations keep the outer one)."""
        outer = getattr(self._local, "deadline", None)
        if outer is None:
            self._local.deadline = self._clock() + self.op_timeout_s
        try:
            yield
        finally:
            if outer is None:
                self._local.deadline = None

    def call(self, fn: Callable, *args):
        """fn(*args), one round trip, unless the gate is open or the operation's deadline has passed."""
        now = self._clock()
        if now < self._open_until:
            raise redis.TimeoutError(f"redis timed out {self.backoff_s:g} s ago or less; not asking it again yet")
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and now >= deadline:
            raise redis.TimeoutError(f"the operation's deadline ({self.op_timeout_s:g} s) passed")
        try:
            return fn(*args)
        except _STALLS:
            self._open_until = self._clock() + self.backoff_s
            raise


class _GatedPipeline(redis.client.Pipeline):
    gate: RedisGate

    def execute(self, raise_on_error: bool = True):
        return self.gate.call(super().execute, raise_on_error)


class _GatedRedis(redis.Redis):
    gate: RedisGate

    def execute_command(self, *args, **options):
        return self.gate.call(lambda: super(_GatedRedis, self).execute_command(*args, **options))

    def close(self) -> None:
        super().close()
        self.connection_pool.disconnect()

    def pipeline(self, transaction: bool = True, shard_hint=None) -> _GatedPipeline:
        pipe = _GatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.gate = self.gate
        return pipe


def gated_redis(url: str, gate: RedisGate, *, socket_timeout_s: float, connect_timeout_s: float,
                max_connections: int, socket_read_bytes: int) -> redis.Redis:
    """A client of `url` whose round trips go through `gate`; one retry on a connection error, none on a timeout."""
    client = _GatedRedis.from_url(
        url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)), retry_on_timeout=False,
        max_connections=max_connections, socket_read_size=socket_read_bytes)
    client.gate = gate
    return client
