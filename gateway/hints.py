"""Structure hints: the token positions of a prompt where its reusable parts end, sent to the workers so they
snapshot the KDA state there (protos `PrefillRequest.snapshot_hints` / `DecodeRequest.snapshot_hints`).

Contract:
- `structure_hints(renderer, messages, tools, chat_template_kwargs, prompt_ids)`: for a chat, the length in tokens
  of `render(messages[:k], add_generation_prompt=False)` for k = the number of leading system messages (the
  system/tool block: the tool-declare and thinking-effort messages render before the conversation, so k = 0 with
  tools and no system message still marks the block) and for every k up to `len(messages) - 1` (every message but
  the last ends). Only the system block and the last `MAX_PREFIX_RENDERS - 1` message ends are rendered (rendering prefixes is O(n) each). A
  position is kept only where the prefix render's ids are a prefix of `prompt_ids` (a hint is useful only where
  the tokens are identical) and it lies in (0, len(prompt_ids)]; a prefix the format cannot render is skipped.
  Sorted, duplicates dropped. Never raises for a chat the full render accepted.
- `merge_hints(*groups)`: the union of hint groups, sorted, duplicates dropped, as a tuple.
- `shift_past_media(hints, media)`: hints counted in the rendered prompt (one `<|media_pad|>` per image) moved to
  the prompt the mesh gets, where each pad is expanded to its image's `num_tokens` feature rows (`media`: the
  `MediaItem`s, `token_offset` in expanded positions).
- `check_client_hints(hints, prompt_length)` (from `gateway.protocol.common`, re-exported): the client's
  `kdamesh_snapshot_hints` as a sorted tuple; `ApiError` 400 `invalid_request_error` with
  `param: "kdamesh_snapshot_hints"` for a value outside [0, prompt length].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.chat import ChatFormatError, ChatRenderer
from gateway.protocol.common import check_client_hints, merge_hints

__all__ = ["MAX_PREFIX_RENDERS", "check_client_hints", "merge_hints", "shift_past_media", "structure_hints"]

MAX_PREFIX_RENDERS = 16


def _prefix_counts(messages: Sequence[Any]) -> list[int]:
    """The k whose prefix `messages[:k]` ends a reusable part: the system block, then every message but the last."""
    system = 0
    while system < len(messages) and isinstance(messages[system], Mapping) \
            and messages[system].get("role") == "system":
        system += 1
    recent = range(max(1, len(messages) - MAX_PREFIX_RENDERS + 1), len(messages))
    return sorted({min(system, len(messages) - 1), *recent})


def structure_hints(renderer: ChatRenderer, messages: Sequence[Any], tools: Any,
                    chat_template_kwargs: Mapping[str, Any] | None, prompt_ids: Sequence[int]) -> tuple[int, ...]:
    hints: list[int] = []
    for k in _prefix_counts(messages):
        try:
            ids = renderer.render(list(messages[:k]), tools, False, chat_template_kwargs).token_ids
        except ChatFormatError:
            continue  # e.g. a prefix that ends between a tool call and its results
        if 0 < len(ids) <= len(prompt_ids) and list(prompt_ids[:len(ids)]) == ids:
            hints.append(len(ids))
    return merge_hints(hints)


def shift_past_media(hints: Sequence[int], media: Sequence[Any]) -> tuple[int, ...]:
    pads: list[tuple[int, int]] = []  # (pad position in the rendered prompt, extra tokens its expansion adds)
    extra = 0
    for item in sorted(media, key=lambda m: m.token_offset):
        pads.append((item.token_offset - extra, item.num_tokens - 1))
        extra += item.num_tokens - 1
    return tuple(h + sum(added for pad, added in pads if pad < h) for h in hints)
