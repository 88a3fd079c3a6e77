"""Shared types of the chat renderers: the error they raise, the prompt they return, and how pieces become ids.

Contract
--------
* A renderer produces a list of `Piece`s: structural markers (`special=True`, exactly one special-token string each)
  and text (`special=False`). `encode_pieces` maps each marker to its id and encodes each text piece on its own with
  `allow_special=False`, so text — whoever wrote it — never yields a special id. Text pieces are NOT merged: where a
  renderer splits text into several pieces (as the official K3 renderer does inside tags), the ids follow the split.
* `ChatFormatError` (a `ValueError`) is the only exception a renderer raises for a malformed conversation or bad
  options; the gateway maps it to HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol


class ChatFormatError(ValueError):
    """A conversation, tool list or chat-template option the chat format cannot render (client error)."""


class Tokenizer(Protocol):
    """What renderers need from `engine.tokenizer.KimiTokenizer`."""

    @property
    def special_tokens(self) -> dict[str, int]: ...

    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class Piece:
    """One rendered piece: a special-token string (`special=True`) or ordinary text."""

    text: str
    special: bool = False


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered conversation.

    token_ids: the prompt ids; special ids appear only where the renderer put structure.
    text: the same prompt as text (special tokens as their strings); `tokenizer.decode(token_ids) == text`.
    starts_in_reasoning: the generation prompt left the assistant inside its reasoning block, so the output parser
        must start in reasoning (K3 `think` opened; K2 `<think>` opened).
    media_pad_positions: index in `token_ids` of each image's `<|media_pad|>` id, in image order (K3 only).
    """

    token_ids: list[int]
    text: str
    starts_in_reasoning: bool = False
    media_pad_positions: tuple[int, ...] = ()


def special_id(tokenizer: Tokenizer, name: str) -> int:
    """The id of a special-token string; a tokenizer without it cannot serve this chat format."""
    ids = tokenizer.special_tokens
    if name not in ids:
        raise ValueError(f"the tokenizer has no special token {name!r}; it does not belong to this chat format")
    return ids[name]


def encode_pieces(
    tokenizer: Tokenizer, pieces: Iterable[Piece], special_ids: dict[str, int]
) -> tuple[list[int], list[int]]:
    """Pieces -> (token ids, start index in the ids of every piece). Markers by lookup, text with specials off."""
    ids: list[int] = []
    starts: list[int] = []
    for piece in pieces:
        starts.append(len(ids))
        if piece.special:
            ids.append(special_ids[piece.text])
        elif piece.text:
            ids.extend(tokenizer.encode(piece.text, allow_special=False))
    return ids, starts
