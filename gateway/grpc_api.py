"""The public gRPC API (`kdamesh.v1.Generation`, protos/gateway.proto) over the same pipeline as the REST API.

Contract:
- `GenerationServicer(core)` answers `Generate`, `Chat` (server streams), `ListModels`, `Tokenize`, `Detokenize`
  with the `GatewayCore` the REST app uses: a gRPC request is translated into the body of its REST twin
  (`chat_body`, `generate_body`: pure functions) and validated by the same code, so both APIs accept and refuse
  the same requests and produce the same tokens for the same seed.
- Authentication: metadata `authorization: Bearer <key>` (UNAUTHENTICATED without a valid key when keys are
  configured). Errors are the REST statuses' twins: INVALID_ARGUMENT (400, context length included), NOT_FOUND (404),
  RESOURCE_EXHAUSTED (429; trailing metadata `retry-after` in whole seconds), UNAVAILABLE (503),
  DEADLINE_EXCEEDED (504).
- Streams: one `ChatResponse` per event of a choice (role first, then reasoning / content / tool-call fragments, a
  choice's last message with its finish reason); the message that finishes the last choice also carries `usage`.
  `Generate` likewise. Cancelling a call (client cancel, deadline) aborts the request in the mesh.
- `serve_grpc(core, address)` starts a `grpc.aio` server with this servicer, standard health (SERVING) and
  reflection, and returns it with its port. Its interceptors (`telemetry.rpc.server_interceptors("gateway")`)
  continue a caller's `traceparent` with a SERVER span per call and bind its `x-request-id`; `Chat` and `Generate`
  open the GenAI root span below it and write one access line, as the REST API does (`RequestTrace`).
"""

from __future__ import annotations

import json
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.chat_service import ChatEvent, GatewayCore, RequestTrace, Usage, api_error_type
from gateway.openai_protocol import (HTTP_STATUS, ApiError, TokenizeChatRequest, TokenizeCompletionRequest,
                                     parse_chat, parse_completion, parse_tokenize)
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from telemetry.context import current_request_id, new_request_id
from telemetry.rpc import server_interceptors

log = logging.getLogger(__name__)

SERVICE_NAME = "kdamesh.v1.Generation"
FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS, "abort": common_pb2.FINISH_REASON_ABORT,
          "error": common_pb2.FINISH_REASON_ERROR}
TOOL_MODES = {gateway_pb2.ToolChoice.MODE_AUTO: "auto", gateway_pb2.ToolChoice.MODE_NONE: "none",
              gateway_pb2.ToolChoice.MODE_REQUIRED: "required"}
FORMATS = {gateway_pb2.ResponseFormat.TYPE_TEXT: "text", gateway_pb2.ResponseFormat.TYPE_JSON_OBJECT: "json_object",
           gateway_pb2.ResponseFormat.TYPE_JSON_SCHEMA: "json_schema"}
_STATUS_OF = {code: status for code, status in HTTP_STATUS.items()}


def _json(text: str, what: str, param: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ApiError(400, f"{what} is not valid JSON: {exc}", param=param) from None


# -- requests -> REST bodies -------------------------------------------------------------------------------------


def _sampling_fields(s: common_pb2.SamplingParams, chat: bool) -> dict:
    out: dict = {"n": s.n or 1, "min_tokens": s.min_tokens, "presence_penalty": s.presence_penalty,
                 "frequency_penalty": s.frequency_penalty, "stop": list(s.stop) or None,
                 "stop_token_ids": list(s.stop_token_ids) or None, "ignore_eos": s.ignore_eos,
                 "include_stop_str_in_output": s.include_stop_str_in_output,
                 "skip_special_tokens": s.skip_special_tokens}
    if s.HasField("max_tokens"):
        out["max_completion_tokens" if chat else "max_tokens"] = s.max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        if s.HasField(name):
            out[name] = getattr(s, name)
    if chat:
        out["logprobs"] = s.logprobs
        if s.logprobs:
            out["top_logprobs"] = s.top_logprobs
    elif s.logprobs:
        out["logprobs"] = s.top_logprobs
    return out


def _content(parts) -> str | list[dict] | None:
    if not parts:
        return None
    out = []
    for part in parts:
        kind = part.WhichOneof("part")
        if kind == "text":
            out.append({"type": "text", "text": part.text})
        elif kind == "image_url":
            out.append({"type": "image_url", "image_url": {"url": part.image_url}})
        elif kind == "image_data":
            out.append({"type": "image", "mime_type": part.image_mime_type})
        else:
            raise ApiError(400, "a content part has no text or image", param="messages")
    if len(out) == 1 and out[0]["type"] == "text":
        return out[0]["text"]
    return out


def _message(m: gateway_pb2.ChatMessage) -> dict:
    message: dict = {"role": m.role, "content": _content(m.content)}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message


def _tool(t: gateway_pb2.Tool) -> dict:
    function: dict = {"name": t.function.name}
    if t.function.description:
        function["description"] = t.function.description
    if t.function.parameters_json:
        function["parameters"] = _json(t.function.parameters_json, f"tool {t.function.name!r} parameters", "tools")
    if t.function.strict:
        function["strict"] = True
    return {"type": t.type or "function", "function": function}


def _template_kwargs(text: str) -> dict | None:
    if not text:
        return None
    kwargs = _json(text, "chat_template_kwargs_json", "chat_template_kwargs")
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs_json must be a JSON object", param="chat_template_kwargs")
    return kwargs


def chat_body(req: gateway_pb2.ChatRequest) -> dict:
    """The /v1/chat/completions body equivalent to a gRPC ChatRequest."""
    if req.sampling.HasField("structured_output"):
        raise ApiError(400, "sampling.structured_output is set by the gateway; use response_format or tool_choice",
                       param="sampling")
    body: dict = {"model": req.model, "messages": [_message(m) for m in req.messages], "stream": True,
                  **_sampling_fields(req.sampling, chat=True)}
    if req.tools:
        body["tools"] = [_tool(t) for t in req.tools]
    if req.HasField("tool_choice"):
        which = req.tool_choice.WhichOneof("choice")
        if which == "function_name":
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.function_name}}
        elif which == "mode" and req.tool_choice.mode in TOOL_MODES:
            body["tool_choice"] = TOOL_MODES[req.tool_choice.mode]
    if req.tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.HasField("response_format") and req.response_format.type in FORMATS:
        kind = FORMATS[req.response_format.type]
        body["response_format"] = {"type": kind}
        if kind == "json_schema":
            spec = req.response_format.json_schema
            body["response_format"]["json_schema"] = {
                "name": spec.name or None, "description": spec.description or None, "strict": spec.strict,
                "schema": _json(spec.schema_json, "response_format.json_schema.schema_json", "response_format")
                if spec.schema_json else None}
    body["chat_template_kwargs"] = _template_kwargs(req.chat_template_kwargs_json)
    body["add_generation_prompt"] = req.add_generation_prompt
    body["continue_final_message"] = req.continue_final_message
    for name in ("cache_salt", "user", "request_id"):
        if getattr(req, name):
            body[name] = getattr(req, name)
    body["priority"] = req.priority
    return body


def generate_body(req: gateway_pb2.GenerateRequest) -> dict:
    """The /v1/completions body equivalent to a gRPC GenerateRequest."""
    which = req.WhichOneof("prompt")
    prompt = req.text if which == "text" else list(req.token_ids.ids) if which == "token_ids" else None
    body: dict = {"model": req.model, "prompt": prompt, "stream": True, "echo": req.echo,
                  "return_token_ids": req.return_token_ids, "priority": req.priority,
                  **_sampling_fields(req.sampling, chat=False)}
    for name in ("cache_salt", "user", "request_id"):
        if getattr(req, name):
            body[name] = getattr(req, name)
    return {k: v for k, v in body.items() if v is not None or k == "prompt"}


# -- responses ---------------------------------------------------------------------------------------------------


def logprob_entry(tokenizer, lp: common_pb2.TokenLogprob) -> gateway_pb2.LogprobEntry:
    def one(token_id: int, logprob: float) -> gateway_pb2.LogprobEntry:
        raw = tokenizer.id_to_bytes(token_id)
        return gateway_pb2.LogprobEntry(token=raw.decode("utf-8", errors="replace"), token_bytes=raw,
                                        token_id=token_id, logprob=logprob)

    entry = one(lp.token_id, lp.logprob)
    entry.top_logprobs.extend(one(t.token_id, t.logprob) for t in lp.top_logprobs)
    return entry


def _usage(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            cached_tokens=u.cached_tokens)


def chat_choice(tokenizer, event: ChatEvent) -> gateway_pb2.ChatChoice:
    delta = gateway_pb2.ChatDelta(role=event.role or "")
    reasoning, content = [], []
    for d in event.deltas:
        if d.reasoning is not None:
            reasoning.append(d.reasoning)
        if d.content is not None:
            content.append(d.content)
        for call in d.tool_calls:
            delta.tool_calls.append(gateway_pb2.ToolCallDelta(
                index=call.index, id=call.id or "", type="function" if call.id is not None else "",
                name=call.name or "", arguments=call.arguments or ""))
    delta.reasoning_content = "".join(reasoning)
    delta.content = "".join(content)
    choice = gateway_pb2.ChatChoice(index=event.index, delta=delta,
                                    logprobs=[logprob_entry(tokenizer, lp) for lp in event.logprobs])
    if event.finish_reason is not None:
        choice.finish_reason = FINISH.get(event.finish_reason, common_pb2.FINISH_REASON_STOP)
        if isinstance(event.stop_reason, str):
            choice.stop_reason = event.stop_reason
    return choice


# -- the servicer ------------------------------------------------------------------------------------------------


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    async def _fail(self, context, endpoint: str, exc: ApiError):
        self.core.metrics.count_request("grpc", endpoint, exc.status)
        trailing = (("retry-after", exc.headers["Retry-After"]),) if "Retry-After" in exc.headers else ()
        await context.abort(exc.grpc_code, exc.message, trailing_metadata=trailing)

    def _trace(self, endpoint: str) -> RequestTrace:
        """The request's telemetry: the caller's `x-request-id` (bound by the server interceptor) or a new id; the
        root span continues the interceptor's SERVER span, which continued the caller's `traceparent`."""
        return RequestTrace(self.core, f"{SERVICE_NAME}/{endpoint}", current_request_id() or new_request_id())

    def _principal(self, context):
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        return self.core.authenticate(metadata.get("authorization"))

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        core = self.core
        trace = self._trace("Chat")
        try:
            principal = self._principal(context)
            trace.tenant = principal.tenant
            chat = parse_chat(chat_body(request), core.served)
            run = core.chat(principal, core.plan_chat(chat), api="grpc", trace=trace)
            await run.open()
        except ApiError as exc:
            trace.fail(api_error_type(exc), exc.status)
            trace.finish()
            await self._fail(context, "chat", exc)
            return
        core.metrics.count_request("grpc", "chat", 200)
        try:
            unfinished = len(run.choices)
            async for event in run.events():
                message = gateway_pb2.ChatResponse(id=run.id, model=run.model, created=run.created,
                                                   choices=[chat_choice(core.tokenizer, event)])
                if event.finish_reason is not None:
                    unfinished -= 1
                    if unfinished == 0:
                        message.usage.CopyFrom(_usage(run.usage()))
                yield message
        except ApiError as exc:
            await context.abort(exc.grpc_code, exc.message)
        finally:
            await run.close()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        core = self.core
        trace = self._trace("Generate")
        try:
            principal = self._principal(context)
            trace.tenant = principal.tenant
            job = parse_completion(generate_body(request), core.tokenizer, core.served)
            if not request.sampling.HasField("max_tokens"):
                job.sampling.ClearField("max_tokens")  # unset: up to the context length
            if request.sampling.HasField("structured_output"):
                job.sampling.structured_output.CopyFrom(request.sampling.structured_output)
            run = core.complete(principal, job, api="grpc", trace=trace)
            await run.open()
        except ApiError as exc:
            trace.fail(api_error_type(exc), exc.status)
            trace.finish()
            await self._fail(context, "completions", exc)
            return
        core.metrics.count_request("grpc", "completions", 200)
        try:
            unfinished = len(run.choices)
            async for ev in run.events():
                choice = gateway_pb2.CompletionChoice(
                    index=ev.index, text=ev.text, token_ids=ev.token_ids if job.return_token_ids else [],
                    logprobs=[logprob_entry(core.tokenizer, lp) for lp in ev.logprobs] if job.logprobs is not None
                    else [])
                message = gateway_pb2.GenerateResponse(id=run.id, model=run.model, created=run.created,
                                                       choices=[choice])
                if ev.finish_reason is not None:
                    choice.finish_reason = FINISH.get(ev.finish_reason, common_pb2.FINISH_REASON_STOP)
                    if isinstance(ev.stop_reason, str):
                        choice.stop_reason = ev.stop_reason
                    unfinished -= 1
                    if unfinished == 0:
                        message.usage.CopyFrom(_usage(run.usage()))
                yield message
        except ApiError as exc:
            await context.abort(exc.grpc_code, exc.message)
        finally:
            await run.close()

    async def ListModels(self, request, context):
        try:
            self._principal(context)
        except ApiError as exc:
            await self._fail(context, "models", exc)
        self.core.metrics.count_request("grpc", "models", 200)
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelCard(id=c["id"], owned_by=c["owned_by"], created=c["created"],
                                  max_model_len=c["max_model_len"], root=c["root"], family=c["family"])
            for c in self.core.model_cards()])

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context):
        core = self.core
        try:
            self._principal(context)
            which = request.WhichOneof("input")
            body: dict = {"model": request.model or None}
            if which == "messages":
                body.update(messages=[_message(m) for m in request.messages.messages],
                            add_generation_prompt=request.add_generation_prompt,
                            tools=[_tool(t) for t in request.tools] or None,
                            chat_template_kwargs=_template_kwargs(request.chat_template_kwargs_json))
            else:
                body.update(prompt=request.prompt, add_special_tokens=request.add_special_tokens)
            parsed: TokenizeCompletionRequest | TokenizeChatRequest = parse_tokenize(body, core.served)
            tokens = core.tokenize(parsed)
        except ApiError as exc:
            await self._fail(context, "tokenize", exc)
        return gateway_pb2.TokenizeResponse(token_ids=tokens, count=len(tokens), max_model_len=core.max_model_len)

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context):
        core = self.core
        try:
            self._principal(context)
            if request.model and request.model not in core.served:
                raise ApiError(404, f"The model `{request.model}` does not exist.", param="model")
            vocab = core.tokenizer.vocab_size
            if any(t >= vocab for t in request.token_ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", param="token_ids")
        except ApiError as exc:
            await self._fail(context, "detokenize", exc)
        return gateway_pb2.DetokenizeResponse(text=core.detokenize(list(request.token_ids),
                                                                   request.skip_special_tokens))


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
