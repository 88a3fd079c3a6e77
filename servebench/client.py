"""Streaming requests to an OpenAI-compatible server (httpx, asyncio), timed the way `vllm bench serve` times them.

- `SSEDecoder`: bytes in, complete Server-Sent Event `data` payloads out (UTF-8 split across reads, `\\r\\n`, comment
  lines, multi-line data, a last event without its blank line).
- `request_completions` (`/v1/completions`, backend `openai`) and `request_chat_completions`
  (`/v1/chat/completions`, backend `openai-chat`) send one streamed request with `stream_options.include_usage` and
  return a `RequestOutput`: TTFT at the first chunk with a choice, one ITL per later chunk with a choice, the latency
  at the last chunk with a choice (a trailing usage-only chunk does not extend it), output/prompt token counts and
  cached tokens from the usage chunk. A non-200 status, an `error` event in the stream, a stream without any choice
  or a transport error marks the request failed with the reason in `error`.
- The payloads are vLLM's: completions send `model, prompt, repetition_penalty: 1.0, max_tokens, logprobs, stream,
  stream_options` (+ `ignore_eos` when set, + `--extra-body`); chat sends `model, messages, max_completion_tokens,
  stream, stream_options` (+ the same). `OPENAI_API_KEY`, when set, is sent as a bearer token.
"""

from __future__ import annotations

import codecs
import json
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from servebench.metrics import RequestOutput

TIMEOUT_S = 6 * 60 * 60


class SSEDecoder:
    """Incremental Server-Sent Events parser; `feed(bytes)` returns the data of each event completed so far."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""  # text of the current, unfinished line
        self._data: list[str] = []  # data lines of the current event
        self._cr = False  # the last character seen was \r (a following \n belongs to the same line break)

    def feed(self, chunk: bytes) -> list[str]:
        return self._consume(self._utf8.decode(chunk))

    def flush(self) -> list[str]:
        """The end of the stream: a final event without its blank line still counts."""
        events = self._consume(self._utf8.decode(b"", final=True))
        if self._line:
            self._field(self._line)
            self._line = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _consume(self, text: str) -> list[str]:
        events: list[str] = []
        start = 0
        for i, ch in enumerate(text):
            if ch not in "\r\n":
                self._cr = False
                continue
            if ch == "\n" and self._cr:  # the \n of a \r\n pair
                self._cr = False
                start = i + 1
                continue
            self._cr = ch == "\r"
            line, self._line = self._line + text[start:i], ""
            start = i + 1
            if line:
                self._field(line)
            elif self._data:
                events.append("\n".join(self._data))
                self._data = []
        self._line += text[start:]
        return events

    def _field(self, line: str) -> None:
        if line.startswith(":"):
            return  # a comment (keep-alive ping)
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass
class RequestInput:
    """One request to send (vLLM's `RequestFuncInput`, the fields used here)."""

    prompt: str | list[int] | list[dict]
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    extra_body: dict | None = None
    extra_headers: dict | None = None
    request_id: str | None = None


def _headers(inp: RequestInput) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if inp.extra_headers:
        headers.update(inp.extra_headers)
    if inp.request_id:
        headers["x-request-id"] = inp.request_id
    return headers


def _common(payload: dict, inp: RequestInput) -> dict:
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.extra_body:
        payload.update(inp.extra_body)
    return payload


def completions_payload(inp: RequestInput) -> dict:
    return _common({"model": inp.model_name or inp.model, "prompt": inp.prompt, "repetition_penalty": 1.0,
                    "max_tokens": inp.output_len, "logprobs": inp.logprobs, "stream": True,
                    "stream_options": {"include_usage": True}}, inp)


def chat_messages(prompt: str | list) -> list[dict]:
    """A prompt as chat messages: a list of messages as is, anything else as one user message."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return prompt
    return [{"role": "user", "content": prompt}]


def chat_payload(inp: RequestInput) -> dict:
    return _common({"model": inp.model_name or inp.model, "messages": chat_messages(inp.prompt),
                    "max_completion_tokens": inp.output_len, "stream": True,
                    "stream_options": {"include_usage": True}}, inp)


def _completion_text(choice: dict) -> str:
    return choice.get("text") or ""


def _chat_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    # reasoning models stream their thinking separately; it is generated text all the same
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")


async def _stream(inp: RequestInput, client: httpx.AsyncClient, payload: dict,
                  text_of: Callable[[dict], str]) -> RequestOutput:
    out = RequestOutput(prompt_len=inp.prompt_len)
    pieces: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    last = st
    first = False
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=_headers(inp)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {response.status_code} {response.reason_phrase}: {body[:1000]}"
                return out
            decoder = SSEDecoder()

            def handle(events: list[str]) -> None:
                nonlocal first, last
                for data in events:
                    if data.strip() == "[DONE]":
                        continue
                    message = json.loads(data)
                    if message.get("error") is not None:
                        error = message["error"]
                        raise _StreamError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
                    if choices := message.get("choices"):
                        now = time.perf_counter()
                        if not first:
                            first = True
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        pieces.append(text_of(choices[0]))
                    if usage := message.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            out.cached_tokens = int(details["cached_tokens"])

            async for chunk in response.aiter_bytes():
                handle(decoder.feed(chunk))
            handle(decoder.flush())
        out.generated_text = "".join(pieces)
        out.latency = last - st
        if first:
            out.success = True
        else:
            out.error = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"
    except _StreamError as exc:
        out.generated_text = "".join(pieces)
        out.error = f"error in the stream: {exc}"
    except Exception:  # noqa: BLE001 - any failure is this request's error, reported with the results
        out.error = traceback.format_exc()
    return out


class _StreamError(Exception):
    pass


async def request_completions(inp: RequestInput, client: httpx.AsyncClient) -> RequestOutput:
    if not inp.api_url.endswith(("completions", "profile")):
        raise ValueError("OpenAI Completions API URL must end with 'completions'.")
    return await _stream(inp, client, completions_payload(inp), _completion_text)


async def request_chat_completions(inp: RequestInput, client: httpx.AsyncClient) -> RequestOutput:
    if not inp.api_url.endswith(("chat/completions", "profile")):
        raise ValueError("OpenAI Chat Completions API URL must end with 'chat/completions'.")
    return await _stream(inp, client, chat_payload(inp), _chat_text)


RequestFunc = Callable[[RequestInput, httpx.AsyncClient], Awaitable[RequestOutput]]

# --backend names (vLLM's): "openai" / "vllm" stream /v1/completions, "openai-chat" /v1/chat/completions.
REQUEST_FUNCS: dict[str, RequestFunc] = {"openai": request_completions, "vllm": request_completions,
                                         "openai-chat": request_chat_completions}


def request_func_for(backend: str, endpoint: str) -> RequestFunc:
    """The request function of a backend; `openai` pointed at a chat endpoint sends chat requests."""
    if backend not in REQUEST_FUNCS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(REQUEST_FUNCS)}")
    if backend != "openai-chat" and endpoint.rstrip("/").endswith("chat/completions"):
        return request_chat_completions
    return REQUEST_FUNCS[backend]


def make_client(max_concurrency: int | None, **kwargs: Any) -> httpx.AsyncClient:
    """One client for the run: connections reused, no pool limit below the benchmark's own concurrency cap."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency or 256)
    return httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, pool=None), limits=limits, trust_env=False, **kwargs)


async def fetch_first_model(base_url: str, client: httpx.AsyncClient, headers: dict | None = None) -> tuple[str, str]:
    """(id, root) of the first model at `{base_url}/v1/models` (root: the id when the server sends none)."""
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url, headers=headers)
        response.raise_for_status()
        data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"could not list the models at {url} (is the server running, is the URL right?): "
                           f"{exc}") from exc
    if not data:
        raise RuntimeError(f"no models found at {url}")
    return data[0]["id"], data[0].get("root") or data[0]["id"]
