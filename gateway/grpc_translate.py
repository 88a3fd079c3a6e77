"""Translation between the public gRPC API (protos/gateway.proto) and the gateway's pipeline.

Contract:
- Requests become the body of their REST twin, so the same code validates both APIs and they accept and refuse
  the same requests: `chat_body(ChatRequest)` a /v1/chat/completions body, `generate_body(GenerateRequest)` a
  /v1/completions body, `tokenize_body(TokenizeRequest)` a /tokenize body (pure functions; `ApiError` 400 for
  embedded JSON that does not parse, a content part without text or image, or a `structured_output` set by the
  client on a chat request — the gateway derives it from `response_format` / `tool_choice`).
- Events become messages: `chat_choice(tokenizer, ChatEvent)` / `completion_choice(tokenizer, CompletionEvent,
  job)` one choice of a `ChatResponse` / `GenerateResponse` (reasoning and content deltas joined, tool-call
  fragments, logprobs with token bytes and ids, finish and stop reasons on a choice's last message). Usage needs no
  translation: runs count in the proto's own `Usage`.
"""

from __future__ import annotations

import base64

import json

from gateway.events import ChatEvent, CompletionEvent
from gateway.protocol import ApiError, CompletionJob
from protos import common_pb2, gateway_pb2

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS, "abort": common_pb2.FINISH_REASON_ABORT,
          "error": common_pb2.FINISH_REASON_ERROR}
TOOL_MODES = {gateway_pb2.ToolChoice.MODE_AUTO: "auto", gateway_pb2.ToolChoice.MODE_NONE: "none",
              gateway_pb2.ToolChoice.MODE_REQUIRED: "required"}
FORMATS = {gateway_pb2.ResponseFormat.TYPE_TEXT: "text", gateway_pb2.ResponseFormat.TYPE_JSON_OBJECT: "json_object",
           gateway_pb2.ResponseFormat.TYPE_JSON_SCHEMA: "json_schema"}
REQUEST_TAGS = ("cache_salt", "user", "request_id")  # copied into a body when set


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
    if s.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
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
        elif kind == "image_data":  # inline bytes: read as the equivalent data: URL (gateway/media.py)
            url = f"data:{part.image_mime_type or 'image/png'};base64,{base64.b64encode(part.image_data).decode()}"
            out.append({"type": "image_url", "image_url": {"url": url}})
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


def _tags(req) -> dict:
    return {name: getattr(req, name) for name in REQUEST_TAGS if getattr(req, name)}


def _response_format(fmt: gateway_pb2.ResponseFormat) -> dict:
    kind = FORMATS[fmt.type]
    if kind != "json_schema":
        return {"type": kind}
    spec = fmt.json_schema
    schema = _json(spec.schema_json, "response_format.json_schema.schema_json", "response_format") \
        if spec.schema_json else None
    return {"type": kind, "json_schema": {"name": spec.name or None, "description": spec.description or None,
                                          "strict": spec.strict, "schema": schema}}


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
        body["response_format"] = _response_format(req.response_format)
    body.update({"chat_template_kwargs": _template_kwargs(req.chat_template_kwargs_json),
                 "add_generation_prompt": req.add_generation_prompt,
                 "continue_final_message": req.continue_final_message})
    body.update(_tags(req))
    body["priority"] = req.priority
    return body


def generate_body(req: gateway_pb2.GenerateRequest) -> dict:
    """The /v1/completions body equivalent to a gRPC GenerateRequest."""
    which = req.WhichOneof("prompt")
    prompt = req.text if which == "text" else list(req.token_ids.ids) if which == "token_ids" else None
    body: dict = {"model": req.model, "prompt": prompt, "stream": True, "echo": req.echo,
                  "return_token_ids": req.return_token_ids, "priority": req.priority,
                  **_sampling_fields(req.sampling, chat=False), **_tags(req)}
    return {k: v for k, v in body.items() if v is not None or k == "prompt"}


def tokenize_body(req: gateway_pb2.TokenizeRequest) -> dict:
    """The /tokenize body equivalent to a gRPC TokenizeRequest."""
    if req.WhichOneof("input") == "messages":
        return {"model": req.model or None, "messages": [_message(m) for m in req.messages.messages],
                "add_generation_prompt": req.add_generation_prompt, "tools": [_tool(t) for t in req.tools] or None,
                "chat_template_kwargs": _template_kwargs(req.chat_template_kwargs_json)}
    return {"model": req.model or None, "prompt": req.prompt, "add_special_tokens": req.add_special_tokens}


# -- events -> messages ------------------------------------------------------------------------------------------


def logprob_entry(tokenizer, lp: common_pb2.TokenLogprob) -> gateway_pb2.LogprobEntry:
    def one(token_id: int, logprob: float) -> gateway_pb2.LogprobEntry:
        raw = tokenizer.id_to_bytes(token_id)
        return gateway_pb2.LogprobEntry(token=raw.decode("utf-8", errors="replace"), token_bytes=raw,
                                        token_id=token_id, logprob=logprob)

    entry = one(lp.token_id, lp.logprob)
    entry.top_logprobs.extend(one(t.token_id, t.logprob) for t in lp.top_logprobs)
    return entry




def _finish(choice, event: ChatEvent | CompletionEvent) -> None:
    if event.finish_reason is not None:
        choice.finish_reason = FINISH.get(event.finish_reason, common_pb2.FINISH_REASON_STOP)
        if isinstance(event.stop_reason, str):
            choice.stop_reason = event.stop_reason


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
    _finish(choice, event)
    return choice


def completion_choice(tokenizer, event: CompletionEvent, job: CompletionJob) -> gateway_pb2.CompletionChoice:
    choice = gateway_pb2.CompletionChoice(
        index=event.index, text=event.text, token_ids=event.token_ids if job.request.return_token_ids else [],
        logprobs=[logprob_entry(tokenizer, lp) for lp in event.logprobs] if job.request.logprobs is not None else [])
    _finish(choice, event)
    return choice
