"""The memory store's holds: leases, locate pins and reservations, each under a random id until it is released or
its deadline passes.

Contract:
- `add(kind, items, expires_at)` starts a hold and returns its id; `end(id)` and `end_due(now)` end holds and return
  them, so the store can let go of what they held (a pin's readers, a reservation's extents). An id ends once.
- A LEASE's items are store keys: each counts as `leased` until the last lease holding it ends.
- Not thread-safe: the store calls it under its own lock. Deadlines are the store's `clock()` seconds.
"""

from __future__ import annotations

import heapq
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

LEASE, PIN, RESERVATION = "lease", "pin", "reservation"


@dataclass(frozen=True)
class Hold:
    kind: str  # LEASE (items: store keys), PIN (items: index entries being read), RESERVATION (items: reserved objects)
    items: tuple
    expires_at: float


class Holds:
    def __init__(self):
        self._active: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str]] = []  # (expires_at, id); ids ended early are skipped
        self._leased: Counter[bytes] = Counter()  # key -> number of active leases holding it

    def add(self, kind: str, items: Iterable, expires_at: float) -> str:
        hold_id = uuid.uuid4().hex
        hold = Hold(kind, tuple(items), expires_at)
        self._active[hold_id] = hold
        heapq.heappush(self._deadlines, (expires_at, hold_id))
        if kind == LEASE:
            self._leased.update(hold.items)
        return hold_id

    def get(self, hold_id: str, kind: str) -> Hold | None:
        """The active hold of that kind under `hold_id`, or None."""
        hold = self._active.get(hold_id)
        return hold if hold is not None and hold.kind == kind else None

    def end(self, hold_id: str) -> Hold | None:
        """Ends a hold -> the hold, or None when no hold is active under that id."""
        hold = self._active.pop(hold_id, None)
        if hold is not None and hold.kind == LEASE:
            self._leased.subtract(hold.items)
            for key in hold.items:
                if self._leased[key] <= 0:
                    del self._leased[key]
        return hold

    def end_due(self, now: float) -> list[Hold]:
        """Ends every hold whose deadline is at or before `now` -> those holds."""
        ended = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, hold_id = heapq.heappop(self._deadlines)
            hold = self.end(hold_id)
            if hold is not None:
                ended.append(hold)
        return ended

    def leased(self, key: bytes) -> bool:
        return self._leased[key] > 0

    def leased_keys(self) -> Iterable[bytes]:
        return self._leased.keys()

    def count(self, kind: str) -> int:
        return sum(1 for hold in self._active.values() if hold.kind == kind)
