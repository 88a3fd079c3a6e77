"""Per-tenant rate limits with a fake clock: rpm, tpm (reserve then reconcile), concurrency, retry-after values."""

from __future__ import annotations

import threading

import pytest

from gateway.ratelimit import CONCURRENCY_RETRY_AFTER_S, RateLimiter, RateLimitExceeded, TenantLimits


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(clock: FakeClock, **limits) -> RateLimiter:
    return RateLimiter({"t": TenantLimits(**limits), "other": TenantLimits(**limits)}, clock=clock)


def refused(rl: RateLimiter, prompt: int = 0, max_tokens: int = 0, tenant: str = "t") -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as e:
        rl.acquire(tenant, prompt, max_tokens)
    return e.value


def test_rpm_burst_then_refill():
    clock = FakeClock()
    rl = limiter(clock, rpm=60)  # 1 request per second after a burst of 60
    for _ in range(60):
        rl.acquire("t", 10, 10).release(20)
    err = refused(rl)
    assert err.limit_kind == "rpm" and err.retry_after_seconds == pytest.approx(1.0)
    assert err.retry_after_header() == "1"
    clock.advance(0.25)
    assert refused(rl).retry_after_seconds == pytest.approx(0.75)
    clock.advance(0.75)
    rl.acquire("t", 0, 0)
    assert refused(rl).retry_after_seconds == pytest.approx(1.0)
    rl.acquire("other", 0, 0)  # tenants are independent


def test_tpm_reserves_prompt_plus_max_tokens():
    clock = FakeClock()
    rl = limiter(clock, tpm=600)  # 10 tokens per second
    lease = rl.acquire("t", 100, 400)
    assert lease.reserved_tokens == 500
    err = refused(rl, 50, 100)  # 150 needed, 100 left: 50 tokens = 5 s
    assert err.limit_kind == "tpm" and err.retry_after_seconds == pytest.approx(5.0)
    assert err.retry_after_header() == "5"
    rl.acquire("t", 50, 50)  # 100 fits exactly


def test_tpm_reconciles_unused_reservation():
    clock = FakeClock()
    rl = limiter(clock, tpm=600)
    lease = rl.acquire("t", 100, 400)  # 500 reserved, 100 left
    lease.release(150)  # 350 given back → 450 left
    rl.acquire("t", 400, 50)
    assert refused(rl, 1, 0).retry_after_seconds == pytest.approx(0.1)


def test_tpm_debits_usage_above_reservation():
    clock = FakeClock()
    rl = limiter(clock, tpm=600)
    rl.acquire("t", 100, 100).release(800)  # used 800 of a 600 budget: 200 in debt
    err = refused(rl, 10, 0)  # needs 210 tokens of refill = 21 s
    assert err.retry_after_seconds == pytest.approx(21.0)
    clock.advance(21.0)
    rl.acquire("t", 10, 0)


def test_refund_never_exceeds_capacity():
    clock = FakeClock()
    rl = limiter(clock, tpm=600)
    lease = rl.acquire("t", 0, 300)
    clock.advance(60)  # refilled to the cap meanwhile
    lease.release(0)
    rl.acquire("t", 600, 0)
    assert refused(rl, 1, 0).retry_after_seconds == pytest.approx(0.1)


def test_huge_max_tokens_is_capped_at_one_minute():
    clock = FakeClock()
    rl = limiter(clock, tpm=600)
    lease = rl.acquire("t", 10, 128_000)  # default max_tokens = context length
    assert lease.reserved_tokens == 600
    assert refused(rl, 10, 0).retry_after_seconds == pytest.approx(1.0)
    lease.release(30)
    rl.acquire("t", 500, 0)


def test_concurrency():
    clock = FakeClock()
    rl = limiter(clock, max_concurrency=2)
    first, second = rl.acquire("t", 1, 1), rl.acquire("t", 1, 1)
    assert rl.active("t") == 2
    err = refused(rl)
    assert err.limit_kind == "concurrency" and err.retry_after_seconds == CONCURRENCY_RETRY_AFTER_S
    first.release(2)
    first.release(2)  # idempotent: does not free a second slot
    assert rl.active("t") == 1
    third = rl.acquire("t", 1, 1)
    assert refused(rl).limit_kind == "concurrency"
    second.release(2)
    third.release(2)
    assert rl.active("t") == 0


def test_refusal_consumes_nothing():
    clock = FakeClock()
    rl = limiter(clock, rpm=2, tpm=600, max_concurrency=1)
    held = rl.acquire("t", 100, 0)
    for _ in range(5):
        assert refused(rl).limit_kind == "concurrency"
    held.release(100)
    rl.acquire("t", 100, 0).release(100)  # rpm bucket still had 1 left, tpm 400 left
    err = refused(rl, 100, 0)
    assert err.limit_kind == "rpm" and err.retry_after_seconds == pytest.approx(30.0)


def test_longest_wait_is_reported():
    clock = FakeClock()
    rl = limiter(clock, rpm=60, tpm=600, max_concurrency=1)
    rl.acquire("t", 600, 0)  # empties tpm (60 s to refill) and holds the only slot
    err = refused(rl, 600, 0)
    assert err.limit_kind == "tpm" and err.retry_after_seconds == pytest.approx(60.0)
    assert "tokens-per-minute limit (600)" in str(err)


def test_unlimited_and_unknown_tenants():
    rl = RateLimiter({"free": TenantLimits()}, clock=FakeClock())
    leases = [rl.acquire("free", 10**6, 10**6) for _ in range(1000)]
    assert rl.active("free") == 1000
    for lease in leases:
        lease.release(5)
    with pytest.raises(KeyError):
        rl.acquire("stranger", 1, 1)


def test_invalid_arguments():
    rl = limiter(FakeClock(), tpm=10)
    with pytest.raises(ValueError):
        rl.acquire("t", -1, 0)
    with pytest.raises(ValueError):
        rl.acquire("t", 0, 0).release(-1)
    with pytest.raises(ValueError):
        TenantLimits(rpm=0)


def test_thread_safety_of_concurrency_limit():
    rl = limiter(FakeClock(), max_concurrency=5)
    admitted = []
    barrier = threading.Barrier(16)

    def worker():
        barrier.wait()
        try:
            admitted.append(rl.acquire("t", 0, 0))
        except RateLimitExceeded:
            pass

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5 and rl.active("t") == 5
