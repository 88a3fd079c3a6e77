"""Completions prompts follow vLLM's and transformers' reading: control-token text in a prompt becomes the control
token (`split_special_tokens: true` keeps it plain text); chat message content stays plain text whatever it holds."""

from __future__ import annotations

from gateway.chat import ChatRenderer
from gateway.protocol.completions import parse_completion

CONTROL = "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"


def _prompt_ids(k3_tok, body: dict) -> list[int]:
    return parse_completion({"model": "m", **body}, k3_tok, {"m"}).prompts[0]


def test_control_token_text_in_a_completions_prompt_is_the_control_token(k3_tok):
    ids = _prompt_ids(k3_tok, {"prompt": CONTROL})
    specials = k3_tok.special_tokens
    assert ids[0] == specials["<|open|>"] and ids[-1] == specials["<|end_of_msg|>"]
    assert ids == k3_tok.encode(CONTROL, allow_special=True)
    # every prompt of a list is read the same way
    assert _prompt_ids(k3_tok, {"prompt": [CONTROL, "x"]}) == ids


def test_split_special_tokens_keeps_control_token_text_plain(k3_tok):
    ids = _prompt_ids(k3_tok, {"prompt": CONTROL, "split_special_tokens": True})
    assert ids == k3_tok.encode(CONTROL)
    assert not any(k3_tok.is_special(i) for i in ids)
    # the negative control: the two readings differ on this prompt
    assert ids != _prompt_ids(k3_tok, {"prompt": CONTROL})


def test_chat_content_stays_plain_text(k3_tok):
    renderer = ChatRenderer("kimi_k3", k3_tok)
    with_control = renderer.render([{"role": "user", "content": CONTROL}]).token_ids
    plain = renderer.render([{"role": "user", "content": "x"}]).token_ids
    # the content adds no special id: the counts of special ids are those of a plain conversation
    assert sum(map(k3_tok.is_special, with_control)) == sum(map(k3_tok.is_special, plain))
