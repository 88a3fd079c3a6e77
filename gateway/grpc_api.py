"""The public gRPC API (`kdamesh.v1.Generation`, protos/gateway.proto) over the same pipeline as the REST API.

Contract:
- `GenerationServicer(core)` answers `Generate`, `Chat` (server streams), `ListModels`, `Tokenize`, `Detokenize`
  with the `GatewayCore` the REST app uses: a gRPC request is translated into the body of its REST twin
  (gateway/grpc_translate.py) and validated by the same code, and `Chat` / `Generate` run through the same
  skeleton (`gateway.handler.open_run`), so both APIs accept and refuse the same requests and produce the same
  tokens for the same seed.
- Authentication: metadata `authorization: Bearer <key>` (UNAUTHENTICATED without a valid key when keys are
  configured). Errors are the REST statuses' twins: INVALID_ARGUMENT (400, context length included), NOT_FOUND (404),
  RESOURCE_EXHAUSTED (429; trailing metadata `retry-after` in whole seconds), UNAVAILABLE (503),
  DEADLINE_EXCEEDED (504); a bug in a stream is a logged INTERNAL naming only the request id.
- Streams: one `ChatResponse` per event of a choice (role first, then reasoning / content / tool-call fragments, a
  choice's last message with its finish reason); the message that finishes the last choice also carries `usage`.
  `Generate` likewise; an unset `sampling.max_tokens` means up to the context length, and a `structured_output`
  given there is used as is (the whole output is constrained). Cancelling a call (client cancel, deadline) aborts
  the request in the mesh.
- `serve_grpc(core, address)` starts a `grpc.aio` server with this servicer, standard health (SERVING) and
  reflection, and returns it with its port. Its interceptors (`telemetry.rpc.server_interceptors("gateway")`)
  continue a caller's `traceparent` with a SERVER span per call and bind its `x-request-id`; `Chat` and `Generate`
  open the GenAI root span below it and write one access line, as the REST API does (`RequestTrace`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.core import GatewayCore
from gateway.grpc_translate import chat_body, chat_choice, completion_choice, generate_body, tokenize_body
from gateway.handler import Start, open_run
from gateway.protocol import ApiError, internal_error, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from gateway.request_trace import RequestTrace
from gateway.run import Run
from gateway.tenancy import Principal
from protos import gateway_pb2, gateway_pb2_grpc
from telemetry.context import current_request_id, new_request_id
from telemetry.rpc import server_interceptors

log = logging.getLogger(__name__)

SERVICE_NAME = "kdamesh.v1.Generation"


def _chat_request(request: gateway_pb2.ChatRequest, served: set[str]):
    """The validated chat request of a gRPC ChatRequest (run in the preparation pool)."""
    return parse_chat(chat_body(request), served)


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    async def _abort(self, context, exc: ApiError):
        trailing = (("retry-after", exc.headers["Retry-After"]),) if "Retry-After" in exc.headers else ()
        await context.abort(exc.grpc_code, exc.message, trailing_metadata=trailing)

    async def _internal(self, context, request_id: str):
        """A bug: logged with its traceback; the caller gets INTERNAL naming only the request id."""
        log.exception("unexpected error in gRPC request %s", request_id)
        await self._abort(context, internal_error(request_id))

    async def _fail(self, context, endpoint: str, exc: ApiError):
        self.core.metrics.count_request("grpc", endpoint, exc.status)
        await self._abort(context, exc)

    def _authorization(self, context) -> str | None:
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        return metadata.get("authorization")

    def _principal(self, context) -> Principal:
        return self.core.authenticate(self._authorization(context))

    async def _stream(self, context, method: str, endpoint: str, start: Start, response_type,
                      choice_of: Callable):
        """Opens a run (`open_run`) and streams its events as `response_type` messages (see the module docstring).
        The trace: the caller's `x-request-id` (bound by the server interceptor) or a new id; the root span
        continues the interceptor's SERVER span, which continued the caller's `traceparent`."""
        core = self.core
        trace = core.trace(f"{SERVICE_NAME}/{method}", current_request_id() or new_request_id())
        try:
            run = await open_run(core, trace, "grpc", endpoint, self._authorization(context), start)
        except ApiError as exc:
            await self._abort(context, exc)
            return
        except Exception:
            await self._internal(context, trace.request_id)
            return
        try:
            unfinished = len(run.choices)
            async for event in run.events():
                message = response_type(id=run.id, model=run.model, created=run.created,
                                        choices=[choice_of(run, event)])
                if event.finish_reason is not None:
                    unfinished -= 1
                    if unfinished == 0:
                        message.usage.CopyFrom(run.usage())
                yield message
        except ApiError as exc:
            await self._abort(context, exc)
        except Exception:
            await self._internal(context, trace.request_id)
        finally:
            await run.close()

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        core = self.core

        async def start(principal: Principal, trace: RequestTrace) -> Run:
            size = request.ByteSize()
            chat = await core.prepare(_chat_request, request, core.served, size=size)
            return core.chat(principal, await core.plan_chat(chat, size), api="grpc", trace=trace)

        async for message in self._stream(context, "Chat", "chat", start, gateway_pb2.ChatResponse,
                                          lambda run, event: chat_choice(core.tokenizer, event)):
            yield message

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        core = self.core

        async def start(principal: Principal, trace: RequestTrace) -> Run:
            job = await core.prepare(parse_completion, generate_body(request), core.tokenizer, core.served,
                                     size=request.ByteSize())
            if not request.sampling.HasField("max_tokens"):
                job.sampling.ClearField("max_tokens")  # unset: up to the context length
            if request.sampling.HasField("structured_output"):
                job.sampling.structured_output.CopyFrom(request.sampling.structured_output)
            return core.complete(principal, job, api="grpc", trace=trace)

        async for message in self._stream(context, "Generate", "completions", start, gateway_pb2.GenerateResponse,
                                          lambda run, event: completion_choice(core.tokenizer, event, run.job)):
            yield message

    async def ListModels(self, request, context):
        try:
            self._principal(context)
        except ApiError as exc:
            await self._fail(context, "models", exc)
        self.core.metrics.count_request("grpc", "models", 200)
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelCard(id=c["id"], owned_by=c["owned_by"], created=c["created"],
                                  max_model_len=c["max_model_len"] or 0, root=c["root"], family=c["family"])
            for c in self.core.model_cards()])

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context):
        core = self.core
        try:
            self._principal(context)
            tokens = await core.tokenize(parse_tokenize(tokenize_body(request), core.served), request.ByteSize())
        except ApiError as exc:
            await self._fail(context, "tokenize", exc)
        return gateway_pb2.TokenizeResponse(token_ids=tokens, count=len(tokens), max_model_len=core.max_model_len or 0)

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context):
        core = self.core
        try:
            self._principal(context)
            body = {"model": request.model or None, "tokens": list(request.token_ids)}
            parsed = parse_detokenize(body, core.served, core.tokenizer.vocab_size)
        except ApiError as exc:
            await self._fail(context, "detokenize", exc)
        return gateway_pb2.DetokenizeResponse(text=core.detokenize(parsed.tokens, request.skip_special_tokens))


async def serve_grpc(core: GatewayCore, address: str, max_message_bytes: int = 16 << 20):
    """Starts the public gRPC API on `address` (port 0: a free port); returns (server, port)."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    server = grpc.aio.server(options=options, interceptors=server_interceptors("gateway"))
    gateway_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port
