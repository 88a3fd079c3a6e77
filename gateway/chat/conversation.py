"""Validation and normalisation of OpenAI-style chat conversations, shared by both chat formats.

Contract
--------
`normalize_messages(messages, allow_images=..., allow_system_tools=...)` returns a new list of plain dicts (the input is
never mutated) or raises `ChatFormatError` naming the offending message. Normalised messages have this shape:

* `{"role": "system", "content": C, ["name": str], ["tools": [...]]}` — `developer` is accepted as `system`;
  `tools` only where `allow_system_tools` (K3's dynamic tool declarations), and then content may be absent;
* `{"role": "user", "content": C, ["name": str]}`;
* `{"role": "assistant", "content": C | None, ["name": str], ["reasoning_content": str], ["tool_calls": [...]]}`
  where `reasoning_content` is the first non-empty of `reasoning_content` / `reasoning`, and each tool call is
  `{"id": str, "type": "function", "function": {"name": str, "arguments": str | dict}}` (ids unique in the message;
  arguments `None` become `{}`; a string that parses as JSON must be an object, a string that does not parse is kept
  as it is);
* `{"role": "tool", "tool_call_id": str, "name": str, "content": C}` — `tool_call_id` must match a call of the most
  recent assistant message, `name` is that call's function name, and each run of consecutive tool messages is put
  into the order of the calls they answer (a call answered twice is an error).

C is a string or a list of parts `{"type": "text", "text": str}`, `{"type": "image_url", "image_url": {"url": str}}`
or `{"type": "image"}` (images only where `allow_images`). `normalize_tools` checks an OpenAI `tools` list
(`{"type": "function", "function": {"name", ["description"], ["parameters"]}}`, names as OpenAI allows them, no
duplicates) and returns a plain-JSON copy, or None for an empty list. Every value must be plain JSON (finite numbers).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from gateway.chat.base import ChatFormatError

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI API accepts for function names
IMAGE_PART_TYPES = ("image_url", "image")
MAX_JSON_DEPTH = 64  # deeper request values are refused rather than risking Python's recursion limit


# ----------------------------------------------------------------------------------------------------------------
# Plain JSON values


def plain_json(value: Any, where: str, depth: int = 0) -> Any:
    """A deep copy of `value` made of dict/list/str/int/float/bool/None only (tuples become lists)."""
    if depth > MAX_JSON_DEPTH:
        raise ChatFormatError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ChatFormatError(f"{where}: {value!r} is not a JSON number")
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ChatFormatError(f"{where}: object keys must be strings, got {key!r}")
            out[key] = plain_json(item, f"{where}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_json(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise ChatFormatError(f"{where}: {type(value).__name__} is not a JSON value")


def options_mapping(value: Any, where: str) -> dict:
    """Request options given as an object (None -> {}), as a dict with string keys."""
    if value is None:
        return {}
    value = _mapping(value, where)
    if not all(isinstance(key, str) for key in value):
        raise ChatFormatError(f"{where}: keys must be strings")
    return dict(value)


def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ChatFormatError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ChatFormatError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _non_empty_str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ChatFormatError(f"{where} must be a non-empty string")
    return value


# ----------------------------------------------------------------------------------------------------------------
# Tools


def normalize_tools(tools: Any, where: str = "tools") -> list[dict] | None:
    """Validate an OpenAI `tools` list; a plain-JSON copy, or None when there are no tools."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatFormatError(f"{where} must be a list")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"{where}[{i}]")
        if name in seen:
            raise ChatFormatError(f"{where}[{i}]: duplicate function name {name!r}")
        seen.add(name)
        out.append(plain_json(tool, f"{where}[{i}]"))
    return out or None


def _check_tool(tool: Any, where: str) -> str:
    tool = _mapping(tool, where)
    if tool.get("type") != "function":
        raise ChatFormatError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = _mapping(tool.get("function"), f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise ChatFormatError(f"{where}.function.name must match {TOOL_NAME_RE.pattern}, got {name!r}")
    _optional_str(function.get("description"), f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None:
        parameters = _mapping(parameters, f"{where}.function.parameters")
        if "type" in parameters and parameters["type"] != "object":
            raise ChatFormatError(f"{where}.function.parameters.type must be 'object', got {parameters['type']!r}")
    return name


# ----------------------------------------------------------------------------------------------------------------
# Content


def normalize_content(content: Any, where: str, allow_images: bool) -> str | list[dict] | None:
    """A message's content: None, a string, or a list of text/image parts (normalised)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ChatFormatError(f"{where} must be a string or a list of content parts")
    return [_content_part(part, f"{where}[{i}]", allow_images) for i, part in enumerate(content)]


def _content_part(part: Any, where: str, allow_images: bool) -> dict:
    part = _mapping(part, where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatFormatError(f"{where}.text must be a string")
        return {"type": "text", "text": text}
    if kind in IMAGE_PART_TYPES:
        if not allow_images:
            raise ChatFormatError(f"{where}: this model is text-only; image content is not supported")
        if kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
            return {"type": "image_url", "image_url": {"url": _non_empty_str(url, f"{where}.image_url.url")}}
        return {"type": "image"}
    raise ChatFormatError(f"{where}: unsupported content part type {kind!r}")


# ----------------------------------------------------------------------------------------------------------------
# Messages


def normalize_messages(messages: Any, allow_images: bool, allow_system_tools: bool = False) -> list[dict]:
    """Validate and normalise a conversation (see the module docstring); tool results linked to their calls."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    normalized = [
        _message(message, f"messages[{i}]", allow_images, allow_system_tools) for i, message in enumerate(messages)
    ]
    return _link_tool_results(normalized)


def _message(message: Any, where: str, allow_images: bool, allow_system_tools: bool) -> dict:
    message = _mapping(message, where)
    role = message.get("role")
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise ChatFormatError(f"{where}.role must be one of {ROLES + tuple(ROLE_ALIASES)}, got {role!r}")
    out: dict[str, Any] = {"role": role}
    name = _optional_str(message.get("name"), f"{where}.name")
    if name and role != "tool":
        out["name"] = name
    content = normalize_content(message.get("content"), f"{where}.content", allow_images)
    if role == "system":
        _system_extras(message, out, where, allow_system_tools)
    elif role == "assistant":
        _assistant_extras(message, out, where)
    elif role == "tool":
        out["tool_call_id"] = _non_empty_str(message.get("tool_call_id"), f"{where}.tool_call_id")
    if content is None and role != "assistant" and "tools" not in out:
        raise ChatFormatError(f"{where}.content is required for role {role!r}")
    out["content"] = content
    return out


def _system_extras(message: Mapping, out: dict, where: str, allow_system_tools: bool) -> None:
    if message.get("tools") is None:
        return
    if not allow_system_tools:
        raise ChatFormatError(f"{where}.tools: this chat format declares tools only through the request's `tools`")
    tools = normalize_tools(message["tools"], f"{where}.tools")
    if tools:
        out["tools"] = tools


def _assistant_extras(message: Mapping, out: dict, where: str) -> None:
    reasoning = [_optional_str(message.get(key), f"{where}.{key}") for key in ("reasoning_content", "reasoning")]
    reasoning_text = next((r for r in reasoning if r), None)
    if reasoning_text is not None:
        out["reasoning_content"] = reasoning_text
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        return
    if not isinstance(tool_calls, (list, tuple)):
        raise ChatFormatError(f"{where}.tool_calls must be a list")
    calls = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    ids = [call["id"] for call in calls]
    if len(set(ids)) != len(ids):
        raise ChatFormatError(f"{where}.tool_calls: ids must be unique within a message")
    if calls:
        out["tool_calls"] = calls


def _tool_call(call: Any, where: str) -> dict:
    call = _mapping(call, where)
    if call.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type must be 'function', got {call.get('type')!r}")
    call_id = _non_empty_str(call.get("id"), f"{where}.id")
    function = _mapping(call.get("function"), f"{where}.function")
    name = _non_empty_str(function.get("name"), f"{where}.function.name")
    arguments = _arguments(function.get("arguments"), f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(arguments: Any, where: str) -> str | dict:
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return plain_json(arguments, where)
    if not isinstance(arguments, str):
        raise ChatFormatError(f"{where} must be a JSON object or a string holding one")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: kept verbatim (K3 renders it as a raw `json` block)
    if not isinstance(parsed, dict):
        raise ChatFormatError(f"{where} must encode a JSON object, got {type(parsed).__name__}")
    return arguments


def _link_tool_results(messages: list[dict]) -> list[dict]:
    """Name each tool message after the call it answers and sort each run of tool messages into call order."""
    out: list[dict] = []
    calls: dict[str, tuple[int, str]] = {}  # id -> (position in the assistant message, function name)
    answered: set[str] = set()
    i = 0
    while i < len(messages):
        message = messages[i]
        if message["role"] != "tool":
            if message["role"] == "assistant":
                calls = {c["id"]: (k, c["function"]["name"]) for k, c in enumerate(message.get("tool_calls", []))}
                answered = set()
            out.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i]["role"] == "tool":
            run.append(_linked_result(messages[i], f"messages[{i}]", calls, answered))
            i += 1
        out.extend(message for _, message in sorted(run, key=lambda item: item[0]))
    return out


def _linked_result(message: dict, where: str, calls: dict, answered: set) -> tuple[int, dict]:
    call_id = message["tool_call_id"]
    if call_id not in calls:
        raise ChatFormatError(
            f"{where}.tool_call_id {call_id!r} matches no tool call of the preceding assistant message"
        )
    if call_id in answered:
        raise ChatFormatError(f"{where}.tool_call_id {call_id!r} answers a call that already has a result")
    answered.add(call_id)
    position, name = calls[call_id]
    return position, {**message, "name": name}


def arguments_object(arguments: str | dict) -> tuple[dict, str | None]:
    """Normalised tool-call arguments -> (the object, or {} with the raw text when the string is not JSON)."""
    if isinstance(arguments, dict):
        return arguments, None
    if not arguments.strip():
        return {}, None
    try:
        return json.loads(arguments), None
    except ValueError:
        return {}, arguments
