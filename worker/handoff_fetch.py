"""The decode side of a handoff: read it from the cache service and bring it into the engine, block group by group.

Contract (`HandoffFetcher(cache, engine, group_bytes, part_wait_s, counters, claim)`; `hashes`: the prompt's
full-block hashes, which the caller computes; `check(state)` raises `Unusable` for a handoff of another prompt;
`claim(keys)` removes objects). Two phases, so the caller can act between them (the decode worker streams the first
token there): `await open(key, hashes, check, span, deadline) -> Opened` (steps 1-3: `Opened.state` is the head,
checked) and `await finish(opened) -> Loaded` (step 4); `await load(...)` is both. Every handoff object is claimed
once read or given up: the handoff key and head pieces by `open` as soon as they are read, a streamed handoff's
block parts by `finish` at its end, or by `release(opened)` when `finish` is never reached (idempotent; the caller
calls it in a `finally`), or by `open` itself when it fails after the manifest.
1. The blocks to read: when the engine has room for every block of the prompt now, it is asked which of them its
   prefix cache holds (`AsyncEngine.prefix_presence`, a command on the step thread) and only the others are read
   from the cache service — a second turn of a conversation or a shared system prompt reads only the missing
   tail; the held ones reach the request through a lean import (4.). Without room, every block is read.
2. One BatchGet reads the handoff's key together with the first group of the blocks to read. A manifest there
   (worker/handoff_parts.py) makes it a streamed handoff: its head pieces are read (stored with the manifest, so
   one missing is `missing_part`) and checked piece by piece (sha256 in parallel); the handoff's own objects are
   then claimed. Without a manifest the object is the handoff itself.
3. The head (a lean `RequestState`, or a whole one) is parsed and checked (`check`, `check_request_state`, its
   full blocks against the prompt's and the manifest's count). A whole head leaves nothing for `finish` to read.
4. The full blocks to read (content-addressed, or the handoff's block parts) are read in groups of about
   `group_bytes`: group k+1 is fetched while group k is checked (`transfer.check_block` per block, on
   worker/hash_pool.py's threads) and used. When some blocks were held by the engine (1.), or with more than one
   group and room for every block in the engine now, each group is written into the engine's pools as it arrives
   (`AsyncEngine.import_blocks`: a command on the step thread, the engine's import rule) and `Loaded.lean` is set:
   the state is imported lean and all its full blocks come from the engine's prefix cache
   (`EngineCore.import_request(..., lean=True)`). Otherwise the groups are collected and the state made whole.
   A block that leaves the prefix cache before the lean request is admitted (evicted for another request's
   blocks, or for a later group of this one) makes the engine compute the request from its tokens
   (`Scheduler.num_import_recomputes`): the same output, never a refetch.
- Waits: in a streamed handoff the prefill worker is still publishing the blocks, so a block (or block part) not
  there yet is asked for again (5 ms, doubling to 20 ms) until `part_wait_s` after that group's wait began, or the
  request's deadline; then the handoff is unusable (`late_part`). A whole handoff's blocks were all stored before
  the prefill answered: one missing is `missing_block` at once.
- Failures raise `Unusable(reason, detail)`: the handoff's status (`missing`, `corrupt`, `error`, ...),
  `missing_part`, `late_part`, `missing_block`, `corrupt`, `mismatch`, `no_room` (the engine's pool could not take
  a group); the caller recomputes (or fails, by its policy). Blocks already imported stay in the prefix cache, so
  after a failure in `finish` the opened head, imported lean, is computed from its tokens from the longest prefix
  the engine's cache can resume (`Scheduler.num_import_recomputes`): the same output as the handoff's.
- Counters (`FetchCounters`): bytes and seconds of every read, parts read, groups imported ahead of a lean import,
  full blocks not read because the engine held them, time spent waiting for parts not stored yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import torch

from cache_service.client import CacheClient, GetResult
from cache_service.objects import Status, object_key
from engine.async_engine import AsyncEngine
from engine.transfer import (CorruptObjectError, MissingBlockError, ModelMismatchError, RequestState,
                             ShapeMismatchError, TransferError, check_block, check_request_state)
from protos import common_pb2
from telemetry import tracing
from worker.handoff_parts import Manifest, PartsError, block_part_keys, head_keys, join_head, read_manifest
from worker.hash_pool import parallel_map

KV_BLOCK = common_pb2.OBJECT_KIND_KV_BLOCK
FIRST_PAUSE_S, MAX_PAUSE_S = 0.005, 0.02
# why a handoff the engine's checks refused is unusable, by the class of the error (first match)
_REFUSALS = ((MissingBlockError, "missing_block"), (ModelMismatchError, "mismatch"), (ShapeMismatchError, "mismatch"),
             (CorruptObjectError, "corrupt"), (TransferError, "corrupt"))


class Unusable(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class FetchCounters:
    handoff_bytes: int = 0  # handoff objects and blocks fetched from the cache service
    handoff_seconds: float = 0.0  # wall time of those fetches
    handoff_parts: int = 0  # head pieces and block parts of streamed handoffs read (worker/handoff_parts.py)
    handoff_groups: int = 0  # block groups written into the engine ahead of a lean import (the next one on its way)
    handoff_local_blocks: int = 0  # full blocks of loaded handoffs not read: the engine's prefix cache held them
    handoff_wait_seconds: float = 0.0  # of `handoff_seconds`' span, asleep waiting for parts not stored yet


@dataclass(frozen=True)
class Loaded:
    state: RequestState
    lean: bool  # the full blocks are in the engine's prefix cache; import with `lean=True`


@dataclass
class _Handoff:
    """One handoff being read: where its blocks are and whether they may still be on their way."""

    key: common_pb2.ObjectKey
    hashes: list[bytes]
    to_read: list[int]  # the full blocks read from the cache service, in order (the engine holds the others)
    span: object
    deadline: float | None
    manifest: Manifest | None = None
    nbytes: int = 0  # read so far
    blocks_claimed: bool = False  # a streamed handoff's block parts removed (`HandoffFetcher.release`)

    @property
    def streams_blocks(self) -> bool:
        """The blocks are the handoff's own parts (published as the prefill went), not content-addressed ones."""
        return self.manifest is not None and bool(self.manifest.block_parts)

    def block_keys(self, blocks: Sequence[int]) -> list[common_pb2.ObjectKey]:
        if self.streams_blocks:
            return block_part_keys(self.key, len(self.manifest.head), blocks)
        k = self.key
        return [object_key(k.model_fingerprint, k.tenant_salt, KV_BLOCK, self.hashes[i]) for i in blocks]


@dataclass
class Opened:
    """A handoff whose head is read and checked (`HandoffFetcher.open`); `finish` reads its blocks."""

    state: RequestState | None  # the head: a whole state, or a lean one (the KV after the last full block only)
    handoff: _Handoff
    first_blocks: Sequence[GetResult] | None  # the first group's blocks, read with the head (not block parts)


class HandoffFetcher:
    def __init__(self, cache: CacheClient, engine: AsyncEngine, group_bytes: int, part_wait_s: float,
                 counters: FetchCounters, claim: Callable[[list[common_pb2.ObjectKey]], None]):
        self.cache = cache
        self.engine = engine
        self.layout = engine.layout
        self.group_blocks = max(1, group_bytes // max(self.layout.kv_block_bytes, 1))
        self.part_wait_s = part_wait_s
        self.counters = counters
        self.claim = claim

    async def load(self, key: common_pb2.ObjectKey, hashes: list[bytes], check: Callable[[RequestState], None],
                   span, deadline: float | None) -> Loaded:
        """`open`, then `finish`: the whole handoff in one call."""
        return await self.finish(await self.open(key, hashes, check, span, deadline))

    async def open(self, key: common_pb2.ObjectKey, hashes: list[bytes], check: Callable[[RequestState], None],
                   span, deadline: float | None) -> Opened:
        """Steps 1-3 of the module docstring: the head, read, parsed and checked; its blocks still to read."""
        h = _Handoff(key, list(hashes), await self._to_read(hashes), span, deadline)
        first = await self._get([key] + h.block_keys(h.to_read[:self.group_blocks]), h)
        if first[0].status != Status.FOUND:
            raise Unusable(first[0].status.name.lower(), first[0].message or "handoff not found")
        try:
            h.manifest = read_manifest(first[0].data)
        except PartsError as exc:
            raise Unusable("corrupt", str(exc)) from None
        opened = Opened(None, h, None if h.streams_blocks else first[1:])
        try:
            head = await self._head(h, first[0].data)
            opened.state = await asyncio.to_thread(self._parse, head, check)
            self._check_block_count(h, opened.state)
        except BaseException:
            self.release(opened)
            raise
        return opened

    async def finish(self, opened: Opened) -> Loaded:
        """Step 4 of the module docstring: the blocks of an opened handoff; then `release`s it."""
        try:
            state = opened.state
            if state.kv.shape[1] == self.layout.blocks_for(state.num_computed_tokens):  # whole: nothing else to read
                return Loaded(state, lean=False)
            return await self._blocks(opened.handoff, state, opened.first_blocks)
        finally:
            self.release(opened)

    def release(self, opened: Opened) -> None:
        """Claims a streamed handoff's block parts, once: after `finish`, or when it is never reached."""
        h = opened.handoff
        if h.streams_blocks and not h.blocks_claimed:
            h.blocks_claimed = True
            self.claim(h.block_keys(range(h.manifest.blocks)))

    async def _to_read(self, hashes: list[bytes]) -> list[int]:
        """The full blocks to read from the cache service (step 1 of the module docstring)."""
        if not hashes or not self._room(len(hashes) + 1):  # + 1: the tail after the last full block
            return list(range(len(hashes)))
        held = (await self.engine.prefix_presence(hashes)).blocks
        return [i for i, here in enumerate(held) if not here]

    def _room(self, blocks: int) -> bool:
        return self.engine.stats_snapshot().num_free_blocks > blocks

    async def _head(self, h: _Handoff, data: bytes) -> bytes:
        if h.manifest is None:
            self.claim([h.key])
            return data
        keys = head_keys(h.key, h.manifest)
        pieces = await self._fetch(keys, h, late_ok=False, missing="missing_part")
        self.claim([h.key, *keys])
        self.counters.handoff_parts += len(keys)
        try:
            return await asyncio.to_thread(join_head, h.manifest, pieces)
        except PartsError as exc:
            raise Unusable("missing_part" if exc.missing else "corrupt", str(exc)) from None

    def _parse(self, head: bytes, check: Callable[[RequestState], None]) -> RequestState:
        try:
            state = RequestState.from_bytes(head)
        except TransferError as exc:
            raise Unusable("corrupt", str(exc)) from None
        check(state)
        try:
            check_request_state(state, self.layout, lean=True)
        except TransferError as exc:
            raise Unusable(_refusal(exc), str(exc)) from None
        return state

    def _check_block_count(self, h: _Handoff, state: RequestState) -> None:
        full = len(state.block_hashes)
        if full != len(h.hashes):
            raise Unusable("mismatch", f"the state has {full} full blocks, the prompt {len(h.hashes)}")
        if h.manifest is not None and h.manifest.blocks != full:
            raise Unusable("mismatch", f"the manifest names {h.manifest.blocks} blocks, the state {full}")

    # -- the blocks ---------------------------------------------------------------------------------------------

    async def _blocks(self, h: _Handoff, state: RequestState, have: Sequence[GetResult] | None) -> Loaded:
        full = len(h.hashes)
        groups = [h.to_read[a:a + self.group_blocks] for a in range(0, len(h.to_read), self.group_blocks)]
        held = full - len(h.to_read)
        lean = held > 0 or (len(groups) > 1 and self._room(self.layout.blocks_for(state.num_computed_tokens)))
        collected: list[torch.Tensor] = []

        async def use(blocks: list[int], kv: torch.Tensor) -> None:
            if not lean:
                collected.append(kv)
                return
            cached = await self.engine.import_blocks([h.hashes[i] for i in blocks], kv)
            if cached < len(blocks):
                raise Unusable("no_room", f"the engine took {cached} of blocks {blocks[0]}..{blocks[-1]}")
            self.counters.handoff_groups += 1

        await self._pipeline(h, groups, have, use)
        if lean:
            self.counters.handoff_local_blocks += held
            return Loaded(state, lean=True)
        whole = replace(state, kv=torch.cat([*collected, state.kv], dim=1))  # [layers, total, bs, dim]
        return Loaded(whole, lean=False)

    async def _pipeline(self, h: _Handoff, groups: list[list[int]], have: Sequence[GetResult] | None,
                        use: Callable[[list[int], torch.Tensor], Awaitable[None]]) -> None:
        """Fetches group k+1 while group k is checked and used (a group: the indices of its full blocks)."""
        if not groups:
            return
        late_ok = h.manifest is not None

        def fetch(g: int) -> asyncio.Future:
            return asyncio.ensure_future(self._fetch(h.block_keys(groups[g]), h, late_ok, "missing_block",
                                                     have if g == 0 else None))
        pending = fetch(0)
        try:
            for g, blocks in enumerate(groups):
                data = await pending
                pending = fetch(g + 1) if g + 1 < len(groups) else None
                if h.streams_blocks:
                    self.counters.handoff_parts += len(data)
                kv = await asyncio.to_thread(self._check_group, data, h.hashes, blocks)
                await use(blocks, kv)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    def _check_group(self, data: list[bytes], hashes: list[bytes], blocks: list[int]) -> torch.Tensor:
        """-> kv [num_mla_layers, len(blocks), block_size, cache_dim]; each block checked on its own thread."""
        try:
            checked = parallel_map(lambda j: check_block(data[j], hashes[blocks[j]], self.layout, blocks[j]),
                                   range(len(data)))
        except TransferError as exc:
            raise Unusable(_refusal(exc), str(exc)) from None
        return torch.stack(checked, dim=1)

    # -- reads ----------------------------------------------------------------------------------------------------

    async def _fetch(self, keys: list[common_pb2.ObjectKey], h: _Handoff, late_ok: bool, missing: str,
                     have: Sequence[GetResult] | None = None) -> list[bytes]:
        """Every object of `keys`, waiting for late ones when `late_ok` (see the module docstring)."""
        data: list[bytes | None] = [None] * len(keys)
        give_up = time.monotonic() + self.part_wait_s
        if h.deadline is not None:
            give_up = min(give_up, h.deadline)
        pause = FIRST_PAUSE_S
        while True:
            todo = [i for i, d in enumerate(data) if d is None]
            got = list(have) if have is not None else await self._get([keys[i] for i in todo], h)
            have = None
            for i, r in zip(todo, got, strict=True):
                if r.status == Status.FOUND:
                    data[i] = r.data
                elif r.status == Status.CORRUPT or not (late_ok and r.status == Status.MISSING):
                    reason = "corrupt" if r.status == Status.CORRUPT else missing
                    raise Unusable(reason, f"part {i} of {len(keys)}: {r.status.name} {r.message}".strip())
            if all(d is not None for d in data):
                return data
            left = give_up - time.monotonic()
            if left <= 0:
                raise Unusable("late_part", f"{sum(d is None for d in data)} of {len(keys)} parts still missing "
                                            f"{self.part_wait_s} s after the wait began")
            await asyncio.sleep(min(pause, left))
            self.counters.handoff_wait_seconds += min(pause, left)
            pause = min(pause * 2, MAX_PAUSE_S)

    async def _get(self, keys: list[common_pb2.ObjectKey], h: _Handoff) -> list[GetResult]:
        started = time.perf_counter()
        got = await self.cache.get_objects(keys)
        self.counters.handoff_seconds += time.perf_counter() - started
        nbytes = sum(len(r.data) for r in got if r.data is not None)
        self.counters.handoff_bytes += nbytes
        h.nbytes += nbytes
        h.span.set_attribute(tracing.BYTES, h.nbytes)
        return got


def _refusal(exc: TransferError) -> str:
    return next(why for kind, why in _REFUSALS if isinstance(exc, kind))
