"""A Responses API request as the chat request it is served by.

Contract:
- `input_messages(request)` turns `input` into chat messages: a string is one user message; message items keep
  their role (`developer` as `system`), their parts become chat parts (`input_text` / `output_text` / `refusal` →
  text, `input_image` → an `image_url` part with the same URL, which the chat path reads under its image rules);
  consecutive assistant items (`message`, `reasoning`, `function_call`) fold into one assistant message with
  `reasoning_content` and `tool_calls`; a `function_call_output` becomes a `tool` message answering its `call_id`.
  Anything else (files, audio, item references, other tools' items) is a 400 naming `input[i]`.
- `chat_body(request, history)` is the `/v1/chat/completions` body: `instructions` as the system message, then
  `history` (the conversation a `previous_response_id` names), then the input; tools, tool choice, sampling,
  `max_output_tokens` → `max_tokens`, `reasoning.effort` → `chat_template_kwargs`, `text.format` →
  `response_format`. `chat_param(param)` maps a chat field named in an error back to the Responses field.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol import ApiError
from gateway.responses.protocol import EFFORT_KWARGS, FunctionChoice, ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                     "chat_template_kwargs": "reasoning"}


def chat_param(param: str | None) -> str | None:
    return CHAT_TO_RESPONSES.get(param, param) if param else param


def _bad(where: str, message: str, unsupported: bool = False) -> ApiError:
    return ApiError(400, f"{where}: {message}", param="input",
                    code="unsupported_parameter" if unsupported else None)


def _part(part: Any, where: str) -> dict:
    if not isinstance(part, dict):
        raise _bad(where, "a content part must be an object")
    kind = part.get("type")
    if kind in TEXT_PARTS:
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise _bad(where, f"a {kind} part needs 'text' (a string)")
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise _bad(where, "an input_image part needs 'image_url' (file_id is not supported)", unsupported=True)
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(where, f"content part type {kind!r} is not supported by this server", unsupported=True)


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of parts")
    return [_part(part, f"{where}[{i}]") for i, part in enumerate(content)]


def _text_of(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


class _Conversation:
    """Chat messages being built from input items; assistant items fold into one message."""

    def __init__(self):
        self.messages: list[dict] = []
        self.assistant: dict | None = None

    def flush(self) -> None:
        if self.assistant is not None:
            self.messages.append(self.assistant)
            self.assistant = None

    def add(self, message: dict) -> None:
        self.flush()
        self.messages.append(message)

    def turn(self) -> dict:
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": None}
        return self.assistant


def _assistant_item(conversation: _Conversation, item: dict, kind: str, where: str) -> None:
    turn = conversation.turn()
    if kind == "message":
        text = _text_of(_content(item.get("content", ""), f"{where}.content"))
        turn["content"] = (turn["content"] or "") + text
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise _bad(where, "a reasoning item's content must be a list of parts")
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        turn["reasoning_content"] = turn.get("reasoning_content", "") + text
    else:  # function_call
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
        if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(arguments, str)):
            raise _bad(where, "a function_call item needs 'call_id', 'name' and 'arguments' (strings)")
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})


def _item(conversation: _Conversation, item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _bad(where, "an input item must be an object")
    kind = item.get("type", "message")
    role = item.get("role")
    if kind == "message" and role == "assistant" or kind in ("reasoning", "function_call"):
        _assistant_item(conversation, item, kind, where)
    elif kind == "message":
        if role not in ROLES:
            raise _bad(where, f"role {role!r} is not one of {sorted(ROLES)}")
        conversation.add({"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(where, "a function_call_output item needs 'call_id'")
        content = output if isinstance(output, str) else _content(output, f"{where}.output")
        conversation.add({"role": "tool", "tool_call_id": call_id, "content": content})
    else:
        raise _bad(where, f"input item type {kind!r} is not supported by this server", unsupported=True)


def input_messages(request: ResponsesRequest) -> list[dict]:
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    conversation = _Conversation()
    for i, item in enumerate(request.input):
        _item(conversation, item, f"input[{i}]")
    conversation.flush()
    return conversation.messages


def _tool_choice(request: ResponsesRequest) -> Any:
    if isinstance(request.tool_choice, FunctionChoice):
        return {"type": "function", "function": {"name": request.tool_choice.name}}
    return request.tool_choice


def _response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    spec = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def chat_body(request: ResponsesRequest, history: list[dict], messages: list[dict]) -> dict:
    """The chat request serving `request` (`messages`: its input, from `input_messages`)."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"model": request.model, "messages": system + history + messages,
                            "stream": request.stream}
    tools = request.function_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    optional = {"tool_choice": _tool_choice(request), "parallel_tool_calls": request.parallel_tool_calls,
                "max_tokens": request.max_output_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "user": request.user, "response_format": _response_format(request)}
    body.update({k: v for k, v in optional.items() if v is not None})
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["chat_template_kwargs"] = dict(EFFORT_KWARGS[request.reasoning.effort])
    return body

