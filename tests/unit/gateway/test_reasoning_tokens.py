"""`usage.completion_tokens_details.reasoning_tokens`: a chat choice counts the tokens whose text began inside the
reasoning block as its output parser read it (the closing markup included), token by token or in multi-token
events alike; without a reasoning parser the count is 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.chat_run import _ChatChoice
from gateway.mesh_client import TokenEvent
from gateway.protocol import ChatCompletionRequest
from gateway.protocol.chat import sampling_from_chat
from gateway.text import ChoiceText

REASONING = "Let me add 27 and 74."
K3_OUT = f"{REASONING}<|close|>think<|sep|><|open|>response<|sep|>101<|close|>response<|sep|><|close|>message<|sep|>"
K2_OUT = f"<think>{REASONING}</think>101"


def _choice(tok, parser: str | None, starts_in_reasoning: bool) -> _ChatChoice:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    plan = SimpleNamespace(request=request, sampling=sampling_from_chat(request, skip_special_tokens=False),
                           tool_parser=parser, reasoning_parser=parser,
                           prompt=SimpleNamespace(starts_in_reasoning=starts_in_reasoning))
    context = SimpleNamespace(choice_text=lambda rules: ChoiceText(tok, rules), marker_ids=None)
    return _ChatChoice(0, context, plan)


def _run(choice: _ChatChoice, ids: list[int], per_event: int) -> None:
    for at in range(0, len(ids), per_event):
        chunk = ids[at:at + per_event]
        last = at + per_event >= len(ids)
        text = choice.text.add(TokenEvent(0, chunk, finish_reason="length" if last else None))
        choice.feed(text, choice.text.finished)


@pytest.mark.parametrize("per_event", [1, 3])
def test_k3_reasoning_tokens(k3_tok, per_event):
    ids = k3_tok.encode(K3_OUT, allow_special=True)
    choice = _choice(k3_tok, "kimi_k3", starts_in_reasoning=True)
    _run(choice, ids, per_event)
    expected = len(k3_tok.encode(REASONING)) + len(k3_tok.encode("<|close|>think<|sep|>", allow_special=True))
    assert choice.reasoning_tokens() == expected < len(ids)
    # the negative control: with thinking off nothing is reasoning
    off = _choice(k3_tok, "kimi_k3", starts_in_reasoning=False)
    _run(off, k3_tok.encode("101<|close|>response<|sep|>", allow_special=True), per_event)
    assert off.reasoning_tokens() == 0


def test_k2_reasoning_tokens(k2_tok):
    ids = k2_tok.encode(K2_OUT, allow_special=True)
    choice = _choice(k2_tok, "kimi_k2", starts_in_reasoning=False)
    _run(choice, ids, 1)
    markup = len(k2_tok.encode("<think>", allow_special=True)) + len(k2_tok.encode("</think>", allow_special=True))
    assert choice.reasoning_tokens() == len(k2_tok.encode(REASONING)) + markup


def test_unfinished_reasoning_counts_every_token_and_no_parser_counts_none(k3_tok):
    ids = k3_tok.encode(REASONING)
    thinking = _choice(k3_tok, "kimi_k3", starts_in_reasoning=True)
    _run(thinking, ids, 2)
    assert thinking.reasoning_tokens() == len(ids)
    plain = _choice(k3_tok, None, starts_in_reasoning=True)
    _run(plain, ids, 2)
    assert plain.reasoning_tokens() == 0
