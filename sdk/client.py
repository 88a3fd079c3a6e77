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
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from protos import gateway_pb2, gateway_pb2_grpc
from sdk.errors import KdameshError, from_rpc_error
from sdk.types import (ChatAccumulator, ChatChunk, ChatCompletion, ChatOptions, Completion, CompletionAccumulator,
                       CompletionChunk, Model, RetryPolicy, Sampling, chat_chunk, chat_request, completion_chunk,
                       generate_request, message_proto, model_of, tool_proto)

DEFAULT_TIMEOUT_S = 600.0
MAX_MESSAGE_BYTES = 16 << 20
_UNSET: Any = object()


class _Base:
    def __init__(self, target: str, api_key: str | None, timeout: float | None, retry: RetryPolicy):
        self.target = target
        self._api_key = api_key
        self.timeout = timeout
        self.retry = retry
        self._random = random.Random()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._api_key}"),) if self._api_key else ()

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is _UNSET else timeout
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.001, deadline - time.monotonic())

    def _retry_wait(self, error: grpc.RpcError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None when the error must be raised."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retry.max_attempts:
            return None
        wait = self.retry.backoff(attempt, self._random.random())
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait

    @staticmethod
    def _chat(model, messages, sampling, tools, tool_choice, parallel_tool_calls, response_format,
              chat_template_kwargs, add_generation_prompt, cache_salt, user, priority, request_id):
        options = ChatOptions(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                              response_format=response_format, chat_template_kwargs=chat_template_kwargs,
                              add_generation_prompt=add_generation_prompt)
        return chat_request(model, messages, sampling or Sampling(), options, cache_salt, user, priority, request_id)

    @staticmethod
    def _tokenize(model, prompt, messages, add_generation_prompt, tools, chat_template_kwargs):
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
        return request


class Client(_Base):
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

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _unary(self, method, request, timeout):
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=self._remaining(deadline), metadata=self._metadata())
            except grpc.RpcError as error:
                wait = self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise from_rpc_error(error) from None
                time.sleep(wait)

    def _stream(self, method, request, timeout) -> Iterator:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            call = method(request, timeout=self._remaining(deadline), metadata=self._metadata())
            received = False
            try:
                for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                wait = None if received else self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise from_rpc_error(error) from None
            finally:
                call.cancel()
            time.sleep(wait)

    # -- the API -----------------------------------------------------------------------------------------------

    def models(self, *, timeout: float | None = _UNSET) -> list[Model]:
        reply = self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout)
        return [model_of(card) for card in reply.models]

    def chat_stream(self, model: str, messages: Iterable[Mapping[str, Any]], *, sampling: Sampling | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping | None = None,
                    parallel_tool_calls: bool = True, response_format: Mapping[str, Any] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                    cache_salt: str | None = None, user: str | None = None, priority: int = 0,
                    request_id: str | None = None, timeout: float | None = _UNSET) -> Iterator[ChatChunk]:
        """Streams `ChatChunk`s; close the iterator to cancel the request."""
        request = self._chat(model, messages, sampling, tools, tool_choice, parallel_tool_calls, response_format,
                             chat_template_kwargs, add_generation_prompt, cache_salt, user, priority, request_id)
        return (chat_chunk(m) for m in self._stream(self._stub.Chat, request, timeout))

    def chat(self, model: str, messages: Iterable[Mapping[str, Any]], *, sampling: Sampling | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping | None = None,
             parallel_tool_calls: bool = True, response_format: Mapping[str, Any] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
             cache_salt: str | None = None, user: str | None = None, priority: int = 0,
             request_id: str | None = None, timeout: float | None = _UNSET) -> ChatCompletion:
        acc = ChatAccumulator()
        for chunk in self.chat_stream(model, messages, sampling=sampling, tools=tools, tool_choice=tool_choice,
                                      parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                                      chat_template_kwargs=chat_template_kwargs,
                                      add_generation_prompt=add_generation_prompt, cache_salt=cache_salt, user=user,
                                      priority=priority, request_id=request_id, timeout=timeout):
            acc.add(chunk)
        return acc.result()

    def generate_stream(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                        echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                        user: str | None = None, priority: int = 0, request_id: str | None = None,
                        timeout: float | None = _UNSET) -> Iterator[CompletionChunk]:
        request = generate_request(model, prompt, sampling or Sampling(), echo, return_token_ids, cache_salt, user,
                                   priority, request_id)
        return (completion_chunk(m) for m in self._stream(self._stub.Generate, request, timeout))

    def generate(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                 echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                 user: str | None = None, priority: int = 0, request_id: str | None = None,
                 timeout: float | None = _UNSET) -> Completion:
        acc = CompletionAccumulator()
        for chunk in self.generate_stream(model, prompt, sampling=sampling, echo=echo,
                                          return_token_ids=return_token_ids, cache_salt=cache_salt, user=user,
                                          priority=priority, request_id=request_id, timeout=timeout):
            acc.add(chunk)
        return acc.result()

    def tokenize(self, model: str, *, prompt: str | None = None,
                 messages: Iterable[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 timeout: float | None = _UNSET) -> list[int]:
        request = self._tokenize(model, prompt, messages, add_generation_prompt, tools, chat_template_kwargs)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(self, model: str, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = _UNSET) -> str:
        request = gateway_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout).text


class AsyncClient(_Base):
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

    async def _unary(self, method, request, timeout):
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=self._remaining(deadline), metadata=self._metadata())
            except grpc.RpcError as error:
                wait = self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise from_rpc_error(error) from None
            await asyncio.sleep(wait)

    async def _stream(self, method, request, timeout) -> AsyncIterator:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            call = method(request, timeout=self._remaining(deadline), metadata=self._metadata())
            received = False
            try:
                async for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                wait = None if received else self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise from_rpc_error(error) from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def models(self, *, timeout: float | None = _UNSET) -> list[Model]:
        reply = await self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout)
        return [model_of(card) for card in reply.models]

    async def chat_stream(self, model: str, messages: Iterable[Mapping[str, Any]], *,
                          sampling: Sampling | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                          tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                          response_format: Mapping[str, Any] | None = None,
                          chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                          cache_salt: str | None = None, user: str | None = None, priority: int = 0,
                          request_id: str | None = None, timeout: float | None = _UNSET
                          ) -> AsyncIterator[ChatChunk]:
        """An async iterator of `ChatChunk`s (`aclose()` it to cancel the request)."""
        request = self._chat(model, messages, sampling, tools, tool_choice, parallel_tool_calls, response_format,
                             chat_template_kwargs, add_generation_prompt, cache_salt, user, priority, request_id)
        stream = self._stream(self._stub.Chat, request, timeout)
        try:
            async for message in stream:
                yield chat_chunk(message)
        finally:
            await stream.aclose()

    async def chat(self, model: str, messages: Iterable[Mapping[str, Any]], *, sampling: Sampling | None = None,
                   tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping | None = None,
                   parallel_tool_calls: bool = True, response_format: Mapping[str, Any] | None = None,
                   chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                   cache_salt: str | None = None, user: str | None = None, priority: int = 0,
                   request_id: str | None = None, timeout: float | None = _UNSET) -> ChatCompletion:
        acc = ChatAccumulator()
        stream = self.chat_stream(model, messages, sampling=sampling, tools=tools, tool_choice=tool_choice,
                                  parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                                  chat_template_kwargs=chat_template_kwargs,
                                  add_generation_prompt=add_generation_prompt, cache_salt=cache_salt, user=user,
                                  priority=priority, request_id=request_id, timeout=timeout)
        try:
            async for chunk in stream:
                acc.add(chunk)
        finally:
            await stream.aclose()
        return acc.result()

    async def generate_stream(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                              echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                              user: str | None = None, priority: int = 0, request_id: str | None = None,
                              timeout: float | None = _UNSET) -> AsyncIterator[CompletionChunk]:
        request = generate_request(model, prompt, sampling or Sampling(), echo, return_token_ids, cache_salt, user,
                                   priority, request_id)
        stream = self._stream(self._stub.Generate, request, timeout)
        try:
            async for message in stream:
                yield completion_chunk(message)
        finally:
            await stream.aclose()

    async def generate(self, model: str, prompt: str | Sequence[int], *, sampling: Sampling | None = None,
                       echo: bool = False, return_token_ids: bool = False, cache_salt: str | None = None,
                       user: str | None = None, priority: int = 0, request_id: str | None = None,
                       timeout: float | None = _UNSET) -> Completion:
        acc = CompletionAccumulator()
        stream = self.generate_stream(model, prompt, sampling=sampling, echo=echo, return_token_ids=return_token_ids,
                                      cache_salt=cache_salt, user=user, priority=priority, request_id=request_id,
                                      timeout=timeout)
        try:
            async for chunk in stream:
                acc.add(chunk)
        finally:
            await stream.aclose()
        return acc.result()

    async def tokenize(self, model: str, *, prompt: str | None = None,
                       messages: Iterable[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       timeout: float | None = _UNSET) -> list[int]:
        request = self._tokenize(model, prompt, messages, add_generation_prompt, tools, chat_template_kwargs)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def detokenize(self, model: str, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                         timeout: float | None = _UNSET) -> str:
        request = gateway_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, timeout)).text


__all__ = ["AsyncClient", "Client", "KdameshError"]
