"""Kimi K3 "XTML" chat format, rendered by a Python program (no Jinja).

Contract
--------
`K3Renderer(tokenizer).render(messages, tools, add_generation_prompt, chat_template_kwargs, tool_choice=...,
response_format=..., image_sizes=...)` returns a `RenderedPrompt` equal, text and ids, to the official renderer
(`encoding_k3.build_chat_segments` as called by the official tokenizer's `apply_chat_template`):

* Only `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>` and, for images, `<|media_begin|>`, `<|media_content|>`,
  `<|media_pad|>`, `<|media_end|>` become special ids, and only where this module puts them. Every string from the
  request (content, names, reasoning, argument values, schemas) is encoded as ordinary text, so user text can never
  inject a control token. Text is split into pieces exactly where the official renderer splits it (tag name, each
  ` key`, `="`, value, `"`, each content part), and each piece is encoded on its own, as the official ids are.
* A tag is `<|open|>NAME key="value"…<|sep|>` / `<|close|>NAME<|sep|>` (attribute values escape `&` and `"`); a message
  is `<|open|>message role="R"[ name="N"]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`.
* Order: the `tool-declare` system message (request tools, keys sorted recursively, compact JSON), the
  `thinking-effort` system message (when thinking; `thinking_effort` defaults to "max" like the official tokenizer;
  `None` omits it), the conversation, a `tool-choice` message for `tool_choice` "required"/"none", a
  `response-format` message for `json_object`/`json_schema`, then the generation prompt
  `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (thinking) or `…<|open|>response<|sep|>`.
* Assistant messages: `think` block (when thinking; holds the reasoning if it is not blank), `response` block, and a
  `tools` block with one `call tool="NAME" index="k"` per call (k from 1) holding `argument key="K" type="T"` tags —
  strings raw, other types as JSON — or, for an arguments string that is not JSON, one raw `json type="object"` block.
  With thinking off, history messages carry no `think` block either.
* Tool results: `message role="tool" tool="NAME" index="k"`, matched to calls by `tool_call_id` (see
  `conversation.normalize_messages`); k counts the tool messages since the last assistant message.
* System messages carrying `tools` become a "New Tools Available" declaration (the official dynamic form).
* Images (`image_url` / `image` parts) become `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`;
  the caller passes one (width, height) per image, in order (the vision preprocessor knows them).

Malformed input raises `ChatFormatError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from engine.formats.markers import (K3_CLOSE as CLOSE, K3_END_OF_MSG as END_OF_MSG, K3_MEDIA_BEGIN as MEDIA_BEGIN,
                                    K3_MEDIA_CONTENT as MEDIA_CONTENT, K3_MEDIA_END as MEDIA_END,
                                    K3_MEDIA_PAD as MEDIA_PAD, K3_OPEN as OPEN, K3_SEP as SEP, K3_STRUCTURAL_MARKERS)
from gateway.chat.base import ChatFormatError, Piece, RenderedPrompt, Tokenizer, encode_pieces, special_id
from gateway.chat.conversation import (
    arguments_object,
    normalize_messages,
    normalize_tools,
    options_mapping,
    plain_json,
)

STRUCTURAL_TOKENS = K3_STRUCTURAL_MARKERS

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"  # the official tokenizer's apply_chat_template default
TEMPLATE_KWARGS = ("thinking", "thinking_effort")

TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
DYNAMIC_TOOL_DECLARE_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
THINKING_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RAW_JSON_TEXT = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
JSON_OBJECT_TEXT = f"The system is invoked with `response_format=json_object`.\n{RAW_JSON_TEXT}"
JSON_SCHEMA_TEXT = (
    f"The system is invoked with `response_format=json_schema`.\n{RAW_JSON_TEXT}\n"
    "The JSON data must match the following schema:\n```json\n{schema}\n```"
)


# ----------------------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class K3Options:
    """The chat-template options of the K3 format (from `chat_template_kwargs`)."""

    thinking: bool = True
    thinking_effort: str | None = DEFAULT_THINKING_EFFORT

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "K3Options":
        kwargs = options_mapping(kwargs, "chat_template_kwargs")
        unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
        if unknown:
            raise ChatFormatError(
                f"chat_template_kwargs: unsupported keys {unknown}; kimi_k3 accepts {list(TEMPLATE_KWARGS)}"
            )
        thinking = kwargs.get("thinking", True)
        if not isinstance(thinking, bool):
            raise ChatFormatError("chat_template_kwargs.thinking must be true or false")
        effort = kwargs.get("thinking_effort", DEFAULT_THINKING_EFFORT)
        if thinking and effort is not None and effort not in THINKING_EFFORTS:
            raise ChatFormatError(f"chat_template_kwargs.thinking_effort must be one of {THINKING_EFFORTS} or null")
        return cls(thinking=thinking, thinking_effort=effort if thinking else None)


# ----------------------------------------------------------------------------------------------------------------
# Tags


def _escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> list[Piece]:
    pieces = [Piece(OPEN, True), Piece(tag)]
    for key, value in attrs:
        pieces += [Piece(f" {key}"), Piece('="'), Piece(_escape_attr(value)), Piece('"')]
    pieces.append(Piece(SEP, True))
    return pieces


def _close(tag: str) -> list[Piece]:
    return [Piece(CLOSE, True), Piece(tag), Piece(SEP, True)]


def _message(attrs: list[tuple[str, Any]], body: list[Piece]) -> list[Piece]:
    return _open("message", attrs) + body + _close("message") + [Piece(END_OF_MSG, True)]


def _internal_system(kind: str, body: str) -> list[Piece]:
    return _message([("role", "system"), ("type", kind)], [Piece(body.strip())])


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def _tool_declare(tools: list[dict], dynamic: bool) -> list[Piece]:
    header = DYNAMIC_TOOL_DECLARE_HEADER if dynamic else TOOL_DECLARE_HEADER
    body = f"{header}```json\n{_compact_json(_sorted_keys(tools))}\n```"
    return _message([("role", "system"), ("type", "tool-declare")], [Piece(body)])


# ----------------------------------------------------------------------------------------------------------------
# Content and images


def _image_size(size: Any, index: int) -> tuple[int, int]:
    ok = isinstance(size, (tuple, list)) and len(size) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    if not ok:
        raise ChatFormatError(f"image_sizes[{index}] must be (width, height) in positive pixels, got {size!r}")
    return size[0], size[1]


class _Images:
    """Hands out the media prompt of each image in order; counts what was used."""

    def __init__(self, sizes: Sequence[tuple[int, int]] | None) -> None:
        self._sizes = [_image_size(size, i) for i, size in enumerate(sizes or ())]
        self.used = 0

    def next_pieces(self) -> list[Piece]:
        if self.used >= len(self._sizes):
            raise ChatFormatError(
                f"the conversation has more images than image sizes ({len(self._sizes)}); "
                "pass one (width, height) per image"
            )
        width, height = self._sizes[self.used]
        self.used += 1
        return [Piece(MEDIA_BEGIN, True), Piece(f"image {width}x{height}"), Piece(MEDIA_CONTENT, True),
                Piece(MEDIA_PAD, True), Piece(MEDIA_END, True)]

    def check_all_used(self) -> None:
        if self.used != len(self._sizes):
            raise ChatFormatError(f"{len(self._sizes)} image sizes given for {self.used} images")


def _content(content: str | list[dict] | None, images: _Images) -> list[Piece]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Piece(content)]
    pieces: list[Piece] = []
    for part in content:
        pieces += [Piece(part["text"])] if part["type"] == "text" else images.next_pieces()
    return pieces


# ----------------------------------------------------------------------------------------------------------------
# Messages


def xtml_type(value: Any) -> str:
    """The XTML `type` attribute of an argument value (a JSON value)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _xtml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_call(call: dict, index: int) -> list[Piece]:
    function = call["function"]
    args, raw = arguments_object(function["arguments"])
    pieces = _open("call", [("tool", function["name"]), ("index", index)])
    if raw is not None:
        pieces += _open("json", [("type", "object")]) + [Piece(raw)] + _close("json")
    for key, value in args.items():
        pieces += _open("argument", [("key", key), ("type", xtml_type(value))])
        pieces += [Piece(_xtml_value(value))] + _close("argument")
    return pieces + _close("call")


def _assistant_body(message: dict, images: _Images, thinking: bool) -> list[Piece]:
    pieces: list[Piece] = []
    if thinking:
        reasoning = message.get("reasoning_content")
        pieces += _open("think")
        if reasoning is not None and reasoning.strip():
            pieces.append(Piece(reasoning))
        pieces += _close("think")
    pieces += _open("response") + _content(message["content"], images) + _close("response")
    calls = message.get("tool_calls")
    if calls:
        pieces += _open("tools")
        for index, call in enumerate(calls, start=1):
            pieces += _tool_call(call, index)
        pieces += _close("tools")
    return pieces


def _named(role: str, message: dict) -> list[tuple[str, Any]]:
    attrs: list[tuple[str, Any]] = [("role", role)]
    if message.get("name"):
        attrs.append(("name", message["name"]))
    return attrs


def _conversation(messages: list[dict], images: _Images, thinking: bool) -> list[Piece]:
    pieces: list[Piece] = []
    tool_index = 0
    for message in messages:
        role = message["role"]
        if role == "system" and message.get("tools"):
            pieces += _tool_declare(message["tools"], dynamic=True)
        elif role in ("system", "user"):
            pieces += _message(_named(role, message), _content(message["content"], images))
        elif role == "assistant":
            tool_index = 0
            pieces += _message(_named(role, message), _assistant_body(message, images, thinking))
        else:  # tool
            tool_index += 1
            attrs = [("role", "tool"), ("tool", message["name"]), ("index", tool_index)]
            pieces += _message(attrs, _content(message["content"], images))
    return pieces


# ----------------------------------------------------------------------------------------------------------------
# Request-level system messages


def _tool_choice(tool_choice: Any) -> list[Piece]:
    if tool_choice is None or isinstance(tool_choice, Mapping) or tool_choice == "auto":
        return []  # a named function is enforced by constrained decoding, not announced
    if not isinstance(tool_choice, str) or tool_choice not in TOOL_CHOICE_TEXT:
        raise ChatFormatError(f"tool_choice must be 'auto', 'required', 'none' or a function, got {tool_choice!r}")
    return _internal_system("tool-choice", TOOL_CHOICE_TEXT[tool_choice])


def _response_schema(json_schema: Any) -> Any:
    if not isinstance(json_schema, Mapping):
        raise ChatFormatError("response_format.json_schema must be an object")
    return json_schema.get("schema", json_schema.get("json_schema", json_schema))


def _response_format(response_format: Any) -> list[Piece]:
    if response_format is None:
        return []
    response_format = plain_json(options_mapping(response_format, "response_format"), "response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return []
    if kind == "json_object":
        return _internal_system("response-format", JSON_OBJECT_TEXT)
    if kind == "json_schema":
        schema = _sorted_keys(_response_schema(response_format.get("json_schema")))
        return _internal_system("response-format", JSON_SCHEMA_TEXT.format(schema=_compact_json(schema)))
    raise ChatFormatError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# ----------------------------------------------------------------------------------------------------------------
# The renderer


def render_pieces(messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                  chat_template_kwargs: Mapping[str, Any] | None = None, tool_choice: Any = None,
                  response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> list[Piece]:
    """The whole prompt as pieces (see the module docstring); raises ChatFormatError."""
    options = K3Options.from_kwargs(chat_template_kwargs)
    declared = normalize_tools(tools)
    conversation = normalize_messages(messages, allow_images=True, allow_system_tools=True)
    images = _Images(image_sizes)
    pieces: list[Piece] = _tool_declare(declared, dynamic=False) if declared else []
    if options.thinking and options.thinking_effort is not None:
        pieces += _internal_system("thinking-effort", THINKING_EFFORT_TEXT.format(effort=options.thinking_effort))
    pieces += _conversation(conversation, images, options.thinking)
    pieces += _tool_choice(tool_choice) + _response_format(response_format)
    if add_generation_prompt:
        pieces += _open("message", [("role", "assistant")]) + _open("think" if options.thinking else "response")
    images.check_all_used()
    return pieces


class K3Renderer:
    """Renders conversations for `kimi_k3` checkpoints. Immutable; safe to share between threads."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special_ids = {name: special_id(tokenizer, name) for name in STRUCTURAL_TOKENS}

    def render(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
               chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
               response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> RenderedPrompt:
        pieces = render_pieces(messages, tools, add_generation_prompt, chat_template_kwargs, tool_choice,
                               response_format, image_sizes)
        ids, starts = encode_pieces(self._tokenizer, pieces, self._special_ids)
        pads = tuple(start for piece, start in zip(pieces, starts) if piece.special and piece.text == MEDIA_PAD)
        thinking = K3Options.from_kwargs(chat_template_kwargs).thinking
        return RenderedPrompt(
            token_ids=ids,
            text="".join(piece.text for piece in pieces),
            starts_in_reasoning=add_generation_prompt and thinking,
            media_pad_positions=pads,
        )

    def render_text(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
                    response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> str:
        """The prompt as text (debugging, /tokenize previews); the same text `render` returns."""
        pieces = render_pieces(messages, tools, add_generation_prompt, chat_template_kwargs, tool_choice,
                               response_format, image_sizes)
        return "".join(piece.text for piece in pieces)
