"""The OpenAI response bodies of a run: streamed chunks and whole responses, for chat and completions.

Contract:
- `CHAT` and `COMPLETION` (`RestFormat`) say how a run's events become response bodies: `chunks(run, event)` the
  chunk bodies of one event (streaming; `chunk_object` names them), `collect(run)` the whole response (it consumes
  `run.events()`). `usage_chunk(run, fmt)` is the `choices: []` trailer of `stream_options.include_usage`.
- Chat chunks: the role (with empty content) in a choice's first delta, one chunk per parser delta (the logprobs of
  its tokens on the first), `finish_reason` (and vLLM's `stop_reason`) only in a choice's last chunk, with an empty
  delta. A chat response folds each choice's deltas into one message (`content` "" rather than null when there is
  neither content nor a tool call); reasoning appears as both `reasoning_content` and `reasoning`.
- Completion chunks: a chunk per event with text, a finish reason or (with `return_token_ids`) token ids;
  `logprobs` in the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); with `echo` they
  cover the prompt too (its first token `null`, offsets from the prompt's start).
- Prompt logprobs (vLLM's `prompt_logprobs` k): `None` then per position {token id: {logprob, rank,
  decoded_token}}, on each completion choice and at the top level of a chat response (not streamed, as vLLM).
- Every chunk carries `usage` when the client asked for usage: null until the trailer, or with vLLM's
  `continuous_usage_stats` the usage so far (the tokens of that chunk counted). Usage counts
  `prompt_tokens_details.cached_tokens` and `completion_tokens_details.reasoning_tokens` (chat: the completion
  tokens generated inside the reasoning block, as the output parser read it; 0 without a reasoning parser).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.chat_run import ChatRun
from gateway.completion_run import CompletionRun
from gateway.events import ChatEvent, CompletionEvent, PromptLogprobs
from gateway.parsers import fold
from gateway.run import Run
from protos import common_pb2


@dataclass(frozen=True)
class RestFormat:
    chunk_object: str
    chunks: Callable[[Run, object], list[dict]]
    collect: Callable[[Run], Awaitable[dict]]


def usage_dict(usage: common_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def chat_logprobs_entry(tokenizer, lp: common_pb2.TokenLogprob) -> dict:
    """One `choices[].logprobs.content[]` entry of a chat completion."""
    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.id_to_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0),
                "bytes": list(raw)}

    entry = one(lp.token_id, lp.logprob)
    entry["top_logprobs"] = [one(t.token_id, t.logprob) for t in lp.top_logprobs]
    return entry


def completion_logprobs(tokenizer, logprobs: list[common_pb2.TokenLogprob], offset: int,
                        prompt: PromptLogprobs | None = None, top: int | None = None) -> dict:
    """OpenAI completions `logprobs` for these tokens (text offsets counted from `offset`); with `prompt` (an
    echoed prompt) its tokens first — the first with `null` logprob and top — and the offsets from the prompt's
    start. `top` caps the alternatives per position."""
    rows: list[tuple[int, float | None, dict | None]] = []
    if prompt is not None and prompt.token_ids:
        rows.append((prompt.token_ids[0], None, None))
        rows.extend((lp.token_id, lp.logprob, lp.top_logprobs) for lp in prompt.logprobs)
    rows.extend((lp.token_id, lp.logprob, lp.top_logprobs) for lp in logprobs)
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, logprob, alternatives in rows:
        piece = tokenizer.decode([token_id])
        tokens.append(piece)
        token_lps.append(logprob)
        tops.append(None if alternatives is None else
                    {tokenizer.decode([t.token_id]): t.logprob for t in list(alternatives)[:top]})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, prompt: PromptLogprobs, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: `None`, then per prompt position {token id: {logprob, rank, decoded_token}} with
    the prompt token and the `top` most likely ones."""
    out: list[dict | None] = [None]
    for lp in prompt.logprobs:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": tokenizer.decode([t.token_id])}
                 for rank, t in enumerate(list(lp.top_logprobs)[:top], start=1)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": lp.rank,
                                            "decoded_token": tokenizer.decode([lp.token_id])})
        out.append(entry)
    return out


def _chunk(run: Run, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
    body = {"id": run.id, "object": obj, "created": run.created, "model": run.model, "choices": choices}
    if run.include_usage:
        body["usage"] = usage if usage is not None or not run.continuous_usage else usage_dict(run.usage())
    return body


def usage_chunk(run: Run, fmt: RestFormat) -> dict:
    return _chunk(run, fmt.chunk_object, [], usage_dict(run.usage()))


def _response(run: Run, obj: str, choices: list[dict]) -> dict:
    return {"id": run.id, "object": obj, "created": run.created, "model": run.model, "choices": choices,
            "usage": usage_dict(run.usage())}


# -- chat --------------------------------------------------------------------------------------------------------


def chat_chunks(run: ChatRun, event: ChatEvent) -> list[dict]:
    tokenizer, obj = run.context.tokenizer, CHAT.chunk_object
    logprobs = {"content": [chat_logprobs_entry(tokenizer, lp) for lp in event.logprobs]} if event.logprobs else None

    def choice(delta: dict, lp, finish: str | None = None) -> dict:
        out = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = event.stop_reason
        return out

    if event.role is not None:
        return [_chunk(run, obj, [choice({"role": event.role, "content": ""}, logprobs)])]
    chunks = []
    for delta in event.deltas:
        chunks.append(_chunk(run, obj, [choice(delta.to_openai(), logprobs)]))
        logprobs = None
    if event.finish_reason is not None:
        chunks.append(_chunk(run, obj, [choice({}, logprobs, event.finish_reason)]))
    return chunks


async def collect_chat(run: ChatRun) -> dict:
    deltas: dict[int, list] = {c.index: [] for c in run.choices}
    logprobs: dict[int, list] = {c.index: [] for c in run.choices}
    finish: dict[int, tuple] = {}
    tokenizer = run.context.tokenizer
    async for event in run.events():
        deltas[event.index].extend(event.deltas)
        logprobs[event.index].extend(chat_logprobs_entry(tokenizer, lp) for lp in event.logprobs)
        if event.finish_reason is not None:
            finish[event.index] = (event.finish_reason, event.stop_reason)
    choices = []
    for index in sorted(deltas):
        message = fold(deltas[index]).to_openai_message()
        if message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
        reason, stop_reason = finish.get(index, ("abort", None))
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": logprobs[index]} if run.plan.request.logprobs else None,
                        "finish_reason": reason, "stop_reason": stop_reason})
    body = {**_response(run, "chat.completion", choices), "system_fingerprint": None}
    top = run.plan.request.prompt_logprobs
    if top is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(
            tokenizer, PromptLogprobs(list(run.plan.prompt_ids), run.prompt_logprobs), top)
    return body


# -- completions -------------------------------------------------------------------------------------------------


def _echoed(request, prompt: PromptLogprobs | None) -> PromptLogprobs | None:
    """The prompt part of an echoed completion's `logprobs` (None: none to show)."""
    return prompt if request.echo and request.logprobs is not None else None


def completion_chunks(run: CompletionRun, ev: CompletionEvent) -> list[dict]:
    request = run.job.request
    if not (ev.text or ev.finish_reason is not None or (request.return_token_ids and ev.token_ids)):
        return []
    echoed = _echoed(request, ev.prompt)
    logprobs = completion_logprobs(run.context.tokenizer, ev.logprobs, ev.text_offset if echoed else ev.logprob_offset,
                                   echoed, request.logprobs) if request.logprobs is not None else None
    choice = {"index": ev.index, "text": ev.text, "logprobs": logprobs, "finish_reason": ev.finish_reason,
              "stop_reason": ev.stop_reason}
    if request.return_token_ids:
        choice["token_ids"] = ev.token_ids
    if request.prompt_logprobs is not None and ev.prompt is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(run.context.tokenizer, ev.prompt, request.prompt_logprobs)
    return [_chunk(run, COMPLETION.chunk_object, [choice])]


async def collect_completion(run: CompletionRun) -> dict:
    request, tokenizer = run.job.request, run.context.tokenizer
    texts = {i: "" for i in run.choices}
    lps: dict[int, list] = {i: [] for i in run.choices}
    offsets = {i: 0 for i in run.choices}
    prompts: dict[int, PromptLogprobs] = {}
    finish: dict[int, tuple] = {}
    async for ev in run.events():
        if ev.prompt is not None:
            prompts[ev.index] = ev.prompt
        if not texts[ev.index] and ev.logprob_offset and _echoed(request, ev.prompt) is None:
            offsets[ev.index] = ev.logprob_offset
        texts[ev.index] += ev.text
        lps[ev.index].extend(ev.logprobs)
        if ev.finish_reason is not None:
            finish[ev.index] = (ev.finish_reason, ev.stop_reason)
    choices = []
    for index in sorted(texts):
        logprobs = completion_logprobs(tokenizer, lps[index], offsets[index], _echoed(request, prompts.get(index)),
                                       request.logprobs) if request.logprobs is not None else None
        reason, stop_reason = finish.get(index, ("abort", None))
        choice = {"index": index, "text": texts[index], "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stop_reason}
        if request.return_token_ids:
            choice["token_ids"] = list(run.choices[index].token_ids)
        if request.prompt_logprobs is not None and index in prompts:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompts[index], request.prompt_logprobs)
        choices.append(choice)
    return _response(run, "text_completion", choices)


CHAT = RestFormat("chat.completion.chunk", chat_chunks, collect_chat)
COMPLETION = RestFormat("text_completion", completion_chunks, collect_completion)
