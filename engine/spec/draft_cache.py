"""Preallocated per-request row buffers of the model drafters (`mtp`, `dspark`): no tensor grows per step.

Contract:
- `SlotRows(row_shape, dtype, device, num_slots, capacity, side_shape)`: one zero-filled buffer
  `[num_slots, capacity, *row_shape]` and, with `side_shape`, a fixed-size one `side` `[num_slots, *side_shape]`
  beside it (per-slot data that does not grow with the sequence: MTP's ring of recent hidden rows); a request holds
  one slot (`acquire(req_id)` → slot index, `release(req_id)` frees it for the next request). Row i
  of a slot is whatever the drafter stores at index i (its caller maps positions to indices). `reserve(length)`
  makes every slot hold at least `length` rows; both the slot count and the capacity grow by doubling (a new
  buffer, the old rows copied once), so a long generation reallocates O(log length) times, never per step, and
  the buffer's `data_ptr` is stable between doublings. Freed slots keep their stale rows (finite values: the
  buffer starts zeroed), which readers mask out by length. Memory is slots × the longest request's rows (rounded
  up to a power of two): one drafter layer's latent per token, a fraction of the target's MLA cache — but not
  proportional to the tokens actually held, as a paged pool with block tables would be (the next step if long
  and short requests mix at scale).
- `write(slots, index, rows)`: one indexed store of `rows` `[n, *row_shape]` at `(slots[i], index[i])` (index
  tensors on the buffer's device). `gather(slots, length)`: `[B, length, *row_shape]`, rows `0 .. length - 1` of
  each slot in `slots` (a copy; rows past a slot's own length are stale and must be masked by the reader).
- Bookkeeping (slot map, sizes) is host-side Python; nothing here reads a device value back.
- `SlotDrafter` is what the model drafters share on top of it: `requests` (host bookkeeping per request),
  `queued` (rows an `observe` asked for, computed by the subclass's `flush` in one batched pass), and `propose`:
  flush, keep the queries the subclass `_can_draft`, run its `_draft(queries, steps)` once for all of them (draft
  ids `[B, steps]`, probabilities `[B, steps, V]` or None) and read the ids back with one `tolist()`; each query
  keeps its first `min(num_tokens, k)` drafts. `release` frees the request's slot and queued rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence

import torch

from engine.spec.drafter import Draft, Drafter, DraftQuery

# A request's consecutive observes queue together (one batched pass computes them) until the next `propose`,
# inspection or rollback, or until this many positions wait: while a batch-size schedule turns speculation off
# (k = 0) nothing proposes, and the rows of up to this many steps go through the drafter's layers in one pass.
QUEUE_ROWS = 64


class SlotRows:
    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 num_slots: int = 4, capacity: int = 256, side_shape: tuple[int, ...] = (0,)):
        self.row_shape = tuple(row_shape)
        self.buffer = torch.zeros(max(1, num_slots), max(1, capacity), *self.row_shape, dtype=dtype, device=device)
        self.side = torch.zeros(self.num_slots, *side_shape, dtype=dtype, device=device)
        self.slot_of: dict[str, int] = {}
        self.free = list(range(self.num_slots - 1, -1, -1))  # popped from the end: lowest slot first
        self.reallocations = 0

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def capacity(self) -> int:
        return self.buffer.shape[1]

    def acquire(self, req_id: str) -> int:
        """The request's slot (a free one on first use)."""
        slot = self.slot_of.get(req_id)
        if slot is None:
            if not self.free:
                self._grow(2 * self.num_slots, self.capacity)
            slot = self.slot_of[req_id] = self.free.pop()
        return slot

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def reserve(self, length: int) -> None:
        """Room for `length` rows in every slot (capacity doubled until it fits)."""
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        if capacity != self.capacity:
            self._grow(self.num_slots, capacity)

    def write(self, slots: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        """slots [n], index [n] (int64), rows [n, *row_shape]."""
        self.buffer.index_put_((slots, index), rows.to(self.buffer.dtype))

    def gather(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """slots [B] -> [B, length, *row_shape] (a copy)."""
        return self.buffer[:, :length].index_select(0, slots)

    def _grow(self, num_slots: int, capacity: int) -> None:
        old = self.buffer
        self.buffer = old.new_zeros(num_slots, capacity, *self.row_shape)
        self.buffer[: old.shape[0], : old.shape[1]] = old
        if num_slots != self.side.shape[0]:
            side = self.side
            self.side = side.new_zeros(num_slots, *side.shape[1:])
            self.side[: side.shape[0]] = side
        self.free = list(range(num_slots - 1, old.shape[0] - 1, -1)) + self.free
        self.reallocations += 1


class SlotDrafter(Drafter):
    k: int
    cache: SlotRows
    requests: dict
    queued: dict

    @property
    def device(self) -> torch.device:
        return self.cache.buffer.device

    def ids(self, values: Iterable[int]) -> torch.Tensor:
        """Host integers -> an int64 tensor on the drafter's device (an upload, never a read-back)."""
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    @abstractmethod
    def flush(self) -> None:
        """Computes every queued row in one batched pass."""

    @abstractmethod
    def _can_draft(self, query: DraftQuery) -> bool:
        """Whether the request's state lets it draft after `query.token_ids` (host bookkeeping only)."""

    @abstractmethod
    def _draft(self, queries: list[DraftQuery], steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft ids [B, steps] and, when sampled, their probabilities [B, steps, V] (on the device)."""

    @torch.inference_mode()
    def propose(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        self.flush()
        rows = [(i, q) for i, q in enumerate(queries) if self._can_draft(q)]
        drafts = [Draft(tokens=())] * len(queries)
        if not rows:
            return drafts
        num = [min(q.num_tokens, self.k) for _, q in rows]
        tokens, probs = self._draft([q for _, q in rows], max(num))
        for b, ((i, _), n, picked) in enumerate(zip(rows, num, tokens.tolist())):
            drafts[i] = Draft(tokens=tuple(picked[:n]), probs=None if probs is None else probs[b, :n])
        return drafts

    def release(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.queued.pop(req_id, None)
        self.cache.release(req_id)
