"""SDK requests -> the protos of `protos/gateway.proto`.

Contract: messages, tools, `tool_choice` and `response_format` come in the OpenAI shape (plain dicts), exactly as
to the REST API; `chat_request` / `generate_request` turn them into protos and refuse what cannot be expressed
(`ValueError`, before any network call). `message_proto` / `tool_proto` serve `tokenize` too.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from protos import common_pb2, gateway_pb2
from sdk.types import ChatOptions, Sampling

TOOL_MODES = {"auto": gateway_pb2.ToolChoice.MODE_AUTO, "none": gateway_pb2.ToolChoice.MODE_NONE,
              "required": gateway_pb2.ToolChoice.MODE_REQUIRED}
FORMAT_TYPES = {"text": gateway_pb2.ResponseFormat.TYPE_TEXT,
                "json_object": gateway_pb2.ResponseFormat.TYPE_JSON_OBJECT,
                "json_schema": gateway_pb2.ResponseFormat.TYPE_JSON_SCHEMA}


def _content(content: Any) -> list[gateway_pb2.ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [gateway_pb2.ContentPart(text=content)]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(gateway_pb2.ContentPart(text=part["text"]))
        elif kind == "image_url":
            url = part["image_url"]["url"] if isinstance(part["image_url"], Mapping) else part["image_url"]
            if url.startswith("data:") and ";base64," in url:
                mime, data = url[5:].split(";base64,", 1)
                parts.append(gateway_pb2.ContentPart(image_data=base64.b64decode(data), image_mime_type=mime))
            else:
                parts.append(gateway_pb2.ContentPart(image_url=url))
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return parts


def message_proto(message: Mapping[str, Any]) -> gateway_pb2.ChatMessage:
    """An OpenAI-shaped message dict -> ChatMessage."""
    out = gateway_pb2.ChatMessage(role=message["role"], content=_content(message.get("content")),
                                  name=message.get("name") or "", tool_call_id=message.get("tool_call_id") or "",
                                  reasoning_content=message.get("reasoning_content") or message.get("reasoning")
                                  or "")
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.tool_calls.append(gateway_pb2.ToolCall(id=call.get("id", ""), type=call.get("type", "function"),
                                                   function=gateway_pb2.FunctionCall(name=function["name"],
                                                                                     arguments=arguments)))
    return out


def tool_proto(tool: Mapping[str, Any]) -> gateway_pb2.Tool:
    function = tool["function"]
    parameters = function.get("parameters")
    return gateway_pb2.Tool(type=tool.get("type", "function"), function=gateway_pb2.FunctionDefinition(
        name=function["name"], description=function.get("description") or "",
        parameters_json=json.dumps(parameters) if parameters is not None else "",
        strict=bool(function.get("strict"))))


def tool_choice_proto(choice: str | Mapping[str, Any]) -> gateway_pb2.ToolChoice:
    if isinstance(choice, str):
        if choice in TOOL_MODES:
            return gateway_pb2.ToolChoice(mode=TOOL_MODES[choice])
        return gateway_pb2.ToolChoice(function_name=choice)  # a bare function name
    return gateway_pb2.ToolChoice(function_name=choice["function"]["name"])


def response_format_proto(fmt: Mapping[str, Any]) -> gateway_pb2.ResponseFormat:
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"response_format type must be one of {sorted(FORMAT_TYPES)}, got {kind!r}")
    out = gateway_pb2.ResponseFormat(type=FORMAT_TYPES[kind])
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        out.json_schema.CopyFrom(gateway_pb2.ResponseFormat.JsonSchema(
            name=spec.get("name") or "", description=spec.get("description") or "",
            schema_json=json.dumps(spec.get("schema", {"type": "object"})), strict=bool(spec.get("strict"))))
    return out


def chat_request(model: str, messages: Iterable[Mapping[str, Any]], sampling: Sampling, options: ChatOptions,
                 cache_salt: str | None, user: str | None, priority: int,
                 request_id: str | None) -> gateway_pb2.ChatRequest:
    request = gateway_pb2.ChatRequest(
        model=model, messages=[message_proto(m) for m in messages], sampling=sampling.to_proto(),
        tools=[tool_proto(t) for t in options.tools or ()], parallel_tool_calls=options.parallel_tool_calls,
        chat_template_kwargs_json=json.dumps(dict(options.chat_template_kwargs))
        if options.chat_template_kwargs is not None else "",
        add_generation_prompt=options.add_generation_prompt, cache_salt=cache_salt or "", user=user or "",
        priority=priority, request_id=request_id or "")
    if options.tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_proto(options.tool_choice))
    if options.response_format is not None:
        request.response_format.CopyFrom(response_format_proto(options.response_format))
    return request


def generate_request(model: str, prompt: str | Sequence[int], sampling: Sampling, echo: bool,
                     return_token_ids: bool, cache_salt: str | None, user: str | None, priority: int,
                     request_id: str | None) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(model=model, sampling=sampling.to_proto(), echo=echo,
                                          return_token_ids=return_token_ids, cache_salt=cache_salt or "",
                                          user=user or "", priority=priority, request_id=request_id or "")
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))
    return request
