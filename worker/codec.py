"""Conversions between the wire contract (`protos`) and the engine's request types, for the worker services.

Contract: pure functions, no I/O. `generation_from_proto(msg, deadline)` decodes a `GenerationRequest` (the request
both `PrefillRequest` and `DecodeRequest` embed) into the one `GenerationJob` both workers run: the prompt (at least
one token, else `InvalidRequestError`), the engine's `SamplingParams`, the tenant salt, the tenant's fair share
(`tenant_from_proto`: name and weight, `InvalidRequestError` for a bad one), media, priority, structure hints and
the call's deadline. A new per-request field is decoded here once. `sampling_from_proto` raises
`InvalidRequestError` for values out of range (proto3 defaults mean vLLM's defaults); `structured_from_proto` raises
it for an unusable structured-output spec;
`output_chunk` turns one engine delta of a choice into the `DecodeChunk` the decode worker streams (the one
worker -> gateway output event: tokens, logprobs with the top `top`, finish reason, stop token id); `extend_chunk`
appends a choice's next chunk to it (a non-streamed request's held-back tokens, `output_interval_ms`).
`logprob_to_proto` keeps the sampled token and its top `top` alternatives (`prompt_logprobs_to_proto` does so for
every prompt position but the first, with the token's rank); `FINISH_REASONS` maps the engine's finish reasons to
the proto enum. `media_from_proto` turns a request's `MediaItem`s into the engine's `ImageInput`s (content hash
checked to be 32 bytes; the engine checks the spans and decodes the bytes). The worker services (prefill_service,
decode_service) share it through this
package; `cache_service` and `sdk` depend on the generated messages alone and never import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.fair_share import TenantShare
from engine.outputs import PositionLogprobs
from engine.sampling import SamplingParams
from engine.vision.feed import ImageInput
from engine.structured import (DEFAULT_MAX_REASONING_TOKENS, DEFAULT_MAX_STRING_TOKENS, StructuredOutputParams,
                               ToolSpec)
from protos import common_pb2, decode_pb2

FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
                  "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


@dataclass(frozen=True)
class GenerationJob:
    """One generation request as a worker runs it (decoded from `GenerationRequest`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # the request's own parameters (prefill samples one token of them)
    tenant_salt: bytes = b""
    tenant: TenantShare = TenantShare()  # whom it runs for in the engine's fair share (engine/fair_share.py)
    priority: int = 0
    media: tuple[ImageInput, ...] = ()  # the prompt's images, in token order
    snapshot_hints: tuple[int, ...] = ()  # prompt token positions to snapshot the KDA state at (protos/common.proto)
    deadline: float | None = None  # time.monotonic() seconds; None: no deadline
    output_interval_s: float = 0.0  # decode: hold a non-streamed choice's tokens back this long (0: send each)


def generation_from_proto(msg: common_pb2.GenerationRequest, deadline: float | None) -> GenerationJob:
    """Raises InvalidRequestError for an empty prompt or any invalid field."""
    prompt = tuple(msg.prompt.ids)
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return GenerationJob(request_id=msg.request_id, prompt_token_ids=prompt, params=sampling_from_proto(msg.sampling),
                         tenant_salt=msg.tenant_salt, tenant=tenant_from_proto(msg.tenant), priority=msg.priority,
                         media=media_from_proto(msg.media), snapshot_hints=tuple(msg.snapshot_hints),
                         deadline=deadline, output_interval_s=msg.output_interval_ms / 1000)


MAX_TENANT_NAME = 128


def tenant_from_proto(msg: common_pb2.TenantShare) -> TenantShare:
    """The engine's `TenantShare` (an empty name: None; weight 0: 1); raises InvalidRequestError for a name over
    `MAX_TENANT_NAME` characters or with control characters, or a weight that is negative or not finite."""
    name = msg.name
    if len(name) > MAX_TENANT_NAME or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidRequestError(f"tenant.name must be at most {MAX_TENANT_NAME} printable characters",
                                  param="tenant")
    return TenantShare(name or None, msg.weight if msg.weight != 0 else 1.0)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for values out of range (proto3 defaults mean vLLM's defaults)."""
    return SamplingParams(
        n=msg.n or 1, max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, min_tokens=msg.min_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0, top_k=msg.top_k if msg.HasField("top_k") else 0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0, seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logprobs=msg.top_logprobs if msg.logprobs else None, skip_special_tokens=msg.skip_special_tokens,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=dict(msg.logit_bias) or None,
        structured=structured_from_proto(msg.structured_output) if msg.HasField("structured_output") else None)


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputParams:
    """The engine's structured-output params; raises InvalidRequestError for an unusable spec."""
    def load(text: str, what: str, param: str):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"{what} is not valid JSON: {exc}", param=param) from None

    kind = {common_pb2.StructuredOutput.KIND_JSON_OBJECT: "json_object",
            common_pb2.StructuredOutput.KIND_JSON_SCHEMA: "json_schema",
            common_pb2.StructuredOutput.KIND_TOOL_CALL: "tool_call",
            common_pb2.StructuredOutput.KIND_TEXT: "text"}.get(msg.kind)
    if kind is None:
        raise InvalidRequestError("structured_output.kind is unspecified", param="response_format")
    tools = tuple(ToolSpec(t.name, load(t.parameters_json, f"tool {t.name!r} parameters", "tools")
                           if t.parameters_json else None) for t in msg.tools)
    named = msg.tool_mode == common_pb2.StructuredOutput.TOOL_MODE_NAMED

    def limit(field: str, default):
        if not msg.HasField(field):
            return default
        value = getattr(msg, field)
        return None if value < 0 else value

    return StructuredOutputParams(
        kind, json_schema=load(msg.json_schema, "json_schema", "response_format") if kind == "json_schema" else None,
        tools=tools, mode="named" if named else "required", name=msg.tool_name if named else None,
        parallel_tool_calls=msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True,
        output_format=msg.output_format or None, starts_in_reasoning=msg.starts_in_reasoning,
        max_reasoning_tokens=limit("max_reasoning_tokens", DEFAULT_MAX_REASONING_TOKENS),
        max_string_tokens=limit("max_string_tokens", DEFAULT_MAX_STRING_TOKENS))


def output_chunk(index: int, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
                 finish_reason: str | None, stop_reason: int | str | None, top: int) -> decode_pb2.DecodeChunk:
    """One choice's new tokens as a `DecodeChunk`; with finish "stop" by a token, its id (`stop_token_id`)."""
    chunk = decode_pb2.DecodeChunk(index=index, token_ids=token_ids, finish_reason=FINISH_REASONS[finish_reason])
    if logprobs:
        chunk.logprobs.extend(logprob_to_proto(e, t, top) for e, t in zip(logprobs, token_ids))
    if finish_reason == "stop" and not isinstance(stop_reason, str):
        stop_id = stop_reason if isinstance(stop_reason, int) else (token_ids[-1] if token_ids else None)
        if stop_id is not None:
            chunk.stop_token_id = stop_id
    return chunk


def extend_chunk(chunk: decode_pb2.DecodeChunk, later: decode_pb2.DecodeChunk) -> None:
    """Appends `later` (the same choice's next chunk, never the stream's first: that one goes at once) to `chunk`:
    its tokens and logprobs, and its finish reason and stop token id when it ends the choice."""
    chunk.token_ids.extend(later.token_ids)
    chunk.logprobs.extend(later.logprobs)
    if later.finish_reason:
        chunk.finish_reason = later.finish_reason
    if later.HasField("stop_token_id"):
        chunk.stop_token_id = later.stop_token_id


def logprob_to_proto(entries: PositionLogprobs, token_id: int, top: int) -> common_pb2.TokenLogprob:
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank <= top)
    return common_pb2.TokenLogprob(token_id=token_id, logprob=entries[token_id].logprob,
                                   top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for _, t, v in ranked])


def prompt_logprobs_to_proto(prompt_logprobs: list[PositionLogprobs | None] | None, prompt: list[int],
                             top: int) -> list[common_pb2.TokenLogprob]:
    """The engine's prompt logprobs (None first) as the proto's positions 2..N, each with its token's rank."""
    if not prompt_logprobs:
        return []
    out = []
    for token, entries in zip(prompt[1:], prompt_logprobs[1:]):
        msg = logprob_to_proto(entries, token, top)
        msg.rank = entries[token].rank
        out.append(msg)
    return out


def media_from_proto(items) -> tuple[ImageInput, ...]:
    """`MediaItem`s -> `ImageInput`s, in token order; raises InvalidRequestError for a hash that is not sha256."""
    out = []
    for n, item in enumerate(items):
        if len(item.content_hash) != 32:
            raise InvalidRequestError(f"media[{n}].content_hash must be 32 bytes (sha256)", param="messages")
        out.append(ImageInput(item.token_offset, item.num_tokens, item.content_hash, item.data))
    return tuple(sorted(out, key=lambda m: m.offset))
