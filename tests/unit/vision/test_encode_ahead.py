"""Images are decoded, checked and encoded off the step thread (engine/vision/feed.py `MediaSetup.encode_ahead`, run
by `AsyncEngine` on its media threads), and the decode limits reach the gateway's answers.

- Through `AsyncEngine` an image prompt gives the same greedy tokens as `EngineCore` encoding it inside a step, and
  the step thread encodes nothing (`MediaFeeder.num_encoded` stays 0; the in-step engine's counts the image: the
  negative control); the same image again is not encoded again (the encoder cache). A bad image is the
  `InvalidRequestError` admission gave before, and the engine keeps serving.
- gateway/media.py: an image over `max_decoded_bytes` is 413 `too_many_decoded_bytes`, one slower to decode than
  `max_decode_s` 400 `too_slow`; the default limits pass both (negative control).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import pytest

from engine import AsyncEngine, EngineArgs, SamplingParams
from engine.errors import InvalidRequestError
from engine.model.presets import MEDIA_ID
from engine.tokenizer import KimiTokenizer
from engine.vision.processor import ProcessorConfig
from gateway.media import MediaConfig, collect_images
from gateway.protocol import ApiError
from tests.unit.vision.images import encode, make_image
from tests.unit.vision.test_engine_images import STEPS, _engine, finish, image_prompt_ids

A = encode(make_image("RGB", 84, 56, 1))
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


async def _tokens(engine: AsyncEngine, request_id: str, ids: list[int], media) -> list[int]:
    outs = [out async for out in engine.generate(request_id, ids, GREEDY, media=media)]
    return outs[-1].outputs[0].token_ids


def test_async_engine_encodes_off_the_step_thread(tiny_dir):
    ids, media = image_prompt_ids(KimiTokenizer.from_pretrained(tiny_dir), [A])
    in_step = _engine(tiny_dir)
    in_step.add_request("in-step", ids, GREEDY, media=media)
    expected = finish(in_step)["in-step"][0]
    assert in_step.media.feeder.num_encoded == 1  # negative control: EngineCore alone encodes in its step
    bad = (dataclasses.replace(media[0], data=b"not an image"),)

    async def main():
        args = EngineArgs(model=str(tiny_dir), dtype="float32", block_size=4, num_kv_blocks=256)
        async with await AsyncEngine.create(args) as engine:
            runs = []
            engine.core.media.feeder.encoder.register_forward_hook(lambda *_: runs.append(1))
            got = await _tokens(engine, "ahead", ids, media)
            with pytest.raises(InvalidRequestError) as refused:
                await _tokens(engine, "bad", ids, bad)
            after = await _tokens(engine, "after", ids, media)
            return got, after, refused.value, engine.core.media.feeder.num_encoded, len(runs)

    got, after, refused, encoded_in_steps, encoder_runs = asyncio.run(main())
    assert got == expected and after == expected
    assert encoded_in_steps == 0  # every image reached the step encoded
    assert encoder_runs == 1  # the same image again: its rows come from the encoder cache
    assert "image 0" in str(refused) and refused.param == "messages"


def _message(data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize("limits, status, code", [({"max_decoded_bytes": 1000}, 413, "too_many_decoded_bytes"),
                                                   ({"max_decode_s": 1e-9}, 400, "too_slow")])
def test_gateway_answers_the_decode_limits(limits, status, code):
    messages = _message(A)
    assert len(collect_images(messages, MediaConfig(ProcessorConfig(), MEDIA_ID), {})) == 1  # negative control
    with pytest.raises(ApiError) as err:
        collect_images(messages, MediaConfig(ProcessorConfig(**limits), MEDIA_ID), {})
    assert err.value.status == status and err.value.code == code and "messages[0].content[0]" in str(err.value)
