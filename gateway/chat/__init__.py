"""Chat formats: an OpenAI-style conversation -> prompt token ids, chosen by the checkpoint's family.

Contract
--------
* `ChatRenderer.from_pretrained(folder)` reads `config.json` (`model_type`): `kimi_k3` renders with the XTML program
  (`gateway.chat.k3`), `kimi_linear` with the checkpoint's Jinja2 chat template (`gateway.chat.k2`). The tokenizer is
  `engine.tokenizer.KimiTokenizer` from the same folder unless one is passed.
* `render(messages, tools, add_generation_prompt, chat_template_kwargs, *, tool_choice, response_format, image_sizes)`
  returns a `RenderedPrompt` (`token_ids`, `text`, `starts_in_reasoning`, `media_pad_positions`). Special ids appear
  only where the format puts structure; request text never becomes a special id. `tool_choice`, `response_format`
  and `image_sizes` only change K3 prompts (the K2 template has no such messages and refuses images).
* `chat_template_kwargs`: K3 accepts `thinking` (bool, default true) and `thinking_effort` ("low" | "high" | "max" |
  null, default "max"); K2 passes them to the template (kdamesh's template reads `thinking`).
* Malformed conversations and options raise `ChatFormatError` (a `ValueError`; HTTP 400). Nothing here imports torch.
* `output_format` names the tool-call / reasoning parser pair for the family (`kimi_k3` or `kimi_k2`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from gateway.chat.base import ChatFormatError, Piece, RenderedPrompt, Tokenizer
from gateway.chat.k2 import K2Renderer, k2_chat_template, load_chat_template, write_k2_chat_template
from gateway.chat.k3 import K3Renderer

FAMILIES = ("kimi_k3", "kimi_linear")
OUTPUT_FORMATS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2"}

__all__ = [
    "ChatFormatError",
    "ChatRenderer",
    "Piece",
    "RenderedPrompt",
    "k2_chat_template",
    "load_chat_template",
    "read_family",
    "write_k2_chat_template",
]


def read_family(folder: str | Path) -> str:
    """The chat family of a checkpoint folder, from `config.json`'s `model_type`."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{folder}: model_type {family!r} has no chat format here; expected one of {FAMILIES}")
    return family


class ChatRenderer:
    """The chat format of one checkpoint. Immutable after construction; safe to share between threads."""

    def __init__(self, family: str, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
        if family == "kimi_linear" and chat_template is None:
            raise ValueError("kimi_linear needs the checkpoint's chat template")
        self.family = family
        self.output_format = OUTPUT_FORMATS[family]
        self._impl = K3Renderer(tokenizer) if family == "kimi_k3" else K2Renderer(tokenizer, chat_template)

    @classmethod
    def from_pretrained(cls, folder: str | Path, tokenizer: Tokenizer | None = None) -> "ChatRenderer":
        family = read_family(folder)
        if tokenizer is None:
            from engine.tokenizer import KimiTokenizer

            tokenizer = KimiTokenizer.from_pretrained(folder)
        template = load_chat_template(folder) if family == "kimi_linear" else None
        return cls(family, tokenizer, template)

    def render(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
               chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
               response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> RenderedPrompt:
        return self._impl.render(messages, tools, add_generation_prompt, chat_template_kwargs,
                                 tool_choice=tool_choice, response_format=response_format, image_sizes=image_sizes)

    def render_text(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None, *, tool_choice: Any = None,
                    response_format: Any = None, image_sizes: Sequence[tuple[int, int]] | None = None) -> str:
        """The prompt as text (debugging); equal to `render(...).text`."""
        return self._impl.render_text(messages, tools, add_generation_prompt, chat_template_kwargs,
                                      tool_choice=tool_choice, response_format=response_format,
                                      image_sizes=image_sizes)
