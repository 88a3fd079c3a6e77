"""The prompt-logprob fields of both APIs: what reaches the mesh (`SamplingParams.prompt_logprobs`), what is refused
with 400 naming the field, and the response shapes built from the mesh's prompt logprobs."""

from __future__ import annotations

import pytest

from gateway.events import PromptLogprobs
from gateway.protocol import ApiError, parse_chat, parse_completion, sampling_from_chat
from gateway.rest_responses import completion_logprobs, vllm_prompt_logprobs
from protos import common_pb2

SERVED = {"m"}
MSG = [{"role": "user", "content": "hi"}]


class _Tok:
    vocab_size = 100

    def encode(self, text, allow_special=False):
        return [ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def _completion(**fields):
    return parse_completion({"model": "m", "prompt": "abc", **fields}, _Tok(), SERVED)


def test_what_the_mesh_is_asked():
    assert not _completion(logprobs=2).sampling.HasField("prompt_logprobs")  # no echo: completion tokens only
    assert _completion(logprobs=2, echo=True).sampling.prompt_logprobs == 2
    assert _completion(logprobs=1, echo=True, prompt_logprobs=3).sampling.prompt_logprobs == 3
    assert _completion(prompt_logprobs=0).sampling.prompt_logprobs == 0
    only = _completion(echo=True, logprobs=1, max_tokens=0)
    assert only.echo_only and only.sampling.max_tokens == 1  # the mesh runs one token, which is dropped
    assert not _completion().echo_only
    chat = parse_chat({"model": "m", "messages": MSG, "prompt_logprobs": 2}, SERVED)
    assert sampling_from_chat(chat, True).prompt_logprobs == 2
    assert not sampling_from_chat(parse_chat({"model": "m", "messages": MSG}, SERVED), True).HasField(
        "prompt_logprobs")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"logprobs": 21, "echo": True}, "logprobs"),
])
def test_completion_refusals(fields, param):
    with pytest.raises(ApiError) as info:
        _completion(**fields)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("fields, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True}, "echo"), ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_refusals(fields, param):
    with pytest.raises(ApiError) as info:
        parse_chat({"model": "m", "messages": MSG, **fields}, SERVED)
    assert (info.value.status, info.value.param) == (400, param)


def _lp(token: int, logprob: float, rank: int, tops: list[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token, logprob=logprob, rank=rank,
                                   top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in tops])


def test_response_shapes():
    prompt = PromptLogprobs([0, 1, 2], [_lp(1, -0.5, 1, [(1, -0.5), (5, -1.5)]), _lp(2, -3.0, 4, [(7, -0.25), (8, -1.0)])])
    generated = [_lp(3, -0.125, 1, [(3, -0.125), (9, -2.0)])]
    echoed = completion_logprobs(_Tok(), generated, 0, prompt, top=1)
    assert echoed["tokens"] == ["A", "B", "C", "D"] and echoed["text_offset"] == [0, 1, 2, 3]
    assert echoed["token_logprobs"] == [None, -0.5, -3.0, -0.125]
    assert echoed["top_logprobs"] == [None, {"B": -0.5}, {"H": -0.25}, {"D": -0.125}]
    assert completion_logprobs(_Tok(), generated, 5)["text_offset"] == [5]  # no echo: as before
    shaped = vllm_prompt_logprobs(_Tok(), prompt, top=1)
    assert shaped[0] is None
    assert shaped[1] == {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "B"}}
    assert shaped[2] == {"7": {"logprob": -0.25, "rank": 1, "decoded_token": "H"},
                         "2": {"logprob": -3.0, "rank": 4, "decoded_token": "C"}}
