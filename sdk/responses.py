"""Protos of `protos/gateway.proto` -> the SDK's typed values: streamed chunks, whole responses, models.

Contract: `chat_chunk` / `completion_chunk` map one stream message; `ChatAccumulator` / `CompletionAccumulator` fold
a stream into the whole `ChatCompletion` / `Completion` a non-streaming call returns (the last chunk's header and
usage, each choice's text, tool-call fragments and logprobs in order, its finish); `model_of` maps a model card.
"""

from __future__ import annotations

from protos import common_pb2, gateway_pb2
from sdk.types import (ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatMessage, Completion,
                       CompletionChoice, CompletionChunk, CompletionChunkChoice, Logprob, Model, ToolCall,
                       ToolCallDelta, Usage)

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls", common_pb2.FINISH_REASON_ABORT: "abort",
                common_pb2.FINISH_REASON_ERROR: "error"}


def _usage(msg) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    usage = Usage()
    usage.CopyFrom(msg.usage)
    return usage


def _logprob(entry: gateway_pb2.LogprobEntry) -> Logprob:
    return Logprob(entry.token, entry.token_bytes, entry.token_id, entry.logprob,
                   tuple(_logprob(t) for t in entry.top_logprobs))


def chat_chunk(msg: gateway_pb2.ChatResponse) -> ChatChunk:
    choices = tuple(ChatChunkChoice(
        index=c.index, role=c.delta.role or None, content=c.delta.content,
        reasoning_content=c.delta.reasoning_content,
        tool_calls=tuple(ToolCallDelta(t.index, t.id or None, t.name or None, t.arguments) for t in c.delta.tool_calls),
        logprobs=tuple(_logprob(lp) for lp in c.logprobs), finish_reason=FINISH_NAMES.get(c.finish_reason),
        stop_reason=c.stop_reason or None) for c in msg.choices)
    return ChatChunk(msg.id, msg.model, msg.created, choices, _usage(msg))


def completion_chunk(msg: gateway_pb2.GenerateResponse) -> CompletionChunk:
    choices = tuple(CompletionChunkChoice(
        index=c.index, text=c.text, token_ids=tuple(c.token_ids), logprobs=tuple(_logprob(lp) for lp in c.logprobs),
        finish_reason=FINISH_NAMES.get(c.finish_reason), stop_reason=c.stop_reason or None) for c in msg.choices)
    return CompletionChunk(msg.id, msg.model, msg.created, choices, _usage(msg))


class _Accumulator:
    """Folds chunks into a whole response: the last chunk's header and usage, each choice's pieces in order and its
    finish; a subclass says how a choice starts (`_new`) and takes a chunk's piece (`_fold`)."""

    whole: type

    def __init__(self) -> None:
        self.id, self.model, self.created = "", "", 0
        self.usage: Usage | None = None
        self._choices: dict = {}

    def add(self, chunk: ChatChunk | CompletionChunk) -> None:
        self.id, self.model, self.created = chunk.id, chunk.model, chunk.created
        if chunk.usage is not None:
            self.usage = chunk.usage
        for c in chunk.choices:
            if c.index not in self._choices:
                self._choices[c.index] = self._new(c.index)
            choice = self._choices[c.index]
            self._fold(choice, c)
            choice.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

    def _new(self, index: int):
        raise NotImplementedError

    def _fold(self, choice, piece) -> None:
        raise NotImplementedError

    def result(self):
        return self.whole(self.id, self.model, self.created, [c for _, c in sorted(self._choices.items())],
                          self.usage)


class ChatAccumulator(_Accumulator):
    """Folds chat chunks into a `ChatCompletion` (what a non-streaming call returns)."""

    whole = ChatCompletion

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[int, dict[int, dict]] = {}

    def _new(self, index: int) -> ChatChoice:
        return ChatChoice(index, ChatMessage())

    def _fold(self, choice: ChatChoice, c: ChatChunkChoice) -> None:
        choice.message.content += c.content
        choice.message.reasoning_content += c.reasoning_content
        for t in c.tool_calls:
            call = self._calls.setdefault(c.index, {}).setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = t.id or call["id"]
            call["name"] = t.name or call["name"]
            call["arguments"] += t.arguments

    def result(self) -> ChatCompletion:
        for index, calls in self._calls.items():
            self._choices[index].message.tool_calls = [ToolCall(c["id"], c["name"], c["arguments"])
                                                       for _, c in sorted(calls.items())]
        return super().result()


class CompletionAccumulator(_Accumulator):
    """Folds completion chunks into a `Completion`."""

    whole = Completion

    def _new(self, index: int) -> CompletionChoice:
        return CompletionChoice(index)

    def _fold(self, choice: CompletionChoice, c: CompletionChunkChoice) -> None:
        choice.text += c.text
        choice.token_ids.extend(c.token_ids)


def model_of(card: gateway_pb2.ModelCard) -> Model:
    return Model(card.id, card.owned_by, card.created, card.max_model_len, card.root, card.family)
