"""Transport-neutral events of a run: what the REST and gRPC fronts turn into SSE chunks, JSON bodies or messages.

Contract:
- Chat (`ChatEvent`): the first event of each choice has `role="assistant"`; then parser deltas (reasoning,
  content, tool-call fragments, in order), token logprobs attached to the next event of their choice, and a last
  event per choice with `finish_reason` ("stop", "length", "tool_calls" when the turn ended with parsed calls,
  "abort") and `stop_reason` (the stop string or stop token id, vLLM's field).
- Completions (`CompletionEvent`): text deltas with their token ids and logprobs, `text_offset` (characters of the
  choice sent before) and `logprob_offset` (the text offset of the first token in `logprobs`: after an echoed
  prompt), the finish reason on a choice's last event.
- Token counts of a whole request are the mesh's one `Usage` type, the `Usage` message of protos/common.proto (the
  decode worker sends it, runs count in it, REST, gRPC and the SDK report it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.parsers import DeltaMessage
from protos import common_pb2


@dataclass
class ChatEvent:
    """Something new in one chat choice."""

    index: int
    role: str | None = None  # "assistant" on the first event of a choice
    deltas: list[DeltaMessage] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # on the last event of a choice
    stop_reason: str | int | None = None


@dataclass
class CompletionEvent:
    """Something new in one completion choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters of this choice sent before `text`
    logprob_offset: int = 0  # text offset of the first token in `logprobs` (after an echoed prompt)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # on a choice's first event when prompt logprobs were asked (echo + logprobs, or prompt_logprobs): the prompt
    # and the logprobs of its tokens 2..N
    prompt: "PromptLogprobs | None" = None


@dataclass(frozen=True)
class PromptLogprobs:
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]  # tokens 2..N (the first has none)

