"""Structure hints: the token positions of a prompt where its reusable parts end, sent to the workers so they
snapshot the KDA state there (protos `PrefillRequest.snapshot_hints` / `DecodeRequest.snapshot_hints`).

Contract:
- `structure_hints(renderer, messages, tools, chat_template_kwargs, prompt_ids, special_ids)`: for a chat, the
  positions where the system/tool block ends (`render(messages[:k], add_generation_prompt=False)` for k = the
  number of leading system messages; the tool-declare and thinking-effort messages render before the
  conversation, so k = 0 with tools and no system message still marks the block) and where each message but the
  last ends. Linear in the chat: at most two prefix renders (the system block, and `messages[:-1]`), whatever the
  number of messages; the message ends inside the `messages[:-1]` render are the positions just after each
  occurrence of its last token when that token is one of `special_ids` (the format's end-of-message marker, e.g.
  K3 `<|end_of_msg|>`, K2 `<|im_end|>`: special ids appear only where the renderer put structure); without
  `special_ids` only the two rendered ends are hints. A position is kept only where the prefix render's ids are
  identical to `prompt_ids` up to it and it lies in (0, len(prompt_ids)] (message ends inside the system block
  belong to it: not hints); a prefix the format cannot render is skipped. At most `MAX_HINTS` (the system block and the last message ends), sorted, duplicates dropped. Never
  raises for a chat the full render accepted.
- `merge_hints(*groups)`: the union of hint groups, sorted, duplicates dropped, as a tuple.
- `shift_past_media(hints, media)`: hints counted in the rendered prompt (one `<|media_pad|>` per image) moved to
  the prompt the mesh gets, where each pad is expanded to its image's `num_tokens` feature rows (`media`: the
  `MediaItem`s, `token_offset` in expanded positions).
- `check_client_hints(hints, prompt_length)` (from `gateway.protocol.common`, re-exported): the client's
  `kdamesh_snapshot_hints` as a sorted tuple; `ApiError` 400 `invalid_request_error` with
  `param: "kdamesh_snapshot_hints"` for a value outside [0, prompt length].
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from gateway.chat import ChatFormatError, ChatRenderer
from gateway.protocol.common import check_client_hints, merge_hints

__all__ = ["MAX_HINTS", "check_client_hints", "merge_hints", "shift_past_media", "structure_hints"]

MAX_HINTS = 16


def _system_count(messages: Sequence[Any]) -> int:
    system = 0
    while system < len(messages) and isinstance(messages[system], Mapping) \
            and messages[system].get("role") == "system":
        system += 1
    return min(system, len(messages) - 1)


def _prefix_ids(renderer: ChatRenderer, messages: Sequence[Any], k: int, tools: Any,
                chat_template_kwargs: Mapping[str, Any] | None) -> list[int]:
    try:
        return renderer.render(list(messages[:k]), tools, False, chat_template_kwargs).token_ids
    except ChatFormatError:
        return []  # e.g. a prefix that ends between a tool call and its results


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _message_ends(ids: list[int], special_ids: Collection[int]) -> list[int]:
    """The positions just after each end-of-message marker in `ids` (its last token, when special)."""
    if not ids or ids[-1] not in special_ids:
        return [len(ids)] if ids else []
    marker = ids[-1]
    return [i + 1 for i, token in enumerate(ids) if token == marker]


def structure_hints(renderer: ChatRenderer, messages: Sequence[Any], tools: Any,
                    chat_template_kwargs: Mapping[str, Any] | None, prompt_ids: Sequence[int],
                    special_ids: Collection[int] = ()) -> tuple[int, ...]:
    if not messages:
        return ()
    system = _system_count(messages)
    block = _prefix_ids(renderer, messages, system, tools, chat_template_kwargs)
    last = _prefix_ids(renderer, messages, len(messages) - 1, tools, chat_template_kwargs)
    block_end = [len(block)] if 0 < len(block) <= _common_length(block, prompt_ids) else []
    same = _common_length(last, prompt_ids)
    ends = [end for end in _message_ends(last, special_ids) if len(block) < end <= same]  # past the block
    return merge_hints(block_end, ends[-(MAX_HINTS - len(block_end)):])


def shift_past_media(hints: Sequence[int], media: Sequence[Any]) -> tuple[int, ...]:
    pads: list[tuple[int, int]] = []  # (pad position in the rendered prompt, extra tokens its expansion adds)
    extra = 0
    for item in sorted(media, key=lambda m: m.token_offset):
        pads.append((item.token_offset - extra, item.num_tokens - 1))
        extra += item.num_tokens - 1
    return tuple(h + sum(added for pad, added in pads if pad < h) for h in hints)
