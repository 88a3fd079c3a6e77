"""Images through `EngineCore`: the request carries its image spans, the runner encodes and feeds their rows.

- Greedy output of an image prompt equals the model-level greedy with the same image (`SequenceDriver` fed the
  encoder's rows directly), also when the prefill is chunked through the image and when two requests with
  different images are prefilled in one step (one encoder call for both).
- The same image twice: the second request reports cached tokens past the image and the same output, and the
  encoder does not run again. A different image with the same text (negative control) hits no block that
  overlaps the image, and its output differs.
- Preempted image requests recompute to the same tokens; a handoff with an image continues exactly, encodes
  nothing on the importer and leaves blocks keyed by the image hash there.
- Bad spans and undecodable bytes are refused at admission (`InvalidRequestError`); the engine keeps serving.
"""

from __future__ import annotations

import hashlib

import pytest

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.memory.hashing import BlockHasher, root_hash
from engine.model.presets import MEDIA_ID
from engine.sampling import SamplingParams
from engine.tokenizer import KimiTokenizer
from engine.vision.encoder import media_inputs
from engine.vision.feed import ImageInput
from engine.vision.processor import (ProcessorConfig, decode_image, expand_media_pads, media_spans, plan_resize,
                                     preprocess, to_tensors)
from tests.model_driver import SequenceDriver
from tests.unit.vision.images import encode, make_image

STEPS = 8
BLOCK = 4
A, B, C = (encode(make_image("RGB", 84, 56, 1)), encode(make_image("L", 98, 70, 2)),
           encode(make_image("RGB", 84, 56, 7)))  # C: same size as A, other pixels
TEXT = "Describe {} in detail, please, with every colour you can see in it."


def image_prompt_ids(tokenizer, images: list[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The expanded prompt ids for TEXT around the images, and their `ImageInput`s."""
    config = ProcessorConfig()
    sizes = [decode_image(data, config).size for data in images]
    text = TEXT.format(" and ".join(f"<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"
                                    for w, h in sizes))
    rows = [plan_resize(w, h, config).feature_rows for w, h in sizes]
    ids = expand_media_pads(tokenizer.encode(text, allow_special=True), rows, MEDIA_ID)
    return ids, tuple(ImageInput(offset, length, hashlib.sha256(data).digest(), data)
                      for (offset, length), data in zip(media_spans(ids, MEDIA_ID), images))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return KimiTokenizer.from_pretrained(tiny_dir)


def _engine(tiny_dir, **overrides) -> EngineCore:
    args = {"model": str(tiny_dir), "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 256, **overrides}
    return EngineCore(EngineArgs(**args))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return _engine(tiny_dir)


def run(engine: EngineCore, request_id: str, ids: list[int], media) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request run to the end."""
    engine.add_request(request_id, ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
                       media=media)
    return finish(engine)[request_id]


def finish(engine: EngineCore) -> dict[str, tuple[list[int], int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
    return done


def model_greedy(engine: EngineCore, ids: list[int], images: list[bytes]) -> list[int]:
    config = ProcessorConfig()
    pixel_values, grid_thws = to_tensors([preprocess(decode_image(d, config), config) for d in images])
    encoder = engine.media.feeder.encoder
    mm = media_inputs(ids, encoder(pixel_values, grid_thws), MEDIA_ID)
    return SequenceDriver(engine.model, max_seqs=1).greedy(0, ids, STEPS, mm=mm)


def test_greedy_equals_model_level(engine, tokenizer):
    ids, media = image_prompt_ids(tokenizer, [A, B])
    engine.reset_prefix_cache()
    got, cached = run(engine, "two", ids, media)
    assert cached == 0
    assert got == model_greedy(engine, ids, [A, B])


def test_same_image_hits_other_image_misses(engine, tokenizer):
    engine.reset_prefix_cache()
    ids, media = image_prompt_ids(tokenizer, [A])
    first, _ = run(engine, "first", ids, media)
    encoded = engine.media.feeder.num_encoded
    again, cached = run(engine, "again", ids, media)
    image_end = media[0].offset + media[0].length
    assert again == first and cached >= image_end
    assert engine.media.feeder.num_encoded == encoded  # fully cached blocks: the image is not encoded again
    other_ids, other = image_prompt_ids(tokenizer, [C])
    assert other_ids == ids and other[0].hash != media[0].hash
    changed, other_cached = run(engine, "other", other_ids, other)
    assert other_cached <= media[0].offset // BLOCK * BLOCK  # nothing that overlaps the image
    assert changed != first


def test_chunked_and_batched_prefill(tiny_dir, tokenizer, engine):
    chunked = _engine(tiny_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    one, media_one = image_prompt_ids(tokenizer, [A])
    two, media_two = image_prompt_ids(tokenizer, [B, C])
    assert run(chunked, "one", one, media_one)[0] == model_greedy(engine, one, [A])
    batched = _engine(tiny_dir, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    batched.add_request("one", one, params, media=media_one)
    batched.add_request("two", two, params, media=media_two)
    done = finish(batched)
    assert batched.media.feeder.num_encoded == 3
    assert done["one"][0] == model_greedy(engine, one, [A]) and done["two"][0] == model_greedy(engine, two, [B, C])


def test_bad_images_refused_at_admission(engine, tokenizer):
    ids, media = image_prompt_ids(tokenizer, [A])
    span = media[0]
    bad = {
        "short span": (ImageInput(span.offset, span.length - 1, span.hash, A),),
        "off the prompt": (ImageInput(len(ids) - 2, span.length, span.hash, A),),
        "not an image": (ImageInput(span.offset, span.length, span.hash, b"not a png"),),
        "no bytes": (ImageInput(span.offset, span.length, span.hash, b""),),
        "no spans": (),
    }
    for name, media_items in bad.items():
        with pytest.raises(InvalidRequestError):
            engine.add_request(f"bad-{name}", ids, SamplingParams(max_tokens=2), media=media_items)
    assert not engine.has_unfinished_requests()
    assert len(run(engine, "after", ids, media)[0]) == STEPS


def test_handoff_with_images_continues_and_hashes_alike(tiny_dir, tokenizer, engine):
    """Prefill on one engine, continue on another: same tokens, nothing encoded there, and the importer's cached
    blocks carry the image hash: the same image's block hashes find every prompt block, another image's none from
    the first block that overlaps the image (hits themselves need KDA snapshots, which an import does not make)."""
    ids, media = image_prompt_ids(tokenizer, [A])
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    direct, _ = run(engine, "direct", ids, media)
    engine.add_request("export", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), media=media,
                       export_on_finish=True)
    state = None
    while engine.has_unfinished_requests():
        state = next((out.exported for out in engine.step() if out.finished), state)
    importer = _engine(tiny_dir)
    importer.import_request("imported", state, params, media=media)
    assert finish(importer)["imported"][0] == direct and importer.media.feeder.num_encoded == 0
    _, other = image_prompt_ids(tokenizer, [C])
    same, changed = ([], [])
    BlockHasher(BLOCK, root_hash(importer.fingerprint, None), media).extend(same, ids)
    BlockHasher(BLOCK, root_hash(importer.fingerprint, None), other).extend(changed, ids)
    first_image_block = media[0].offset // BLOCK
    assert all(importer.prefix_presence(same).blocks)
    assert not any(importer.prefix_presence(changed).blocks[first_image_block:])


def test_preempted_image_requests_recompute_the_same(tiny_dir, tokenizer, engine):
    """A pool too small for both requests: one is preempted and recomputed (its image rows fed again)."""
    one, media_one = image_prompt_ids(tokenizer, [A])
    two, media_two = image_prompt_ids(tokenizer, [C])
    prompt_blocks = -(-(len(one) + 1) // BLOCK)  # both prompts fit, their outputs do not
    small = _engine(tiny_dir, enable_prefix_caching=False, num_kv_blocks=2 * prompt_blocks + 1)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    small.add_request("one", one, params, media=media_one)
    small.add_request("two", two, params, media=media_two)
    done = finish(small)
    assert small.scheduler.num_preemptions > 0
    assert done["one"][0] == model_greedy(engine, one, [A]) and done["two"][0] == model_greedy(engine, two, [C])
