"""`EngineCore`: the synchronous engine — requests in, one step at a time, `RequestOutput` deltas out.

Contract:
- Not thread-safe: one thread calls everything (`LLM` directly, `AsyncEngine` from its step thread), except
  `layout` and `validate_prompt`, which read only what is fixed at construction.
- `add_request(request_id, prompt, params, ...)` validates everything first (`InvalidRequestError`, nothing
  changes) and queues `params.n` sequences. A prompt is a str (tokenised without special tokens), a list of ids,
  or `{"prompt_token_ids": [...]}` / `{"prompt": str}`. Admission rejects requests that can never run: an empty
  prompt, ids outside the vocabulary, `len(prompt) + max_tokens > max_model_len`, or more KV blocks than the pool.
- `step()` is schedule -> execute -> update (vLLM v1's shape): `_schedule` (drafts, the scheduler's batch) ->
  `_execute(out)` reads that batch and never changes a request: the forward, then every logits row sampled and
  verified at once on the device with ONE read-back (engine/step_sampling.py) -> a frozen `StepResult` ->
  `update_from_output(out, result)` is the one place that applies it: appended tokens (stops, grammar),
  `num_computed_tokens` (assigned there and nowhere else in the step), verification counters and settling, commits
  and snapshot copies, the drafter's observations, finished requests. Data-dependent control flow (a row finished,
  a stop id) is decided on the host from the read-back. Returns one delta `RequestOutput` per request that changed.
- Sampled sequences get a noise seed at admission (`params.seed + index`, else one drawn from the engine's seeded
  RNG); with the output position it decides every random number of the sequence (engine/sampling.py), so a seeded
  request reproduces in any batch and an exported request carries only its seed.
- `args.detokenize` (default on): the step thread detokenises and matches stop strings; off, outputs carry ids only
  (empty text, `Logprob.decoded_token` None) and stop strings are left to the caller (the mesh gateway does both).
- Speculative decoding (`args.speculative_config`, engine/spec/): before scheduling, the drafter proposes tokens for
  the running decodes; the step verifies them in the same forward (engine/spec/decoding.py) and appends the
  accepted drafts plus one token, so a request may gain up to 1 + k tokens in a step.
- `abort(request_id)` ends a request at once (its output finishes with "abort" on the next `step`).
  `add_request(..., snapshot_hints=positions)`: token positions of the prompt (where the rendered chat's system/tool
  block and each earlier message end) at which the KDA state is snapshotted, rounded down to blocks
  (engine/memory/policy.py `hint_points`; out-of-range positions are an `InvalidRequestError`), so a later prompt
  sharing that prefix resumes there. With `exchange.exporting` on, `step` collects the snapshots leaving the cache
  (evicted, or a finished handoff's turn end) into `exchange.outbox` for the owner to offload.
- Structured output (`params.structured`, engine/structured/): `add_request` compiles the grammar (cached) and
  gives each sequence a matcher; `step` fills the bitmasks of the constrained rows before the forward, masks their
  logits rows (others untouched) before sampling, and advances each matcher with its sampled token. When no
  unfinished request has a grammar the step does no grammar work at all. An imported request replays its carried
  output through a fresh matcher. A finished or aborted request drops its matcher.
- Images (K3 checkpoints with a vision tower, engine/vision/): `add_request(..., media=ImageInput spans)` checks
  them (`engine.vision.feed.check_images`: spans on the prompt's pad tokens, bytes that decode to the span's rows),
  mixes their hashes into the block hashes and lets the runner feed their encoder rows; the vision encoder is
  loaded with the model (`load_vision`) and keeps an encoder cache by image hash.
- Export/import (see engine/transfer.py): `add_request(..., export_on_finish=True)` attaches a `RequestState` to
  the final output (the KV and KDA state after every token but the last sampled one, so importing it and
  continuing feeds that token next); `import_request` queues such a state (or a lean one) after the checks of
  `transfer.check_request_state` against `layout`; `exchange` moves prefix-cache entries (blocks, snapshots).
- The service API (what the worker services use, through `AsyncEngine`): `validate_prompt` (admission's checks; it
  reads only start-up facts, so any thread may call it), `probe_prefix` (tokens the prefix cache would serve: the
  prefix hit rule of engine/memory/manager.py), `prefix_presence`, `stats` (queues and pool usage), `layout`.
- `tenant=TenantShare(name, weight)`: whom the request runs for in the scheduler's fair share (engine/fair_share.py).
- Tensor parallelism (`args.tensor_parallel_size` > 1): the model runs on a rank group
  (engine/parallel/executor.py); this engine is rank 0 (scheduler, sampling) and `close()` stops the ranks. A
  failed rank makes `step` raise `RankFailedError`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import CachePlan, EngineArgs, plan_cache
from engine.errors import InvalidRequestError
from engine.exchange import CacheExchange
from engine.fair_share import TenantShare, tenant_label
from engine.memory.hashing import BlockHasher, root_hash
from engine.memory.manager import CacheManager, PrefixPresence
from engine.memory.policy import hint_points
from engine.model.loader import LoadConfig
from engine import prompt_logprobs
from engine.outputs import RequestOutput
from engine.phase_times import PhaseTimes
from engine.request import OutputState, Request, RequestStatus
from engine.runner import GraphOptions
from engine.parallel.executor import executor_config, open_executor
from engine.sampling import SampleResult, SamplingParams
from engine.step_sampling import StepSampler
from engine.spec.setup import open_spec_decoding
from engine.stats import EngineStats, cache_fingerprint, engine_stats, model_fingerprint
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured.requests import ConstrainedRequests
from engine.vision.cache import DEFAULT_BUDGET_BYTES
from engine.vision.feed import ImageInput, check_images, load_media
from engine.transfer import CacheLayout, RequestState, check_request_state

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


@dataclass(frozen=True)
class StepResult:
    """What executing a scheduled batch produced, per chunk of `SchedulerOutput.chunks`: the tokens it emits (None
    for a chunk without logits: a prefill piece), per sampled chunk (drafts verified, accepted), and the drafter's
    tapped hidden rows of the step's tokens (None without taps)."""

    tokens: list[list[SampleResult] | None]
    verified: list[tuple[int, int]]
    tapped: torch.Tensor | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class EngineCore:
    def __init__(self, args: EngineArgs):
        from engine.tokenizer import KimiTokenizer

        self.args = args
        load_config = LoadConfig(load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed)
        self.executor = open_executor(executor_config(args), args.model, load_config)
        self.model = self.executor.model
        self.config = self.model.config
        self.media = load_media(args.model, load_config, self.config.media_placeholder_token_id, DEFAULT_BUDGET_BYTES)
        tokenizer_dir = Path(args.tokenizer or args.model)
        self.tokenizer = KimiTokenizer.from_pretrained(tokenizer_dir) if (
            (tokenizer_dir / "tiktoken.model").is_file() or (tokenizer_dir / "tokenizer.json").is_file()) else None
        self.eos_token_ids = tuple(self.tokenizer.stop_token_ids) if self.tokenizer is not None else (
            () if self.config.eos_token_id is None else (self.config.eos_token_id,))
        self.memory_profile = self.executor.profile(args, self.media)  # None: --kv-cache-memory sizes the pools
        self.plan: CachePlan = plan_cache(args, self.config, self.model.dtype.itemsize,
                                          self.memory_profile and self.memory_profile.kv_budget)
        weights = (hashlib.sha256(args.model_fingerprint.encode()).digest() if args.model_fingerprint else
                   model_fingerprint(args.model, self.model.dtype, args.load_format, args.seed))
        self.fingerprint = cache_fingerprint(weights, args.kv_cache_dtype)
        self.manager = CacheManager(self.plan, has_kda=self.config.kda is not None)
        self.scheduler = Scheduler(self.manager, args.max_num_seqs, args.max_num_batched_tokens)
        graphs = None if args.enforce_eager else GraphOptions.of(args)
        self.executor.start(self.plan, args.max_forward_tokens, media=self.media.feeder,  # images: rank 0 plans them
                            graphs=graphs)
        self.runner = self.executor  # the runner's interface, on every rank (engine/parallel/executor.py)
        (layers, bs, dim), kv_dtype = self.runner.block_shape()
        self.layout = CacheLayout(self.fingerprint, self.plan.block_size, (layers, bs, dim),
                                  {name: shape for name, (shape, _) in self.runner.state_shapes().items()},
                                  layers * bs * dim * kv_dtype.itemsize)
        self.exchange = CacheExchange(self.manager, self.runner, self.layout)
        self.spec = open_spec_decoding(args, self.model, self.manager, self.plan, self.executor)
        self.step_sampler = StepSampler(self.spec.config.rejection_sample_method if self.spec else "standard")
        self._seed_rng = random.Random(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._requests: dict[str, Request] = {}  # child id -> request, unfinished
        self._touched: list[Request] = []  # requests with output not yet returned
        self._arrivals = 0
        self.phase_times = PhaseTimes()  # where finished requests spent their time here
        self.num_steps = 0
        self.constrained = ConstrainedRequests(self.tokenizer, self.config.vocab_size)  # structured output
        logger.info("engine: %d KV blocks x %d tokens (%.1f MiB), %d running + %d snapshot KDA slots (%.1f MiB), "
                    "snapshot interval %d, max_model_len %d", self.plan.num_blocks, self.plan.block_size,
                    self.plan.kv_bytes / 2 ** 20, self.plan.num_running_slots, self.plan.num_snapshot_slots,
                    self.plan.state_bytes / 2 ** 20, self.plan.snapshot_interval, self.plan.max_model_len)

    # -- requests --------------------------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """-> (prompt text or None, token ids); raises InvalidRequestError for a malformed prompt."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs `prompt_token_ids` or `prompt`", param="prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids", param="prompt")
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"a prompt is a str, a list of ids or a dict, got {type(prompt).__name__}",
                                  param="prompt")

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.plan.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the request has {num_prompt_tokens} "
                f"prompt tokens and asks for {max_tokens} more", param="max_tokens" if
                num_prompt_tokens < limit else "prompt")
        need = self.manager.blocks_for(num_prompt_tokens + max_tokens - 1)
        if need > self.plan.num_blocks:
            raise InvalidRequestError(f"the request needs {need} KV blocks, the pool has {self.plan.num_blocks}",
                                      param="max_tokens")
        return max_tokens

    def validate_prompt(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int], int]:
        """Admission's checks -> (prompt text or None, token ids, max_tokens resolved); raises InvalidRequestError.
        Reads only what is fixed when the engine starts (config, tokenizer, cache plan): any thread may call it."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", param="params")
        params.check_vocab(self.config.vocab_size)
        text, ids = self.tokenize(prompt)
        return text, ids, self.resolve_max_tokens(len(ids), params)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, media: tuple[ImageInput, ...] = (),
                    export_on_finish: bool = False, snapshot_hints: Sequence[int] = (),
                    tenant: TenantShare = TenantShare()) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", param="params")
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if export_on_finish and params.n != 1:
            raise InvalidRequestError("export_on_finish needs n == 1", param="n")
        text, ids, max_tokens = self.validate_prompt(prompt, params)
        points = hint_points(snapshot_hints, len(ids), self.plan.block_size)
        if params.structured is not None:  # structured output: compile now so a bad grammar queues nothing
            self.constrained.backend().compile(params.structured)
        media = check_images(ids, media, self.media.pad_id if self.media.feeder else None, self.media.processor)
        hasher = BlockHasher(self.plan.block_size, root_hash(self.fingerprint, cache_salt), media)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(request_id=child_id, parent_id=request_id, index=i, prompt_token_ids=ids, params=params,
                          max_tokens=max_tokens, arrival=self._arrivals, hasher=hasher, priority=priority,
                          seed=self._make_seed(params, i), export_on_finish=export_on_finish,
                          cache_salt=cache_salt, media=media, snapshot_points=dict(points))
            req.output = self._output_state(params)
            self.constrained.attach(req)
            self._arrivals += 1
            children.append(req)
        self._register(_Parent(request_id, text, ids, children), tenant)

    def _output_state(self, params: SamplingParams) -> OutputState:
        """Detokenising on the step thread unless `args.detokenize` is off (ids only)."""
        return OutputState(params, self.tokenizer if self.args.detokenize else None, self.eos_token_ids)

    def _register(self, parent: _Parent, tenant: TenantShare) -> None:
        self._parents[parent.request_id] = parent
        for req in parent.children:
            req.tenant, req.tenant_weight = tenant_label(tenant.name, req.cache_salt), tenant.weight
            self._requests[req.request_id] = req
            self.scheduler.add(req)

    def _make_seed(self, params: SamplingParams, index: int) -> int | None:
        """A sampled sequence's noise seed (engine/sampling.py): the request's seed + its index, else a fresh one."""
        if params.greedy:
            return None
        return params.seed + index if params.seed is not None else self._seed_rng.getrandbits(63)

    def abort(self, request_id: str) -> bool:
        """Ends a request (parent id) now; False when it is unknown or already finished."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        for req in parent.children:
            if not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # -- the step: schedule -> execute -> update ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self._schedule()
        if not out.is_empty:
            self.num_steps += 1
            self.phase_times.observe_step(out.num_tokens)
            self.update_from_output(out, self._execute(out))
        return self._collect_outputs()

    def _schedule(self) -> SchedulerOutput:
        """Drafts (speculative decoding), then the scheduler's batch."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.preempted(out.preempted)
        return out

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> StepResult:
        """Runs the scheduled batch (read, never changed) -> its `StepResult`: the forward, then every row sampled
        and verified on the device and read back once (engine/step_sampling.py)."""
        slots = [self.manager.running_slot(c.req) for c in out.chunks]
        sampled = [c for c in out.chunks if c.needs_logits]
        masks = self.constrained.fill_masks([c.req for c in sampled], self.plan.max_model_len)  # structured output: CPU work before the forward
        wanted = [prompt_logprobs.rows_wanted(c.req, c.start, c.num_tokens) for c in out.chunks]
        logits, prompt_logits = self.runner.execute_with_prompt_rows(out, slots, wanted)  # [rows, V], [rows_i, V]
        for chunk, chunk_logits in zip(out.chunks, prompt_logits):
            prompt_logprobs.record(chunk.req, chunk.start, chunk_logits, self.tokenizer)
        if masks is not None:  # constrained requests never verify: their one row is their chunk's first
            firsts = list(itertools.accumulate([1 + len(c.draft) for c in sampled], initial=0))[:-1]
            heads = logits[firsts]  # [L, V] one row per sampled chunk, as the masks are
            self.constrained.backend().apply(heads, masks, [i for i, c in enumerate(sampled) if c.req.grammar])
            logits[firsts] = heads
        result = self.step_sampler.sample(logits, sampled)
        tokens = iter(result.tokens)
        return StepResult([next(tokens) if c.needs_logits else None for c in out.chunks], result.verified,
                          self.runner.take_tapped())

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> None:
        """Applies a step's result to the requests and caches, the one place that does: appended tokens (and the
        stops they hit), `num_computed_tokens`, verification counters and settling, commits and snapshot copies,
        the drafter's observations, finished requests."""
        finished = []
        for chunk, tokens in zip(out.chunks, result.tokens):
            if tokens is not None and (f := self._append(chunk.req, tokens)) is not None:
                finished.append(f)
        if self.spec is not None:
            for num_drafts, accepted in result.verified:
                if num_drafts:
                    self.spec.record(num_drafts, accepted)
        copies = []
        for chunk in out.chunks:
            req = chunk.req
            # a verification keeps what was appended (the last token + accepted drafts); other chunks all they ran
            computed = req.num_tokens - 1 - chunk.start if chunk.draft else chunk.num_tokens
            req.num_computed_tokens = chunk.start + computed
            states = self.spec.settle(req, chunk.start, computed) if chunk.draft else None
            copies.extend(self.manager.commit(req, states))
        self.runner.copy_slots(copies)
        self.manager.copies_applied()
        if self.spec is not None:
            self.spec.observe(out.chunks, result.tapped)
            self.spec.clear(self.scheduler.running)
        for req, status in finished:
            self._finish(req, status)

    def _append(self, req: Request, results: list[SampleResult]) -> tuple[Request, RequestStatus] | None:
        """Appends the sampled tokens in order, up to one that finishes the request -> (req, how) when it did."""
        for result in results:
            if not self.constrained.advance(req, result.token_id):
                return req, RequestStatus.FINISHED_ABORTED
            req.append_token(result.token_id)
            reason = req.output.add_token(result, req.num_output_tokens, req.max_tokens,
                                          req.num_tokens >= self.plan.max_model_len)
            self._touched.append(req)
            if reason is not None:
                return req, RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.constrained.release(req)  # structured output: drop the matcher
        if self.spec is not None:
            self.spec.finished(req)
        if status is RequestStatus.FINISHED_ABORTED:
            req.output.abort()
        else:
            self.manager.record_turn_end(req)
            if req.export_on_finish:
                req.exported = self.exchange.export_request(req)
        self.scheduler.finish(req, status)
        self.phase_times.observe(req.times)
        self._requests.pop(req.request_id, None)
        self._touched.append(req)

    def _collect_outputs(self) -> list[RequestOutput]:
        changed: dict[str, list[Request]] = {}
        for req in self._touched:
            if req.output.has_delta and req not in changed.setdefault(req.parent_id, []):
                changed[req.parent_id].append(req)
        self._touched = []
        outputs = []
        for parent_id, reqs in changed.items():
            parent = self._parents[parent_id]
            if not reqs:
                continue
            finished = all(r.status.finished for r in parent.children)
            first = parent.children[0]
            outputs.append(RequestOutput(
                request_id=parent_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
                outputs=[r.output.take_delta(r.index) for r in sorted(reqs, key=lambda r: r.index)],
                finished=finished, num_cached_tokens=first.num_cached_tokens or 0,
                exported=first.exported if finished else None,
                prompt_logprobs=first.prompt_logprobs if first.num_computed_tokens >= len(first.prompt_token_ids)
                else None))
            if finished:
                del self._parents[parent_id]
        return outputs

    # -- observability and checks ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return engine_stats(self.manager, self.scheduler, self.phase_times, self.plan, self.spec)

    def probe_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Leading tokens of a prompt (`num_tokens`, full blocks hashing to `block_hashes`) that admission would
        serve from the prefix cache now (the prefix hit rule; nothing changes)."""
        return self.manager.resumable_prefix(block_hashes, num_tokens) * self.plan.block_size

    def prefix_presence(self, block_hashes: list[bytes]) -> PrefixPresence:
        """Which of these blocks the prefix cache holds, and which have a KDA snapshot (nothing changes)."""
        return self.manager.presence(block_hashes)

    def check_integrity(self) -> None:
        self.manager.check_integrity(self.scheduler.holding())
        for req in self.scheduler.waiting:
            assert not req.block_ids and req.state_group is None, f"waiting {req.request_id} holds cache"

    def close(self) -> None:
        """Stops the model's rank processes (tensor parallelism; nothing to do at TP=1)."""
        self.executor.close()

    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    # -- export / import -------------------------------------------------------------------------------------

    def import_request(self, request_id: str, state: RequestState, params: SamplingParams,
                       priority: int = 0, export_on_finish: bool = False, media: tuple[ImageInput, ...] = (),
                       tenant: TenantShare = TenantShare(), lean: bool = False) -> None:
        """Queues a request exported by another engine; it continues from `state.num_computed_tokens`. `lean`: the
        state may carry only the KV after its last full block, whose full blocks the caller put in this prefix cache
        first (`exchange.import_block_tensors`); one gone by admission makes it compute from its tokens instead.
        `media` are the prompt's images, checked as in `add_request`: their hashes make the blocks this engine
        commits hash as where the prompt was prefilled; their bytes serve only a recompute (the carried KV covers
        every image). `params.max_tokens` counts the carried output tokens too (the same params as the original
        request give the same total); carried tokens are in the cumulative outputs but never in a delta."""
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if params.n != 1:
            raise InvalidRequestError("an imported request has n == 1", param="n")
        check_request_state(state, self.layout, lean=lean)
        _, prompt, max_tokens = self.validate_prompt(state.prompt_token_ids, params)
        self.manager.note_sent(state.block_hashes)  # a handoff's full blocks came through the cache service
        media = check_images(prompt, media, self.media.pad_id if self.media.feeder else None, self.media.processor)
        hasher = BlockHasher(self.plan.block_size, root_hash(self.fingerprint, state.cache_salt), media)
        req = Request(request_id=request_id, parent_id=request_id, index=0, prompt_token_ids=prompt, params=params,
                      max_tokens=max_tokens, arrival=self._arrivals, hasher=hasher, priority=priority,
                      seed=self._make_seed(params, 0) if state.sampling_seed is None else state.sampling_seed,
                      export_on_finish=export_on_finish, token_ids=prompt + list(state.output_token_ids),
                      imported=state, cache_salt=state.cache_salt, media=media)
        req.num_cached_tokens = state.num_cached_tokens
        req.output = self._output_state(params)
        req.output.prime(state.output_token_ids)
        self.constrained.attach(req, list(state.output_token_ids))
        self._arrivals += 1
        self._register(_Parent(request_id, None, prompt, [req]), tenant)
