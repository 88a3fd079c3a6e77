"""The encoder cache: image features by content hash, within a byte budget.

Contract:
- `EncoderCache(budget_bytes)` maps an image's content hash (sha256 of its bytes, 32 bytes) to its encoder rows
  `[rows, E]` (the `VisionEncoder` output for that image alone, on the encoder's device).
- `get(hash)` returns the rows or None and marks the entry most recently used; `put(hash, rows)` stores them and
  then evicts least-recently-used entries until the total is within the budget (an entry larger than the whole
  budget is not kept); `clear()` drops everything. `hits` / `misses` count `get` results. Not thread-safe: the engine's step thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_BUDGET_BYTES = 256 << 20


def _nbytes(rows: torch.Tensor) -> int:
    return rows.numel() * rows.element_size()


class EncoderCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if budget_bytes < 0:
            raise ValueError(f"encoder cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        rows = self._entries.get(key)
        if rows is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        """rows [n, E]."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= _nbytes(old)
        self._entries[key] = rows
        self.used_bytes += _nbytes(rows)
        while self.used_bytes > self.budget_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= _nbytes(evicted)
