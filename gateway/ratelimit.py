"""Per-tenant admission limits: requests per minute, tokens per minute and requests in flight.

Contract:
- `RateLimiter(limits, clock)` keeps state only for the tenants in `limits` (the tenant directory's tenants, so memory
  is bounded by the configuration, never by traffic); `acquire` for any other tenant raises `KeyError`.
- `acquire(tenant, prompt_tokens, max_tokens)` admits a request or raises `RateLimitExceeded(retry_after_seconds,
  limit_kind)` with `limit_kind` one of "rpm", "tpm", "concurrency". Admission is all-or-nothing: a rejected request
  consumes nothing. When several limits refuse, the error names the one with the longest wait (ties: concurrency, rpm,
  tpm), so retrying after `retry_after_seconds` is not refused again by a different time-based limit.
- rpm and tpm are token buckets holding one minute's budget (a burst of a full minute is allowed, then the budget
  refills continuously at limit/60 per second). A request reserves `prompt_tokens + max_tokens` tokens at admission,
  capped at one minute's budget so a request whose `max_tokens` defaults to the context length is still admitted
  when the bucket is full. `Lease.release(actual_tokens)` reconciles: unused reserved tokens go back to the bucket
  (never above its capacity), usage above the reservation is debited (the bucket may go negative, which delays later
  requests of that tenant until the debt is refilled).
- Concurrency is a plain counter; its `retry_after_seconds` is a hint (`CONCURRENCY_RETRY_AFTER_S`), since it ends
  when some request of the tenant finishes.
- `Lease.release` is idempotent (later calls do nothing), so it can sit in a `finally` next to other cleanup.
- Thread-safe (one short lock, no waiting) and so safe from asyncio code: nothing here ever blocks or sleeps.
- `clock` returns monotonic seconds (`time.monotonic` by default); tests inject a fake one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

CONCURRENCY_RETRY_AFTER_S = 1.0
LIMIT_KINDS = ("concurrency", "rpm", "tpm")  # also the tie order of `RateLimitExceeded.limit_kind`


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None means unlimited. Values are positive integers."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute: prompt + completion
    max_concurrency: int | None = None  # requests in flight

    def __post_init__(self):
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None (unlimited), got {value!r}")


class RateLimitExceeded(Exception):
    """A tenant is over a limit; the REST layer answers 429 with `Retry-After: retry_after_header()`."""

    def __init__(self, retry_after_seconds: float, limit_kind: str, tenant: str = "", limit: int = 0):
        self.retry_after_seconds = retry_after_seconds
        self.limit_kind = limit_kind
        self.tenant = tenant
        self.limit = limit
        super().__init__(f"tenant {tenant!r} is over its {_LIMIT_NAMES[limit_kind]} limit ({limit}); "
                         f"retry after {retry_after_seconds:.2f} s")

    def retry_after_header(self) -> str:
        """Whole seconds for the HTTP `Retry-After` header (rounded up, at least 1)."""
        return str(max(1, math.ceil(self.retry_after_seconds)))


_LIMIT_NAMES = {"rpm": "requests-per-minute", "tpm": "tokens-per-minute", "concurrency": "concurrent-requests"}


class _Bucket:
    """A token bucket of `capacity` refilled at `capacity / 60` per second; the level may go negative (debt)."""

    def __init__(self, capacity: int, now: float):
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.level = min(float(self.capacity), self.level + elapsed * self.rate)
        self.updated = max(self.updated, now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now); call `refill` first."""
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(float(self.capacity), self.level + amount)


class _TenantState:
    def __init__(self, limits: TenantLimits, now: float):
        self.limits = limits
        self.requests = _Bucket(limits.rpm, now) if limits.rpm else None
        self.tokens = _Bucket(limits.tpm, now) if limits.tpm else None
        self.active = 0


class Lease:
    """An admitted request; `release(actual_tokens)` once it ends (finished, failed or cancelled)."""

    def __init__(self, limiter: RateLimiter, tenant: str, reserved_tokens: int):
        self._limiter = limiter
        self.tenant = tenant
        self.reserved_tokens = reserved_tokens
        self.released = False

    def release(self, actual_tokens: int) -> None:
        """Frees the concurrency slot and reconciles the token reservation with `actual_tokens` (prompt + output)."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        self._limiter._release(self, actual_tokens)


class RateLimiter:
    def __init__(self, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._tenants = {tenant: _TenantState(lim, now) for tenant, lim in limits.items()}

    def acquire(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Lease:
        """Admits one request of `tenant` or raises `RateLimitExceeded`; see the module contract."""
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got prompt {prompt_tokens}, max_tokens {max_tokens}")
        with self._lock:
            state = self._tenants[tenant]
            reserve = _reservation(state, prompt_tokens + max_tokens)
            refusals = self._refusals(state, reserve)
            if refusals:
                wait, kind, limit = max(refusals, key=lambda r: (r[0], -LIMIT_KINDS.index(r[1])))
                raise RateLimitExceeded(wait, kind, tenant, limit)
            _admit(state, reserve)
        return Lease(self, tenant, reserve)

    def active(self, tenant: str) -> int:
        """Requests of `tenant` in flight."""
        with self._lock:
            return self._tenants[tenant].active

    def _refusals(self, state: _TenantState, reserve: int) -> list[tuple[float, str, int]]:
        """(seconds to wait, limit kind, limit) for every limit that refuses the request now."""
        now = self._clock()
        refusals = []
        lim = state.limits
        if lim.max_concurrency is not None and state.active >= lim.max_concurrency:
            refusals.append((CONCURRENCY_RETRY_AFTER_S, "concurrency", lim.max_concurrency))
        for kind, bucket, amount in (("rpm", state.requests, 1), ("tpm", state.tokens, reserve)):
            if bucket is None:
                continue
            bucket.refill(now)
            wait = bucket.wait_for(amount)
            if wait > 0:
                refusals.append((wait, kind, bucket.capacity))
        return refusals

    def _release(self, lease: Lease, actual_tokens: int) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            state = self._tenants[lease.tenant]
            state.active -= 1
            if state.tokens is not None:
                state.tokens.refill(self._clock())
                _reconcile(state.tokens, lease.reserved_tokens, actual_tokens)


def _reservation(state: _TenantState, requested: int) -> int:
    """Tokens reserved at admission: the request's worst case, capped at one minute's budget."""
    return min(requested, state.tokens.capacity) if state.tokens is not None else requested


def _admit(state: _TenantState, reserve: int) -> None:
    state.active += 1
    if state.requests is not None:
        state.requests.take(1)
    if state.tokens is not None:
        state.tokens.take(reserve)


def _reconcile(bucket: _Bucket, reserved: int, actual: int) -> None:
    if actual <= reserved:
        bucket.give_back(reserved - actual)
    else:
        bucket.take(actual - reserved)
