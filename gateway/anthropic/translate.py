"""An Anthropic Messages request as the chat request it is served by.

Contract:
- `chat_messages(request)`: `system` (a string, or text blocks joined) becomes the system message; each message's
  content (a string or blocks) becomes chat messages — `text` → text parts, `image` → an `image_url` part (a base64
  source as a `data:` URL, a URL source as it is; the chat path's image rules apply), an assistant's `thinking` →
  `reasoning_content`, `tool_use` → a tool call (`input` as JSON arguments), a user's `tool_result` → a `tool`
  message answering `tool_use_id` (placed before the rest of that user turn; `is_error` prefixes its text with
  "Error: "). Other blocks (documents, redacted thinking, server tool blocks) are a 400 naming `messages.i.content.j`.
- `chat_body(request, messages)`: the `/v1/chat/completions` body — tools as functions (`input_schema` →
  `parameters`), `tool_choice` auto → "auto", any → "required", tool → named, none → "none",
  `disable_parallel_tool_use` → `parallel_tool_calls: false`, `stop_sequences` → `stop`, `thinking` →
  `chat_template_kwargs.thinking`, `output_config.effort` → `chat_template_kwargs.thinking_effort`, the output
  JSON schema → `response_format` json_schema, `metadata.user_id` → `user`. `chat_param(param)` maps a chat field named in an
  error back to the Messages field.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.anthropic.protocol import EFFORTS, CountTokensRequest, MessagesRequest
from gateway.protocol import ApiError

CHAT_TO_MESSAGES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking", "response_format": "output_config"}


def chat_param(param: str | None) -> str | None:
    return CHAT_TO_MESSAGES.get(param, param) if param else param


def _bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(where, "an image block needs a 'source'")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not (isinstance(media_type, str) and isinstance(data, str) and data):
            raise _bad(where, "a base64 image source needs 'media_type' and 'data'")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise _bad(where, f"image source type {source.get('type')!r} is not supported (base64 or url)")


def _user_part(block: Any, where: str) -> dict:
    if not isinstance(block, dict):
        raise _bad(where, "a content block must be an object")
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise _bad(where, "a text block needs 'text' (a string)")
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        return _image(block, where)
    raise _bad(where, f"content block type {kind!r} is not supported here")


def _blocks(content: Any, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of content blocks")
    return content


def _tool_result(block: dict, where: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _bad(where, "a tool_result block needs 'tool_use_id'")
    content = block.get("content", "")
    parts = [_user_part(b, f"{where}.content.{k}") for k, b in enumerate(_blocks(content, where))]
    if block.get("is_error"):
        parts.insert(0, {"type": "text", "text": "Error: "})
    if all(p["type"] == "text" for p in parts):
        parts = "".join(p["text"] for p in parts)
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts}


def _user(content: Any, where: str) -> list[dict]:
    tools, parts = [], []
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            tools.append(_tool_result(block, f"{where}.content.{j}"))
        else:
            parts.append(_user_part(block, f"{where}.content.{j}"))
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _assistant(content: Any, where: str) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            message["content"] = (message["content"] or "") + block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                raise _bad(at, "a tool_use block needs 'id' and 'name'")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            message.setdefault("tool_calls", []).append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}})
        else:
            raise _bad(at, f"content block type {kind!r} is not supported in an assistant message")
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return message


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = []
    for i, block in enumerate(system):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise _bad(f"system.{i}", "system blocks must be text blocks")
        texts.append(block["text"])
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def chat_messages(request: CountTokensRequest) -> list[dict]:
    out = _system(request.system)
    for i, message in enumerate(request.messages):
        where, role = f"messages.{i}", message.get("role")
        if role == "user":
            out += _user(message.get("content"), where)
        elif role == "assistant":
            out.append(_assistant(message.get("content"), where))
        else:
            raise _bad(f"{where}.role", f"role {role!r} must be 'user' or 'assistant'")
    return out


def tools_and_choice(request: CountTokensRequest) -> dict:
    tools = request.custom_tools()
    if not tools:
        return {}
    body: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {})}}
        for t in tools]}
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def thinking_kwargs(request: CountTokensRequest) -> dict:
    kwargs = {}
    if request.thinking is not None:
        kwargs["thinking"] = request.thinking.type != "disabled"
    effort = request.output_config.effort if request.output_config else None
    if effort is not None:
        kwargs["thinking_effort"] = EFFORTS[effort]
    return {"chat_template_kwargs": kwargs} if kwargs else {}


def chat_body(request: MessagesRequest, messages: list[dict]) -> dict:
    body: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens,
                            "stream": request.stream, **tools_and_choice(request), **thinking_kwargs(request)}
    optional = {"stop": request.stop_sequences, "temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "user": request.metadata.user_id if request.metadata else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    schema = request.output_schema()
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return body
