"""The kdamesh gRPC clients: `Client` (blocking) and `AsyncClient` (asyncio), over `kdamesh.v1.Generation`.

Contract (both clients):
- `Client(target, api_key=None, timeout=600.0, retry=RetryPolicy(), credentials=None)`: `target` is the gateway's
  gRPC address (`host:port`); `api_key` is sent as `authorization: Bearer <key>` metadata; `credentials` (a
  `grpc.ChannelCredentials`) makes the channel TLS, else it is plaintext. Use as a context manager or `close()`.
- Every call takes `timeout` (seconds; None: the client's default): one deadline for the whole call, retries
  included; a call past it raises `DeadlineExceeded`.
- Retries: a call that fails with UNAVAILABLE before any response arrived is retried up to
  `retry.max_attempts` attempts in all, with exponential backoff and jitter, within the deadline. A stream that
  already yielded a chunk is never retried (the tokens are not idempotent); its error is raised.
- Errors are `sdk.errors.KdameshError` subclasses (`InvalidRequest`, `Unauthenticated`, `NotFound`,
  `RateLimited`, `Unavailable`, `DeadlineExceeded`, ...).
- `chat(...)` / `generate(...)` return a whole `ChatCompletion` / `Completion`; `chat_stream(...)` /
  `generate_stream(...)` return an iterator (async iterator) of `ChatChunk` / `CompletionChunk`. Closing a stream
  early (`close()` / `aclose()`, leaving a `with`/`async with` block, garbage collection) cancels the call, which
  aborts the request in the mesh.
- `models()`, `tokenize(...)`, `detokenize(...)` mirror `/v1/models`, `/tokenize`, `/detokenize`.
- `AsyncClient` has the same methods; each returns an awaitable of what `Client`'s returns (the streams: async
  iterators). Both are written once (`_Api`: what each call sends and how its replies map); a client only says
  how a call runs (`_unary`, `_stream`, `_collect`: blocking or asyncio).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from protos import gateway_pb2, gateway_pb2_grpc
from sdk.errors import KdameshError, from_rpc_error
from sdk.requests import chat_request, generate_request, message_proto, tool_proto
from sdk.responses import ChatAccumulator, CompletionAccumulator, chat_chunk, completion_chunk, model_of
from sdk.types import ChatOptions, RetryPolicy, Sampling

DEFAULT_TIMEOUT_S = 600.0
MAX_MESSAGE_BYTES = 16 << 20
_UNSET: Any = object()
Messages = Iterable[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None
JsonObject = Mapping[str, Any] | None


@dataclass(frozen=True)
class _Call:
    """One API call: the stub method, its request, and how a response message maps to what the caller gets."""

    method: str
    request: Any
    reply: Callable[[Any], Any]


class _Attempt:
    """One attempt of a call within its deadline; `retry_wait` decides whether another follows."""

    def __init__(self, number: int, deadline: float | None, retry: RetryPolicy, rng: random.Random):
        self.number, self.deadline, self.retry, self.rng = number, deadline, retry, rng
        self.received = False  # a response arrived: the call is never retried

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    def retry_wait(self, error: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt; raises the SDK error when there is none."""
        if not self.received and error.code() == grpc.StatusCode.UNAVAILABLE and \
                self.number < self.retry.max_attempts:
            wait = self.retry.backoff(self.number, self.rng.random())
            if self.deadline is None or time.monotonic() + wait < self.deadline:
                return wait
        raise from_rpc_error(error) from None

    def relay(self, stream: Iterator, reply: Callable[[Any], Any]) -> Iterator:
        """The mapped messages of a blocking stream; the call is cancelled when the iteration ends."""
        try:
            for message in stream:
                self.received = True
                yield reply(message)
        finally:
            stream.cancel()


def _models(reply: gateway_pb2.ListModelsResponse) -> list:
    return [model_of(card) for card in reply.models]


class _Api:
    """The API of both clients (see the module contract); a subclass runs the calls."""

    def __init__(self, target: str, api_key: str | None, timeout: float | None, retry: RetryPolicy):
        self.target = target
        self._api_key = api_key
        self.timeout = timeout
        self.retry = retry
        self._random = random.Random()
        self._stub: gateway_pb2_grpc.GenerationStub | None = None

    def _attempts(self, timeout: float | None) -> Iterator[_Attempt]:
        timeout = self.timeout if timeout is _UNSET else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        return (_Attempt(n, deadline, self.retry, self._random) for n in range(1, self.retry.max_attempts + 1))

    def _invoke(self, call: _Call, attempt: _Attempt):
        metadata = (("authorization", f"Bearer {self._api_key}"),) if self._api_key else ()
        return getattr(self._stub, call.method)(call.request, timeout=attempt.timeout(), metadata=metadata)

    def _unary(self, call: _Call, timeout: float | None):
        raise NotImplementedError

    def _stream(self, call: _Call, timeout: float | None):
        raise NotImplementedError

    def _collect(self, stream, accumulator):
        raise NotImplementedError

    # -- the API -----------------------------------------------------------------------------------------------

    def models(self, *, timeout: float | None = _UNSET):
        """The served models (`list[Model]`)."""
        return self._unary(_Call("ListModels", gateway_pb2.ListModelsRequest(), _models), timeout)

    def chat_stream(self, model: str, messages: Messages, *, sampling: Sampling | None = None, tools: Tools = None,
                    tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                    response_format: JsonObject = None, chat_template_kwargs: JsonObject = None,
                    add_generation_prompt: bool = True, cache_salt: str | None = None, user: str | None = None,
                    priority: int = 0, request_id: str | None = None, timeout: float | None = _UNSET):
        """Streams `ChatChunk`s; close the iterator to cancel the request."""
        options = ChatOptions(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                              response_format=response_format, chat_template_kwargs=chat_template_kwargs,
                              add_generation_prompt=add_generation_prompt)
        request = chat_request(model, messages, sampling or Sampling(), options, cache_salt, user, priority,
                               request_id)
        return self._stream(_Call("Chat", request, chat_chunk), timeout)

    def chat(self, model: str, messages: Messages, *, sampling: Sampling | None = None, tools: Tools = None,
             tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
             response_format: JsonObject = None, chat_template_kwargs: JsonObject = None,
             add_generation_prompt: bool = True, cache_salt: str | None = None, user: str | None = None,
             priority: int = 0, request_id: str | None = None, timeout: float | None = _UNSET):
        """The whole `ChatCompletion` (the stream, folded)."""
        stream = self.chat_stream(model, messages, sampling=sampling, tools=tools, tool_choice=tool_choice,
                                  parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                                  chat_template_kwargs=chat_template_kwargs,
                                  add_generation_prompt=add_generation_prompt, cache_salt=cache_salt, user=user,
                                  priority=priority, request_id=request_id, timeout=timeout)
        return self._collect(stream, ChatAccumulator())

    def generate_stream(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                        echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                        user: str | None = None, priority: int = 0, request_id: str | None = None,
                        timeout: float | None = _UNSET):
        """Streams `CompletionChunk`s; close the iterator to cancel the request."""
        request = generate_request(model, prompt, sampling or Sampling(), echo, return_token_ids, cache_salt, user,
                                   priority, request_id)
        return self._stream(_Call("Generate", request, completion_chunk), timeout)

    def generate(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                 echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                 user: str | None = None, priority: int = 0, request_id: str | None = None,
                 timeout: float | None = _UNSET):
        """The whole `Completion` (the stream, folded)."""
        stream = self.generate_stream(model, prompt, sampling=sampling, echo=echo, return_token_ids=return_token_ids,
                                      cache_salt=cache_salt, user=user, priority=priority, request_id=request_id,
                                      timeout=timeout)
        return self._collect(stream, CompletionAccumulator())

    def tokenize(self, model: str, *, prompt: str | None = None, messages: Messages | None = None,
                 add_generation_prompt: bool = True, tools: Tools = None, chat_template_kwargs: JsonObject = None,
                 timeout: float | None = _UNSET):
        """The prompt's token ids (`list[int]`): a text as /v1/completions reads it, or a rendered chat."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        request = gateway_pb2.TokenizeRequest(
            model=model, add_special_tokens=True, add_generation_prompt=add_generation_prompt,
            tools=[tool_proto(t) for t in tools or ()],
            chat_template_kwargs_json=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "")
        if prompt is not None:
            request.prompt = prompt
        else:
            request.messages.CopyFrom(gateway_pb2.ChatMessages(messages=[message_proto(m) for m in messages]))
        return self._unary(_Call("Tokenize", request, lambda reply: list(reply.token_ids)), timeout)

    def detokenize(self, model: str, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = _UNSET):
        """The text of these token ids (`str`)."""
        request = gateway_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens)
        return self._unary(_Call("Detokenize", request, lambda reply: reply.text), timeout)


class Client(_Api):
    """Blocking client; see the module contract."""

    def __init__(self, target: str, *, api_key: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy = RetryPolicy(), credentials: grpc.ChannelCredentials | None = None):
        super().__init__(target, api_key, timeout, retry)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.secure_channel(target, credentials, options) if credentials is not None else \
            grpc.insecure_channel(target, options)
        self._stub = gateway_pb2_grpc.GenerationStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, call: _Call, timeout: float | None):
        for attempt in self._attempts(timeout):
            try:
                return call.reply(self._invoke(call, attempt))
            except grpc.RpcError as error:
                time.sleep(attempt.retry_wait(error))

    def _stream(self, call: _Call, timeout: float | None) -> Iterator:
        for attempt in self._attempts(timeout):
            try:
                yield from attempt.relay(self._invoke(call, attempt), call.reply)
                return
            except grpc.RpcError as error:
                time.sleep(attempt.retry_wait(error))

    def _collect(self, stream: Iterator, accumulator):
        for chunk in stream:
            accumulator.add(chunk)
        return accumulator.result()


class AsyncClient(_Api):
    """asyncio client (grpc.aio); the same API as `Client` with `await` / `async for`. Create it inside the event
    loop that uses it."""

    def __init__(self, target: str, *, api_key: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy = RetryPolicy(), credentials: grpc.ChannelCredentials | None = None):
        super().__init__(target, api_key, timeout, retry)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.aio.secure_channel(target, credentials, options) if credentials is not None else \
            grpc.aio.insecure_channel(target, options)
        self._stub = gateway_pb2_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, call: _Call, timeout: float | None):
        for attempt in self._attempts(timeout):
            try:
                return call.reply(await self._invoke(call, attempt))
            except grpc.RpcError as error:
                await asyncio.sleep(attempt.retry_wait(error))

    async def _stream(self, call: _Call, timeout: float | None) -> AsyncIterator:
        for attempt in self._attempts(timeout):
            stream = self._invoke(call, attempt)
            try:
                async for message in stream:
                    attempt.received = True
                    yield call.reply(message)
                return
            except grpc.RpcError as error:
                wait = attempt.retry_wait(error)
            finally:
                stream.cancel()
            await asyncio.sleep(wait)

    async def _collect(self, stream: AsyncIterator, accumulator):
        try:
            async for chunk in stream:
                accumulator.add(chunk)
        finally:
            await stream.aclose()
        return accumulator.result()


__all__ = ["AsyncClient", "Client", "KdameshError"]
