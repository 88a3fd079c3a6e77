"""`AsyncEngine`: the engine for asyncio servers — the step loop runs in its own thread, never on the event loop.

Contract:
- `await AsyncEngine.create(args)` loads the model off the event loop and starts the step thread; `await
  engine.shutdown()` (or `async with`) stops it (and the model's rank processes). Everything that touches `EngineCore` runs on the step thread: the
  event loop only queues commands (`run_in_engine`) and receives outputs through per-request asyncio queues, a
  step's outputs in one event-loop callback (per loop) after the step.
- `generate(request_id, prompt, params, ...)` is an async iterator of delta `RequestOutput`s (token ids, text delta,
  logprobs, finish reason, `num_cached_tokens`), ending after the one with `finished=True`. Invalid input raises
  `InvalidRequestError` from the first `__anext__` and does not disturb other requests. Leaving the iteration early
  — `break`, an exception, task cancellation — aborts the request. Every wait has a deadline: `wait_timeout_s`
  per output (and an optional absolute `deadline`, `time.monotonic()` seconds); passing it aborts the request and
  raises `RequestTimeoutError`.
- Nothing heavy runs on the step thread: before a request reaches the engine, `generate` / `import_request` wait
  (off the step thread, the other requests keep stepping) for its grammar — compiled on a compile thread with the
  engine's grammar cache (engine/structured/requests.py `compile_async`), within `args.grammar_compile_timeout_s`
  (past it: `InvalidRequestError` naming the schema or tools, a 400) — and for its images, decoded, checked and
  encoded on a media thread (engine/vision/feed.py `MediaSetup.encode_ahead`); both kinds of thread run at the
  lowest CPU priority (engine/background.py), so the step thread keeps its core. Both also end at the request's
  `deadline` (`RequestTimeoutError`). `await warm_up()` builds the grammar backend off the step thread (a worker
  does it before it reports SERVING).
- `abort(request_id)` ends a request from anywhere; its stream finishes with `finish_reason == "abort"`.
- If the step loop fails, every stream and later call raises `EngineDeadError`. `is_healthy` is False then, and
  as soon as a rank process of a tensor-parallel engine is gone.
- The service API of the worker services (engine/core.py), so that they never touch `EngineCore` from the event
  loop: `probe_prefix` (cached prompt tokens by the prefix hit rule, with the queues and pool usage, in one
  command), `prefix_presence`, `import_prefix`, `import_blocks`, `export_snapshots` run on the step thread between
  two steps;
  `stats_snapshot()` returns the `EngineStats` the step thread published after its latest step or command batch
  (an immutable object: any thread may read it, e.g. a metrics scrape, without waiting); `layout` and
  `validate_prompt` read only what is fixed when the engine starts.
- `set_export_sink(sink)`: from then on the engine collects the KDA snapshots leaving its prefix cache (evicted, or a
  finished handoff's turn end, engine/exchange.py `SnapshotExport`) and calls `sink(exports)` on the step thread
  after the step or command batch that produced them, before that step's outputs go to their streams (the sink must
  only hand them over, e.g. with `loop.call_soon_threadsafe`, which then delivers them first); `None` stops the
  collection. Without a sink nothing is collected or copied.
- Every `LOG_STATS_INTERVAL_S` with new drafts (speculative decoding) it logs vLLM's "SpecDecoding metrics: Mean
  acceptance length: …" line over the interval.
- Every `LOG_STATS_INTERVAL_S` with new admissions the step thread logs vLLM's line "Prefix cache hit rate: X%" (over
  that interval, and since start) with the snapshot memory in use, from the engine's counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from collections.abc import Sequence

from engine.background import background_executor
from engine.config import EngineArgs
from engine.core import EngineCore, EngineStats, PromptInput
from engine.errors import EngineDeadError, InvalidRequestError, RequestTimeoutError
from engine.exchange import SnapshotExport
from engine.fair_share import TenantShare
from engine.memory.events import CacheEventKind
from engine.memory.manager import CacheListing, PrefixPresence
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.transfer import CacheLayout, RequestState

logger = logging.getLogger(__name__)

DEFAULT_WAIT_TIMEOUT_S = 300.0
MEDIA_THREADS = 2  # images decoded and encoded at once, off the step thread
IDLE_POLL_S = 0.05
LOG_STATS_INTERVAL_S = 10.0


class _HitRateLog:
    """The periodic "Prefix cache hit rate" line (see the module docstring)."""

    def __init__(self, stats: EngineStats, interval_s: float = LOG_STATS_INTERVAL_S):
        self.interval_s = interval_s
        self._last = self._spec_last = stats
        self._due = time.monotonic() + interval_s

    def maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.interval_s
        self._log_spec(stats)
        looked = stats.prefix_lookup_tokens - self._last.prefix_lookup_tokens
        if looked <= 0:
            return
        hit = stats.prefix_hit_tokens - self._last.prefix_hit_tokens
        self._last = stats
        logger.info("Prefix cache hit rate: %.1f%% (%d of %d prompt tokens; %.1f%% since start); KDA snapshots "
                    "%d (%.1f of %.1f MiB), %d junctions, %d offloaded", 100 * hit / looked, hit, looked,
                    100 * stats.prefix_hit_rate, stats.num_snapshots, stats.snapshot_bytes / 2 ** 20,
                    stats.snapshot_budget_bytes / 2 ** 20, stats.num_junctions, stats.num_snapshot_exports)

    def _log_spec(self, stats: EngineStats) -> None:
        """vLLM's "SpecDecoding metrics" line over the interval (only when there were drafts)."""
        last, self._spec_last = self._spec_last, stats
        drafts = stats.spec_num_drafts - last.spec_num_drafts
        if drafts <= 0:
            return
        drafted = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
        per_pos = [(a - b) / drafts for a, b in itertools.zip_longest(stats.spec_accepted_per_pos,
                                                                       last.spec_accepted_per_pos, fillvalue=0)]
        logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                    "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%", 1 + accepted / drafts,
                    accepted, drafted, ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / max(drafted, 1))


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, core: EngineCore, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S):
        self.core = core
        self.wait_timeout_s = wait_timeout_s
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: EngineStats = core.stats()  # replaced (never changed) by the step thread
        self._export_sink: Callable[[list[SnapshotExport]], None] | None = None
        self._hit_rate_log = _HitRateLog(self._stats)
        self._media_pool = background_executor(MEDIA_THREADS, "kdamesh-media")  # lowest CPU priority
        self._thread = threading.Thread(target=self._run, name="kdamesh-engine-step", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, args: EngineArgs, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> "AsyncEngine":
        core = await asyncio.to_thread(EngineCore, args)
        return cls(core, wait_timeout_s)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        self.core.constrained.close()
        await asyncio.to_thread(self.core.close)  # the model's rank processes (tensor parallelism)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def is_healthy(self) -> bool:
        """Running, and (tensor parallelism) every rank process alive: what a worker's health reports."""
        return self.is_running and self.core.executor.healthy()

    # -- the step thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                self._publish()
                if self.core.has_unfinished_requests():
                    outputs = self.core.step()
                    self._publish()  # first: a stream that sees its end finds the step's exports handed over
                    self._deliver(outputs)
                    self._hit_rate_log.maybe_log(self._stats)
                else:
                    self._wakeup.wait(IDLE_POLL_S)
                    self._wakeup.clear()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting streams
            logger.exception("engine step loop failed")
            self._dead = exc
            dead = EngineDeadError(f"engine step loop failed: {exc!r}")
            for stream in list(self._streams.values()):
                stream.put(dead)
            self._fail_commands(dead)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one event-loop callback per loop and step, not one per output (each
        wake-up costs the step thread a write and the GIL back from the busy loop)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _publish(self) -> None:
        """After a step or command batch: the stats snapshot, and the collected exports to the sink."""
        self._stats = self.core.stats()
        sink, exchange = self._export_sink, self.core.exchange
        exchange.exporting = sink is not None
        if exchange.outbox:
            exports = exchange.take_outbox()
            if sink is not None:
                sink(exports)

    def _run_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for fn, future in commands:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _fail_commands(self, exc: BaseException) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)

    # -- commands --------------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop failed: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("engine is shut down")

    async def run_in_engine(self, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """Runs `fn()` on the step thread between steps; returns its result or raises its exception."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((fn, future))
        self._wakeup.set()
        try:
            async with asyncio.timeout(timeout_s or self.wait_timeout_s):
                return await asyncio.wrap_future(future)
        except TimeoutError as exc:
            raise RequestTimeoutError("the engine did not run the command in time") from exc

    async def abort(self, request_id: str) -> bool:
        return await self.run_in_engine(lambda: self.core.abort(request_id))

    async def stats(self):
        return await self.run_in_engine(self.core.stats)

    async def check_integrity(self) -> None:
        await self.run_in_engine(self.core.check_integrity)

    # -- the service API (see the module docstring) ------------------------------------------------------------

    @property
    def layout(self) -> CacheLayout:
        return self.core.layout

    def validate_prompt(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int], int]:
        return self.core.validate_prompt(prompt, params)

    def stats_snapshot(self) -> EngineStats:
        return self._stats

    async def probe_prefix(self, block_hashes: list[bytes], num_tokens: int) -> tuple[int, EngineStats]:
        """-> (prompt tokens the prefix cache would serve now, the engine's stats at that moment)."""
        return await self.run_in_engine(lambda: (self.core.probe_prefix(block_hashes, num_tokens), self.core.stats()))

    async def prefix_presence(self, block_hashes: list[bytes]) -> PrefixPresence:
        return await self.run_in_engine(lambda: self.core.prefix_presence(block_hashes))

    async def start_cache_events(self) -> CacheListing:
        """Turns on the prefix cache's event recording and lists what it holds now (`CacheManager.start_events`);
        the events `take_cache_events` returns afterwards change that listing."""
        return await self.run_in_engine(self.core.manager.start_events)

    def take_cache_events(self) -> tuple[list[tuple[CacheEventKind, bytes]], bool]:
        """The cache events recorded since the last call and whether some were lost (`CacheEventSink.drain`)."""
        return self.core.manager.events.drain()

    async def import_prefix(self, blocks: list[bytes], snapshot: bytes | None) -> bool:
        """Imports a served prefix (see `CacheExchange.import_prefix`); raises `TransferError` for a bad object."""
        return await self.run_in_engine(lambda: self.core.exchange.import_prefix(blocks, snapshot))

    async def import_blocks(self, block_hashes: list[bytes], kv: torch.Tensor) -> int:
        """Full blocks the caller decoded and checked, `kv` [num_mla_layers, n, block_size, cache_dim], into the
        prefix cache (`CacheExchange.import_block_tensors`) -> how many of them are cached now."""
        return await self.run_in_engine(lambda: self.core.exchange.import_block_tensors(block_hashes, kv))

    async def export_snapshots(self, block_hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        return await self.run_in_engine(lambda: self.core.exchange.export_snapshots(block_hashes))

    def set_export_sink(self, sink: Callable[[list[SnapshotExport]], None] | None) -> None:
        """Hands the snapshots leaving the prefix cache to `sink` (on the step thread; see the module docstring).
        Any thread may call it: the step thread turns the collection on or off before its next step."""
        self._export_sink = sink
        self._wakeup.set()

    # -- off the step thread: grammars and images ---------------------------------------------------------------

    async def warm_up(self) -> None:
        """Builds the grammar backend (imports xgrammar, reads the vocabulary) off the step thread."""
        await asyncio.to_thread(self.core.constrained.warm)

    async def _ready(self, params: SamplingParams, media: tuple, deadline: float | None) -> tuple:
        """Waits for the request's grammar and encodes its images, off the step thread -> the encoded images."""
        if isinstance(params, SamplingParams) and params.structured is not None:
            compiling = self.core.constrained.compile_async(params.structured)
            limit = self.core.args.grammar_compile_timeout_s
            await self._off_thread(compiling, limit, deadline, lambda: InvalidRequestError(
                f"structured output: the grammar of {_grammar_name(params.structured)} did not compile within "
                f"{limit:g} s", param="tools" if params.structured.kind == "tool_call" else "response_format"))
        if media:
            media = await self._off_thread(self._media_pool.submit(self.core.media.encode_ahead, media), None,
                                           deadline, None)
        return media

    async def _off_thread(self, future: concurrent.futures.Future, limit: float | None, deadline: float | None,
                          too_slow: Callable[[], Exception] | None) -> Any:
        """`future`'s result within `limit` (then `too_slow()`) and the request's deadline (`RequestTimeoutError`).
        The future is shared (one compile serves every request of a grammar): giving up never cancels it."""
        left = self.wait_timeout_s if deadline is None else deadline - time.monotonic()
        timeout = left if limit is None else min(limit, left)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                return await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            if too_slow is not None and limit is not None and limit <= left:
                raise too_slow() from None
            raise RequestTimeoutError("the request's grammar or images were not ready before its deadline") from None

    # -- streams ---------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams, priority: int = 0,
                       cache_salt: str | None = None, export_on_finish: bool = False,
                       deadline: float | None = None, media: tuple = (),
                       snapshot_hints: Sequence[int] = (),
                       tenant: TenantShare = TenantShare()) -> AsyncIterator[RequestOutput]:
        """`snapshot_hints`: prompt token positions to snapshot the KDA state at; `tenant`: whom it runs for in the
        fair share (`EngineCore.add_request`)."""
        self._check_alive()
        media = await self._ready(params, media, deadline)
        add = lambda: self.core.add_request(request_id, prompt, params, priority=priority,  # noqa: E731
                                            cache_salt=cache_salt, export_on_finish=export_on_finish, media=media,
                                            snapshot_hints=tuple(snapshot_hints), tenant=tenant)
        async for out in self._stream(request_id, add, deadline):
            yield out

    async def import_request(self, request_id: str, state: RequestState, params: SamplingParams,
                             priority: int = 0, deadline: float | None = None, media: tuple = (),
                             tenant: TenantShare = TenantShare(), lean: bool = False) -> AsyncIterator[RequestOutput]:
        """Continues a request exported by another engine (see `EngineCore.import_request`, also for `lean`),
        streaming deltas."""
        self._check_alive()
        media = await self._ready(params, media, deadline)
        add = lambda: self.core.import_request(request_id, state, params, priority=priority,  # noqa: E731
                                               media=media, tenant=tenant, lean=lean)
        async for out in self._stream(request_id, add, deadline):
            yield out

    async def _stream(self, request_id: str, add: Callable[[], None],
                      deadline: float | None) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already streaming", param="request_id")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        added = finished = False
        maybe_added = True  # cancelled while the step thread runs `add`: it may still have added the request
        try:
            try:
                await self.run_in_engine(add)  # raises InvalidRequestError for bad input
            except RequestTimeoutError:
                raise  # like a cancellation: the step thread may still run the add
            except Exception:
                maybe_added = False  # the add itself failed: nothing to abort (another stream may own the id)
                raise
            added = True
            while True:
                item = await self._next(stream, deadline)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if (added or maybe_added) and not finished and self._dead is None and not self._stopping:
                self._abort_soon(request_id)  # queued after the add: a skipped add makes it a no-op

    async def _next(self, stream: _Stream, deadline: float | None):
        timeout = self.wait_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that races a result
            async with asyncio.timeout(max(timeout, 0.0)):
                return await stream.queue.get()
        except TimeoutError as exc:
            raise RequestTimeoutError("no output before the deadline; the request was aborted") from exc

    def _abort_soon(self, request_id: str) -> None:
        """Queues an abort without awaiting (safe from a cancelled task or a closing generator)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((lambda: self.core.abort(request_id), future))
        self._wakeup.set()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _grammar_name(structured) -> str:
    """What a 400 names: the schema (its title, when it has one) or the tools."""
    if structured.kind == "tool_call":
        return "tools " + ", ".join(repr(t.name) for t in structured.allowed_tools)
    if structured.kind == "json_schema":
        title = structured.schema.get("title") if isinstance(structured.schema, dict) else None
        return "response_format.json_schema" + (f" {title!r}" if isinstance(title, str) else "")
    return "response_format json_object"
