"""The text of one output choice: incremental detokenisation, stop strings and stop tokens, special tokens.

Contract:
- `TextRules.of(sampling, keep_special_ids)` reads a request's text rules from its mesh `SamplingParams`.
- `ChoiceText(tokenizer, rules).add(event)` takes a mesh `TokenEvent` of this choice and returns the text newly safe
  to emit. Stop strings follow `engine.formats.stop.StopMatcher` (the engine's rule: a stream holds back what may
  still become a stop string; the matched string is cut, kept with `include_stop_str`); a stop token (the
  tokenizer's EOS unless `ignore_eos`, a `stop_token_ids` entry, or the event's `stop_token_id`) that finishes the
  choice is not text. Neither applies before `min_tokens` tokens. With special tokens kept, `keep_special_ids`
  limits which special ids reach the text (the output parsers' markers; reserved tokens are dropped).
- After `add`: `token_ids` / `logprobs` of the choice so far, `text_starts` (where each token's text begins in the
  choice's text; a stop token, which adds no text, has none), `finish_reason` ("stop", "length", "abort", ...) once
  finished, `stop_reason` — the stop string or the stop token id (not EOS) that ended it, as vLLM reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.formats.stop import StopMatcher
from engine.tokenizer import IncrementalDetokenizer, KimiTokenizer
from gateway.mesh_client import TokenEvent
from protos import common_pb2


@dataclass(frozen=True)
class TextRules:
    """How a choice's tokens become text: stop strings and tokens, special tokens."""

    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # With special tokens kept (the output parsers read them): keep only these special ids in the text, drop the
    # others (reserved tokens a model may emit); None keeps every special token.
    keep_special_ids: frozenset[int] | None = None

    @classmethod
    def of(cls, sampling: common_pb2.SamplingParams, keep_special_ids: frozenset[int] | None = None) -> "TextRules":
        return cls(stop=tuple(sampling.stop), include_stop_str=sampling.include_stop_str_in_output,
                   min_tokens=sampling.min_tokens, stop_token_ids=tuple(sampling.stop_token_ids),
                   ignore_eos=sampling.ignore_eos, skip_special_tokens=sampling.skip_special_tokens,
                   keep_special_ids=None if sampling.skip_special_tokens else keep_special_ids)


class ChoiceText:
    """Detokenises one choice incrementally and applies its stop rules (see the module docstring)."""

    def __init__(self, tokenizer: KimiTokenizer, rules: TextRules):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, rules.skip_special_tokens)
        self.keep_special = rules.keep_special_ids
        self.stops = StopMatcher(rules.stop, rules.include_stop_str)
        self.min_tokens = rules.min_tokens
        self.stop_ids = set(rules.stop_token_ids) | (set() if rules.ignore_eos else set(tokenizer.stop_token_ids))
        self.text = ""
        self.emitted = 0
        self.token_ids: list[int] = []
        self.text_starts: list[int] = []  # where each token's text begins in `text` (stop tokens have none)
        self.logprobs: list[common_pb2.TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id (not EOS) that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> str:
        """Takes an event's tokens; returns the text newly safe to emit."""
        for i, token in enumerate(event.token_ids):
            if self.finished:
                break
            self.token_ids.append(token)
            if i < len(event.logprobs):
                self.logprobs.append(event.logprobs[i])
            last = i == len(event.token_ids) - 1
            min_reached = len(self.token_ids) > self.min_tokens
            is_stop_token = token in self.stop_ids or token == event.stop_token_id
            if last and event.finish_reason == "stop" and is_stop_token and min_reached:
                self.finish_reason = "stop"  # a stop token: its text is not output
                if token not in self.tokenizer.stop_token_ids:
                    self.stop_reason = token
                break
            self._push(token, min_reached)
        if event.finish_reason is not None and not self.finished:
            if event.finish_reason != "stop":
                self.text += self.detok.finish()
            self.finish_reason = event.finish_reason
        visible = self.stops.visible_end(len(self.text), self.emitted, self.finished)
        delta = self.text[self.emitted:visible]
        self.emitted = max(self.emitted, visible)
        return delta

    def _push(self, token: int, min_reached: bool) -> None:
        """Appends a token's text (unless it is a dropped special token) and looks for a stop string."""
        before = len(self.text)
        self.text_starts.append(before)
        if self.keep_special is None or token in self.keep_special or not self.tokenizer.is_special(token):
            self.text += self.detok.push(token)
        if self.stops and min_reached:
            self.text, stop = self.stops.cut(self.text, before)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
