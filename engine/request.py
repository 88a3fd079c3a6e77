"""One generated sequence inside the engine: its tokens, progress, cache holdings and output state.

Contract:
- `token_ids` is prompt + output so far; the scheduler's one rule is that `num_computed_tokens` (tokens whose KV
  and KDA state are in the cache) catches up with `len(token_ids)`. The last token is never computed before the
  sample that follows it, so a running request always has at least one token to compute.
- `block_ids` (MLA blocks, in position order) and `state_group` (running KDA slots) are set and cleared only by
  `engine.memory.manager.CacheManager`; `block_hashes` grows as full blocks of `token_ids` become known.
  `slot_offset` says which slot of the group holds the running state (speculative verification moves it to the
  slot of the last accepted position instead of copying; 0 at admission).
- `draft` (speculative decoding, engine/spec/): the drafter's proposal for the tokens after `token_ids`, set before
  a step and cleared after it; never part of `token_ids` until verification accepts it.
- `seed` (sampled requests): the noise seed of engine/sampling.py; with the output position it fixes every random
  number the sequence draws (sampling and verification), so it is all a handoff carries of the sampler.
- A request with `n > 1` is `n` `Request`s (ids `"{i}_{parent}"`) under one `parent_id`.
- Output state (`OutputState`, with the tokenizer unless the engine's `detokenize` is off: ids only, no stop strings)
  turns sampled ids into text deltas with `IncrementalDetokenizer`, matches stop
  strings on the text with `engine.formats.stop.StopMatcher` (the gateway's rule too: a stream holds back the last
  `max(len(stop)) - 1` characters so a stop string is never emitted) and stop token ids, and decides the finish
  reason.
- `grammar` (structured output only) is the sequence's `engine.structured.GrammarState`: set by `EngineCore` when
  the request is added, advanced with every sampled token, dropped when the request finishes.
- `media` (K3 images): the prompt's `engine.vision.feed.ImageInput`s, the same spans `hasher` mixes into the
  block hashes; the runner feeds their encoder rows at their pad tokens.
- `times` (`engine.phase_times.RequestTimes`) stamps when the sequence was queued, first scheduled
  (`mark_scheduled`, by the scheduler) and sampled its first and last token here (`append_token`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.formats.stop import StopMatcher
from engine.memory.hashing import BlockHasher
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs
from engine.phase_times import RequestTimes
from engine.sampling import SampleResult, SamplingParams
from engine.transfer import RequestState

if TYPE_CHECKING:
    from engine.spec.drafter import Draft
    from engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)  # identity semantics: queues compare and remove requests by object
class Request:
    request_id: str
    parent_id: str
    index: int  # 0 … n-1 within the parent
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    arrival: int  # admission order key (smaller = earlier)
    hasher: BlockHasher
    priority: int = 0  # smaller runs first
    seed: int | None = None  # sampled requests: the noise seed of engine/sampling.py (None: greedy)
    output: "OutputState | None" = None
    export_on_finish: bool = False
    imported: RequestState | None = None  # carried KV + state, written at admission
    exported: RequestState | None = None  # set at finish when `export_on_finish`
    cache_salt: str | None = None
    tenant: str | None = None  # fair share of the running slots and pools (engine/fair_share.py `tenant_label`)
    tenant_weight: float = 1.0  # the tenant's weight in that share (> 0)
    media: tuple = ()  # engine.vision.feed.ImageInput spans of the prompt (their rows feed the forward)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-hit tokens at first admission
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    state_group: int | None = None
    slot_offset: int = 0  # the running slot within the group (engine/memory/manager.py)
    draft: "Draft | None" = None  # speculative decoding: the proposal verified in the next step
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    grammar: "GrammarState | None" = None  # structured output: the matcher (engine.structured), dropped at finish
    times: RequestTimes = field(default_factory=RequestTimes)  # queue / prefill / decode stamps in this engine
    prompt_logprobs: list | None = None  # `params.prompt_logprobs`: per prompt position (engine/prompt_logprobs.py)
    # extra KDA snapshot points (token positions, block boundaries) -> retention priority: structure hints and
    # junctions (engine/memory/policy.py)
    snapshot_points: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.times.resumed = self.imported is not None
        self.times.handed_off = self.export_on_finish
        self.hasher.extend(self.block_hashes, self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def mark_scheduled(self) -> None:
        self.times.mark_scheduled()

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.times.mark_token()
        if len(self.token_ids) % self.hasher.block_size == 0:
            self.hasher.extend(self.block_hashes, self.token_ids)


class OutputState:
    """Per-sequence detokenisation, stop matching and the deltas not yet handed out."""

    def __init__(self, params: SamplingParams, tokenizer, eos_token_ids: tuple[int, ...]):
        from engine.tokenizer import IncrementalDetokenizer

        self.params = params
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer else None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.emitted_chars = 0
        self.token_ids: list[int] = []
        self.emitted_tokens = 0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def prime(self, token_ids: list[int]) -> None:
        """Carried-over outputs (an imported request): part of the cumulative output, never of a delta."""
        self.token_ids.extend(token_ids)
        self.emitted_tokens = len(self.token_ids)
        if self.detok is not None:
            self.text += self.detok.push(token_ids)
        self.emitted_chars = len(self.text)
        if self.logprobs is not None:
            self.logprobs.extend({} for _ in token_ids)
            self.cumulative_logprob = None

    def add_token(self, result: SampleResult, num_output_tokens: int, max_tokens: int,
                  at_model_limit: bool) -> str | None:
        """Records one sampled token; returns the finish reason when the sequence is done."""
        token = result.token_id
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(self._position_logprobs(result))
            if self.cumulative_logprob is not None:
                self.cumulative_logprob += result.logprob
        min_reached = num_output_tokens > self.params.min_tokens
        if token in self.stop_ids and min_reached:  # before min_tokens the sampler suppresses stop ids
            self.stop_reason = token if token in self.params.stop_token_ids else None
            return self._finish("stop")
        if self.detok is not None:
            before = len(self.text)
            self.text += self.detok.push(token)
            if self.stops and min_reached:
                self.text, stop = self.stops.cut(self.text, before)
                if stop is not None:
                    self.stop_reason = stop
                    return self._finish("stop")
        if num_output_tokens >= max_tokens or at_model_limit:
            return self._finish("length")
        return None

    def _finish(self, reason: str) -> str:
        if reason != "stop" and self.detok is not None:
            self.text += self.detok.finish()
        self.finish_reason = reason
        return reason

    def abort(self) -> None:
        self.finish_reason = "abort"

    def _position_logprobs(self, result: SampleResult) -> PositionLogprobs:
        entries = {result.token_id: Logprob(result.logprob, result.rank, self._decode_one(result.token_id))}
        for rank, (token, value) in enumerate(result.top, start=1):
            if token not in entries:
                entries[token] = Logprob(value, rank, self._decode_one(token))
        return entries

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def take_delta(self, index: int) -> CompletionOutput:
        """A `CompletionOutput` with the cumulative state and the delta since the last call."""
        finished = self.finish_reason is not None
        visible = self.stops.visible_end(len(self.text), self.emitted_chars, finished)
        delta_text = self.text[self.emitted_chars:visible]
        delta_ids = self.token_ids[self.emitted_tokens:]
        delta_lp = self.logprobs[self.emitted_tokens:] if self.logprobs is not None else None
        self.emitted_chars, self.emitted_tokens = visible, len(self.token_ids)
        return CompletionOutput(
            index=index, text=self.text if finished else self.text[:visible], token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, delta_text=delta_text,
            delta_token_ids=delta_ids, delta_logprobs=delta_lp)

    @property
    def has_delta(self) -> bool:
        return self.finish_reason is not None or len(self.token_ids) > self.emitted_tokens
