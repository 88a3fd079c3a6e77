"""Fair share of the engine's running slots and KV block pool between tenants (the scheduler applies it).

Contract:
- A request's tenant is `Request.tenant`: the name the gateway sends (`TenantShare`, given to
  `EngineCore.add_request` / `import_request`; `tenant_label(name, cache_salt)`: a request without a name falls back
  to a hash of its cache salt, never the salt itself), with a weight (`Request.tenant_weight`, finite and > 0,
  default 1, else `InvalidRequestError`; the latest request of a tenant sets it).
- A tenant's **usage** is its dominant share over its weight (Dominant Resource Fairness): `max(running requests /
  running slots, KV blocks its running requests hold / KV blocks) / weight`. A running request holds one KDA slot
  group, so the request count is also the tenant's share of the state pool.
- **Victim order** (`victim_key`), the one order in which the engine takes room back: lowest priority first (the
  largest priority value), then the tenant of the largest usage, then the newest request. With one tenant it is
  the plain `(priority, arrival)` order of pool-pressure preemption.
- **Fair preemption** (`fair_victim`): a waiting request of tenant B that does not fit (no free running slot, or
  the pools cannot take it) may take the room of a running request of another tenant A, when B's usage after its
  admission would be strictly below A's usage now and the victim's priority is not higher than the waiting one's;
  among those the victim order picks. The strict inequality is the hysteresis: once the move is made A's next
  request could only move back if A's usage after it were below B's, the reverse inequality, so an imbalance is
  never corrected twice and no request is re-admitted only to be preempted again. A tenant alone never preempts
  itself for fairness (the whole engine is its own), and a tenant at or under its share is never a victim.
- `could_move(waiting_tenants, running)`: whether some waiting tenant could take room from another (`fair_victim`'s
  condition without priorities and the waiter's blocks, so never False where `fair_victim` finds one); cheap, for
  the scheduler's every-step look for a move.
- `tenant_loads(running, waiting, weights)`: each tenant's running and waiting counts and weight, for the per-tenant
  gauges.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.request import Request

DEFAULT_TENANT = "#default"  # the label of requests with neither a tenant name nor a cache salt


@dataclass(frozen=True)
class TenantShare:
    """Whom a request runs for in the fair share: the tenant's `name` (None: its cache salt decides) and `weight`."""

    name: str | None = None
    weight: float = 1.0

    def __post_init__(self):
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise InvalidRequestError(f"the tenant weight must be a positive finite number, got {w!r}",
                                      param="tenant_weight")


def tenant_label(name: str | None, cache_salt: str | None) -> str:
    """A request's tenant: its given name, else `#` + 16 hex digits of the salt's SHA-256 (no tenant name the gateway
    accepts starts with `#`, so the two never collide), else `DEFAULT_TENANT`."""
    if name:
        return name
    if cache_salt:
        return "#" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]
    return DEFAULT_TENANT


@dataclass(frozen=True)
class TenantLoad:
    tenant: str
    running: int
    waiting: int
    weight: float = 1.0


class FairShare:
    """Tenant weights and usage over one engine's pools (`num_slots` running slots, `num_blocks` KV blocks)."""

    def __init__(self, num_slots: int, num_blocks: int):
        self.num_slots = num_slots
        self.num_blocks = max(num_blocks, 1)
        self.weights: dict[str | None, float] = {}

    def note(self, req: Request) -> None:
        self.weights[req.tenant] = req.tenant_weight

    def forget(self, active: set[str | None]) -> None:
        self.weights = {t: w for t, w in self.weights.items() if t in active}

    def usage(self, tenant: str | None, slots: int, blocks: int) -> float:
        share = max(slots / self.num_slots, blocks / self.num_blocks)
        return share / self.weights.get(tenant, 1.0)

    def holdings(self, running: Iterable[Request]) -> dict[str | None, tuple[int, int]]:
        """tenant -> (running requests, KV blocks they hold)."""
        held: dict[str | None, tuple[int, int]] = {}
        for r in running:
            slots, blocks = held.get(r.tenant, (0, 0))
            held[r.tenant] = (slots + 1, blocks + len(r.block_ids))
        return held

    def usages(self, running: Sequence[Request]) -> dict[str | None, float]:
        return {t: self.usage(t, s, b) for t, (s, b) in self.holdings(running).items()}

    def victim_key(self, usages: dict[str | None, float]):
        """The victim order: the max of this key over the candidates goes first."""
        return lambda r: (r.priority, usages.get(r.tenant, 0.0), r.arrival)

    def pressure_victim(self, running: Sequence[Request]) -> Request:
        """A running request to preempt because the pools ran out (any tenant, the requester's own included)."""
        return max(running, key=self.victim_key(self.usages(running)))

    def fair_victim(self, waiter: Request, running: Sequence[Request], extra_blocks: int) -> Request | None:
        """A running request whose room `waiter` (which would hold `extra_blocks` blocks once admitted) may take by
        fair share, or None: see the module contract."""
        held = self.holdings(running)
        slots, blocks = held.get(waiter.tenant, (0, 0))
        after = self.usage(waiter.tenant, slots + 1, blocks + extra_blocks)
        usages = {t: self.usage(t, s, b) for t, (s, b) in held.items()}
        candidates = [r for r in running if r.tenant != waiter.tenant and r.priority >= waiter.priority
                      and usages[r.tenant] > after]
        return max(candidates, key=self.victim_key(usages)) if candidates else None

    def could_move(self, waiting_tenants: Iterable[str | None], running: Sequence[Request]) -> bool:
        """Whether a tenant of `waiting_tenants` could take room from another by fair share: the necessary condition
        of `fair_victim` without priorities and the waiter's blocks, at the cost of the holdings (the scheduler asks
        it every step before anything dearer)."""
        held = self.holdings(running)
        usages = {t: self.usage(t, s, b) for t, (s, b) in held.items()}
        for tenant in waiting_tenants:
            slots, blocks = held.get(tenant, (0, 0))
            after = self.usage(tenant, slots + 1, blocks)
            if any(u > after for other, u in usages.items() if other != tenant):
                return True
        return False

    def admission_rank(self, running: Sequence[Request]):
        """-> rank(tenant, k): the usage tenant `tenant` would have with k more running requests (and the blocks it
        holds now), by which the waiting queue's tenants are ordered (the least used first)."""
        held = self.holdings(running)

        def rank(tenant: str | None, k: int) -> float:
            slots, blocks = held.get(tenant, (0, 0))
            return self.usage(tenant, slots + k, blocks)
        return rank


def tenant_loads(running: Iterable[Request], waiting: Iterable[Request],
                 weights: dict[str | None, float]) -> tuple[TenantLoad, ...]:
    counts: dict[str | None, list[int]] = {}
    for i, queue in enumerate((running, waiting)):
        for r in queue:
            counts.setdefault(r.tenant, [0, 0])[i] += 1
    return tuple(sorted((TenantLoad(t or DEFAULT_TENANT, n_run, n_wait, weights.get(t, 1.0))
                         for t, (n_run, n_wait) in counts.items()), key=lambda load: load.tenant))
