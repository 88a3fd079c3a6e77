"""Where a request's KDA state is snapshotted, at which retention priority, and where prompts branch (junctions).

A KDA state can only be resumed where a snapshot of it exists, so where snapshots are taken decides whether ordinary
workloads hit the prefix cache at all. Kinds of snapshot points, by retention priority (`SnapshotPriority`):
- HINT: structure hints from the caller (token positions where the rendered chat's system/tool block and each earlier
  message end, rounded down to whole blocks) and junctions (where a prompt's block chain leaves the cached or
  in-flight prefix it shares with other prompts);
- TURN: the prompt-end boundaries `floor(P/bs)*bs` and `floor((P-1)/bs)*bs`, and the turn end — the last full block
  boundary a request's prompt + output reached (a rolling snapshot, refreshed each time decode crosses a block
  boundary in the output, the previous one dropped: one state copy per `block_size` decoded tokens);
- PERIODIC: every multiple of `snapshot_interval`.

Contract:
- `SnapshotPolicy(block_size, interval, mode)`: mode `"hybrid"` (all kinds, the default) or `"periodic"` (prompt ends
  and periodic points only: the behaviour before hints, junctions and turn ends existed).
- `hint_points(hints, num_prompt_tokens, block_size)` -> `{position: HINT}` for a request's structure hints: each an
  int in `[0, num_prompt_tokens]` (else `InvalidRequestError`), rounded down to a block boundary, 0 dropped; at most
  `MAX_SNAPSHOT_HINTS` kept (the first, which is the system/tool block, and the last ones).
- `policy.candidates(req, computed, end)`: the snapshot points in `(computed, end)` a prefill chunk may not cross,
  ascending. `policy.point(req, p)` -> `(priority, rolling)` when the state after `p` computed tokens is snapshotted
  (`rolling`: only as the request's turn end), else None.
- `plan_junction(req, hit_blocks, cached_blocks, running, block_size)` -> `Junction` or None (see its docstring).
Pure functions of requests; nothing here touches a pool, and importing it imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.memory.state_pool import SnapshotPriority

if TYPE_CHECKING:  # torch-free at runtime: engine.config imports this module
    from engine.request import Request

SNAPSHOT_POLICIES = ("hybrid", "periodic")
MAX_SNAPSHOT_HINTS = 16


def hint_points(hints: Iterable[int], num_prompt_tokens: int, block_size: int) -> dict[int, SnapshotPriority]:
    """Validated structure hints, rounded down to blocks (see the module docstring)."""
    positions = set()
    for hint in hints:
        if isinstance(hint, bool) or not isinstance(hint, int) or not 0 <= hint <= num_prompt_tokens:
            raise InvalidRequestError(f"snapshot hints are token positions in [0, {num_prompt_tokens}] (the prompt), "
                                      f"got {hint!r}", param="snapshot_hints")
        if hint >= block_size:
            positions.add(hint // block_size * block_size)
    kept = sorted(positions)
    if len(kept) > MAX_SNAPSHOT_HINTS:
        kept = kept[:1] + kept[1 - MAX_SNAPSHOT_HINTS:]
    return {p: SnapshotPriority.HINT for p in kept}


@dataclass(frozen=True)
class SnapshotPolicy:
    block_size: int
    interval: int  # tokens, a multiple of block_size; 0: prefix caching off
    mode: str = "hybrid"

    @property
    def hybrid(self) -> bool:
        return self.mode == "hybrid"

    def prompt_ends(self, req: Request) -> set[int]:
        p, bs = req.num_prompt_tokens, self.block_size
        return {b for b in (p // bs * bs, (p - 1) // bs * bs) if b > 0}

    def candidates(self, req: Request, computed: int, end: int) -> list[int]:
        """Snapshot points strictly between `computed` and `end` (prompt ends, hints and junctions, periodic)."""
        points = self.prompt_ends(req)
        if self.hybrid:
            points.update(req.snapshot_points)
        found = {b for b in points if computed < b < end}
        found.update(range((computed // self.interval + 1) * self.interval, end, self.interval))
        return sorted(found)

    def point(self, req: Request, p: int) -> tuple[SnapshotPriority, bool] | None:
        """(priority, rolling) of the snapshot after `p` computed tokens of `req`, or None (no snapshot there)."""
        if p <= 0 or p % self.block_size:
            return None
        found = []
        if p % self.interval == 0:
            found.append(SnapshotPriority.PERIODIC)
        if p in self.prompt_ends(req):
            found.append(SnapshotPriority.TURN)
        if self.hybrid and p in req.snapshot_points:
            found.append(req.snapshot_points[p])
        if found:
            return max(found), False
        if self.hybrid and p > req.num_prompt_tokens // self.block_size * self.block_size:
            return SnapshotPriority.TURN, True  # a block boundary in the output: the turn end so far
        return None


@dataclass(frozen=True)
class Junction:
    position: int  # tokens, a block boundary where `req` is snapshotted (`producer` None) or `producer` is
    producer: Request | None = None  # a running request that computes the shared prefix first; `req` waits for it


def plan_junction(req: Request, hit_blocks: int, cached_blocks: int, running: Sequence[Request],
                  block_size: int) -> Junction | None:
    """Where a waiting request's block chain leaves the prefix it shares with others, past its prefix hit
    (`hit_blocks`, resumable) and the cached blocks it matches (`cached_blocks`, leading, with or without a snapshot):
    - in flight: a running request is about to compute the next blocks of the same chain; it gets a snapshot point
      where the two chains part (at most where `req` still has a token to compute), and `req` waits for it;
    - else, when the cached blocks reach past the hit: `req` itself is snapshotted where its chain leaves them, so
      every later request on that branch hits (the second request computes the shared part, the third reuses it).
    None when neither applies."""
    hashes, bs = req.block_hashes, block_size
    m = cached_blocks
    if m < len(hashes):
        for other in running:
            theirs = other.block_hashes
            if other is req or len(theirs) <= m or theirs[m] != hashes[m] or other.num_computed_tokens >= (m + 1) * bs:
                continue
            end = m + 1
            while end < min(len(hashes), len(theirs)) and theirs[end] == hashes[end]:
                end += 1
            usable = min(end, (req.num_tokens - 1) // bs)
            if usable > m:
                return Junction(usable * bs, other)
    if cached_blocks > hit_blocks:
        return Junction(cached_blocks * bs)
    return None
