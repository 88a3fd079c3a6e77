"""Kimi K2 / Kimi Linear chat format: the checkpoint's Jinja2 chat template, rendered like `transformers`, tokenized
so that only the template's own markers become special ids.

Contract
--------
* `load_chat_template(folder)` reads `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string,
  or a list of `{"name", "template"}` from which "default" is taken). `write_k2_chat_template(folder)` writes kdamesh's
  own template (`engine/assets/kimi_k2_chat_template.jinja`) into a checkpoint folder as `chat_template.jinja`.
* The template runs as `transformers.apply_chat_template` runs it: an immutable sandboxed Jinja2 environment with
  `trim_blocks`, `lstrip_blocks` and the loop-controls extension; `tojson` without HTML escaping (keyword arguments
  `ensure_ascii`, `indent`, `separators`, `sort_keys`); `raise_exception`; `strftime_now`; variables `messages`,
  `tools`, `add_generation_prompt`, the tokenizer's `bos_token`/`eos_token`/`pad_token`/`unk_token`, and the
  request's `chat_template_kwargs`.
* Before rendering, messages are validated and normalised (`conversation.normalize_messages`; images are refused:
  Kimi Linear is text-only) and tool-call ids are rewritten to `functions.NAME:IDX`, IDX counting the calls of the
  whole conversation from 0; each tool result's `tool_call_id` is rewritten to the id of the call it answers.
* Injection safety: every string that comes from the request (message fields, tool schemas, keys included, and
  `chat_template_kwargs`) is escaped before the template sees it — each character that begins or ends a special-token
  string (for Kimi vocabularies `<`, `>`, `[`, `]`) is replaced by a private-use character (private-use characters
  already in the text are themselves escaped). No special-token string can then begin, end or lie inside request
  text. The rendered text is split on special-token strings — all of them the template's own — which become ids;
  every other stretch is unescaped and encoded with `allow_special=False`. Escaping changes only strings that hold
  those characters, so the template's logic (tests of roles, truthiness, `tojson`) is unaffected; a template that
  compares, sorts or slices such strings sees the escaped form. A template that builds a special token out of request
  text (`<|{{ name }}|>`) is outside this guarantee.
* Template errors (`raise_exception`, undefined variables used wrongly, …) raise `ChatFormatError`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.formats.markers import K2_THINK_OPEN as THINK_OPEN
from gateway.chat.base import ChatFormatError, Piece, RenderedPrompt, Tokenizer, encode_pieces
from gateway.chat.conversation import normalize_messages, normalize_tools, options_mapping, plain_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
K2_TEMPLATE_ASSET = ("engine", "assets/kimi_k2_chat_template.jinja")  # package, path inside it
RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "unk_token")
PRIVATE_USE_START = 0xE000  # escape characters are taken from here: U+E000 is the escape, then one per boundary char


# ----------------------------------------------------------------------------------------------------------------
# Template files


def load_chat_template(folder: str | Path) -> str:
    """The chat template shipped in a checkpoint folder (see the module docstring)."""
    folder = Path(folder)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    config_path = folder / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise FileNotFoundError(f"{folder}: no {CHAT_TEMPLATE_FILE} and no chat_template in {TOKENIZER_CONFIG_FILE}")
    return template


def k2_chat_template() -> str:
    """kdamesh's Kimi K2 / Kimi Linear chat template (the `engine/assets` file; importing `engine` loads no torch)."""
    package, path = K2_TEMPLATE_ASSET
    return resources.files(package).joinpath(path).read_text(encoding="utf-8")


def write_k2_chat_template(folder: str | Path) -> Path:
    """Write kdamesh's Kimi K2 / Kimi Linear template into a checkpoint folder as `chat_template.jinja`."""
    target = Path(folder) / CHAT_TEMPLATE_FILE
    target.write_text(k2_chat_template(), encoding="utf-8")
    return target


# ----------------------------------------------------------------------------------------------------------------
# The Jinja2 environment (what transformers' apply_chat_template uses)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------------
# Escaping request strings


class Escaper:
    """An invertible character mapping that removes every special-token boundary character from a string.

    `boundary` = the first and last characters of all special-token strings. Each boundary character maps to its own
    private-use character; private-use characters of the mapping that occur in the input are prefixed with the escape
    character (U+E000). `unescape(escape(s)) == s` for every s.
    """

    def __init__(self, special_tokens: Sequence[str]) -> None:
        boundary = sorted({token[0] for token in special_tokens} | {token[-1] for token in special_tokens})
        self.escape_char = chr(PRIVATE_USE_START)
        self.encoded = {ch: chr(PRIVATE_USE_START + 1 + i) for i, ch in enumerate(boundary)}
        self.decoded = {code: ch for ch, code in self.encoded.items()}
        reserved = {self.escape_char, *self.decoded}
        if reserved & set(boundary):
            raise ValueError("special tokens use private-use characters the escaper needs")
        self._escape_table = {ord(ch): code for ch, code in self.encoded.items()}
        self._escape_table.update({ord(ch): self.escape_char + ch for ch in reserved})
        self._unescape_re = re.compile(f"{re.escape(self.escape_char)}(.)|[{''.join(map(re.escape, self.decoded))}]",
                                       re.DOTALL)

    @property
    def reserved_chars(self) -> set[str]:
        return {self.escape_char, *self.decoded}

    def escape(self, text: str) -> str:
        return text.translate(self._escape_table)

    def unescape(self, text: str) -> str:
        return self._unescape_re.sub(lambda m: m.group(1) if m.group(1) is not None else self.decoded[m.group(0)], text)

    def escape_data(self, value: Any) -> Any:
        """Escape every string (dict keys included) in a plain-JSON value."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(key): self.escape_data(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape_data(item) for item in value]
        return value


# ----------------------------------------------------------------------------------------------------------------
# Conversation preparation


def assign_call_ids(messages: list[dict]) -> list[dict]:
    """Rewrite tool-call ids to `functions.NAME:IDX` (IDX counted across the conversation) and results to match.

    `messages` must be normalised (every tool result answers a call of the latest assistant message).
    """
    out: list[dict] = []
    renamed: dict[str, str] = {}
    count = 0
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            renamed, calls = {}, []
            for call in message["tool_calls"]:
                new_id = f"functions.{call['function']['name']}:{count}"
                renamed[call["id"]] = new_id
                calls.append({**call, "id": new_id})
                count += 1
            message = {**message, "tool_calls": calls}
        elif message["role"] == "assistant":
            renamed = {}
        elif message["role"] == "tool":
            message = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
        out.append(message)
    return out


def prepare_conversation(messages: Any, tools: Any) -> tuple[list[dict], list[dict] | None]:
    """Validated, normalised messages with canonical call ids, and the validated tools (the template's inputs)."""
    return assign_call_ids(normalize_messages(messages, allow_images=False)), normalize_tools(tools)


def _template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = options_mapping(kwargs, "chat_template_kwargs")
    clash = sorted(set(kwargs) & set(RESERVED_VARIABLES))
    if clash:
        raise ChatFormatError(f"chat_template_kwargs may not set {clash}")
    return plain_json(kwargs, "chat_template_kwargs")


# ----------------------------------------------------------------------------------------------------------------
# The renderer


class K2Renderer:
    """Renders conversations with a Kimi K2-style Jinja2 template. Immutable; safe to share between threads."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str) -> None:
        self._tokenizer = tokenizer
        self._special_ids = dict(tokenizer.special_tokens)
        self._escaper = Escaper(list(self._special_ids))
        if self._escaper.reserved_chars & set(chat_template):
            raise ValueError("the chat template contains private-use characters reserved for escaping")
        self._template = compile_template(chat_template)
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives)))
        self._role_tokens = {name: self._token_name(tokenizer, name) for name in ("bos", "eos", "pad", "unk")}

    @classmethod
    def from_pretrained(cls, folder: str | Path, tokenizer: Tokenizer) -> "K2Renderer":
        return cls(tokenizer, load_chat_template(folder))

    @staticmethod
    def _token_name(tokenizer: Tokenizer, role: str) -> str | None:
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        return names.get(token_id)

    def _render_escaped(self, messages: Any, tools: Any, add_generation_prompt: bool,
                        chat_template_kwargs: Mapping[str, Any] | None) -> str:
        conversation, declared = prepare_conversation(messages, tools)
        kwargs = _template_kwargs(chat_template_kwargs)
        context = {key: self._escaper.escape_data(value) for key, value in kwargs.items()}
        context.update({f"{role}_token": name for role, name in self._role_tokens.items()})
        try:
            return self._template.render(
                messages=self._escaper.escape_data(conversation),
                tools=self._escaper.escape_data(declared),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatFormatError(f"chat template failed: {exc}") from exc

    def pieces(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               image_sizes: Sequence[tuple[int, int]] | None = None) -> list[Piece]:
        """The rendered prompt split into the template's special tokens and (unescaped) text."""
        if image_sizes:
            raise ChatFormatError("this model is text-only; images are not supported")
        escaped = self._render_escaped(messages, tools, add_generation_prompt, chat_template_kwargs)
        pieces: list[Piece] = []
        at = 0
        for match in self._special_re.finditer(escaped):
            if match.start() > at:
                pieces.append(Piece(self._escaper.unescape(escaped[at:match.start()])))
            pieces.append(Piece(match.group(0), special=True))
            at = match.end()
        if at < len(escaped):
            pieces.append(Piece(self._escaper.unescape(escaped[at:])))
        return pieces

    def render(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
               chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
               response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> RenderedPrompt:
        """The prompt (`tool_choice` and `response_format` change nothing: the template has no such messages)."""
        pieces = self.pieces(messages, tools, add_generation_prompt, chat_template_kwargs, image_sizes)
        ids, _ = encode_pieces(self._tokenizer, pieces, self._special_ids)
        opened_think = bool(pieces) and pieces[-1] == Piece(THINK_OPEN, special=True)
        return RenderedPrompt(
            token_ids=ids,
            text="".join(piece.text for piece in pieces),
            starts_in_reasoning=add_generation_prompt and opened_think,
        )

    def render_text(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
                    response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> str:
        """The prompt as text (debugging, /tokenize previews); the same text `render` returns."""
        pieces = self.pieces(messages, tools, add_generation_prompt, chat_template_kwargs, image_sizes)
        return "".join(piece.text for piece in pieces)
