"""kdamesh SDK: a typed Python client of the gateway's gRPC API (`kdamesh.v1.Generation`, protos/gateway.proto).

Two clients with the same methods: `Client` (blocking) and `AsyncClient` (asyncio). They import only `grpc` and the
generated protos. Messages, tools, `tool_choice` and `response_format` take the OpenAI shapes (plain dicts);
sampling is a typed `Sampling`.

Blocking, whole answers::

    from sdk import Client, Sampling

    with Client("localhost:50051", api_key="sk-tenant-a") as client:
        print([m.id for m in client.models()])
        reply = client.chat("demo-k3", [{"role": "user", "content": "Hello!"}],
                            sampling=Sampling(max_tokens=64, temperature=0.7, seed=1))
        choice = reply.choices[0]
        print(choice.message.reasoning_content, choice.message.content, choice.finish_reason)
        print(reply.usage.prompt_tokens, reply.usage.cached_tokens)

Streaming (closing the iterator, or leaving the loop with `break` and dropping it, cancels the request)::

    for chunk in client.chat_stream("demo-k3", messages, sampling=Sampling(max_tokens=256)):
        for c in chunk.choices:
            print(c.reasoning_content or c.content, end="", flush=True)

Tools and structured output (enforced by the engine's grammar)::

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    reply = client.chat("demo-k3", messages, tools=[weather], tool_choice="get_weather",
                        sampling=Sampling(max_tokens=200))
    call = reply.choices[0].message.tool_calls[0]
    print(call.name, call.parsed_arguments())
    reply = client.chat("demo-k3", messages, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}})

Completions, token ids, tokenizer::

    done = client.generate("demo-k3", "Once upon a time", sampling=Sampling(max_tokens=16), return_token_ids=True)
    ids = client.tokenize("demo-k3", messages=[{"role": "user", "content": "hi"}])
    text = client.detokenize("demo-k3", ids)

asyncio::

    from sdk import AsyncClient

    async with AsyncClient("localhost:50051", api_key=key) as client:
        async for chunk in client.chat_stream("demo-k3", messages):
            ...

Deadlines and retries: `timeout=` (seconds) on the client sets the default deadline of every call, and on a call its
own; the deadline covers retries. A call that fails with UNAVAILABLE before any response is retried with
exponential backoff and jitter (`RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=2.0)`); a
stream that already produced a chunk is not retried.

Errors: `KdameshError` subclasses — `InvalidRequest` (400: malformed request, context length exceeded),
`Unauthenticated` (401), `PermissionDenied`, `NotFound` (unknown model), `RateLimited` (429, `.retry_after`
seconds), `Unavailable` (503), `DeadlineExceeded`, `Cancelled`, `InternalError`.
"""

from sdk.client import AsyncClient, Client
from sdk.errors import (Cancelled, DeadlineExceeded, InternalError, InvalidRequest, KdameshError, NotFound,
                        PermissionDenied, RateLimited, Unauthenticated, Unavailable)
from sdk.types import (ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatMessage, Completion,
                       CompletionChoice, CompletionChunk, CompletionChunkChoice, Logprob, Model, RetryPolicy,
                       Sampling, ToolCall, ToolCallDelta, Usage)

__all__ = [
    "AsyncClient", "Cancelled", "ChatChoice", "ChatChunk", "ChatChunkChoice", "ChatCompletion", "ChatMessage",
    "Client", "Completion", "CompletionChoice", "CompletionChunk", "CompletionChunkChoice", "DeadlineExceeded",
    "InternalError", "InvalidRequest", "KdameshError", "Logprob", "Model", "NotFound", "PermissionDenied",
    "RateLimited", "RetryPolicy", "Sampling", "ToolCall", "ToolCallDelta", "Unauthenticated", "Unavailable",
    "Usage",
]
