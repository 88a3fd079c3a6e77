"""A clock tests advance by hand: pass it where a component takes `clock` (monotonic seconds), then `advance` it
instead of sleeping (the cache stores' TTLs, leases and holds; the cache service's handoff TTL)."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
