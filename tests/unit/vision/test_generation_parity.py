"""Whole-model parity with images: our `KimiForCausalLM` fed the `VisionEncoder`'s rows at the expanded
`<|media_pad|>` positions (`ForwardBatch.mm_embeds` / `mm_positions`) generates exactly the official
`KimiK3ForConditionalGeneration`'s greedy tokens (which expands each single pad to its image's rows itself) for
prompts with one and with two images, on the same tiny-k3 folder; the prefill's logits agree to 1e-4 relative.

Negative controls: another image, zeroed features and no features at all (the pad token's own embedding) each
change the generated tokens, so the comparison above would catch features that were dropped or misplaced.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import LoadConfig, load_model
from engine.model.presets import MEDIA_ID
from engine.tokenizer import KimiTokenizer
from engine.vision.encoder import feature_rows, media_inputs
from engine.vision.processor import ProcessorConfig, decode_image, expand_media_pads, preprocess, to_tensors
from tests.model_driver import SequenceDriver, rel_err
from tests.unit.vision.images import encode, make_image
from tests.unit.vision.official import reference_generate_with_images

STEPS = 12
REL_TOL = 1e-4
IMAGES = {"a": ("RGB", 84, 56, 1), "b": ("L", 98, 70, 2), "c": ("RGBA", 84, 56, 9)}  # mode, width, height, seed


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, LoadConfig(dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return KimiTokenizer.from_pretrained(tiny_dir)


def _prompt(tokenizer, images: list[str]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(token ids with one pad per image, pixel_values, grid_thws) for text, the images, text."""
    config = ProcessorConfig()
    processed = [preprocess(decode_image(encode(make_image(*IMAGES[name])), config), config) for name in images]
    text = "Describe " + " and then ".join(im.prompt for im in processed) + " in detail, please."
    ids = tokenizer.encode(text, allow_special=True)
    assert ids.count(MEDIA_ID) == len(images)
    return ids, *to_tensors(processed)


def _ours(model, encoder, ids, pixel_values, grid_thws, features=None) -> tuple[list[int], torch.Tensor]:
    feats = encoder(pixel_values, grid_thws) if features is None else features  # [M, hidden]
    expanded = expand_media_pads(ids, feature_rows(grid_thws, encoder.config.merge_kernel), MEDIA_ID)
    mm = media_inputs(expanded, feats, MEDIA_ID)
    first = SequenceDriver(model, max_seqs=1).prefill(0, expanded, all_logits=False, mm=mm)[0]
    return SequenceDriver(model, max_seqs=1).greedy(0, expanded, STEPS, mm=mm), first


@pytest.mark.parametrize("images", [["a"], ["a", "b"]], ids=["one-image", "two-images"])
def test_greedy_with_images_equals_official(model, encoder, reference, tokenizer, images):
    ids, pixel_values, grid_thws = _prompt(tokenizer, images)
    want, want_logits = reference_generate_with_images(reference, ids, pixel_values, grid_thws, STEPS)
    got, got_logits = _ours(model, encoder, ids, pixel_values, grid_thws)
    assert rel_err(got_logits, want_logits) <= REL_TOL
    assert got == want


def test_features_matter(model, encoder, tokenizer):
    ids, pixel_values, grid_thws = _prompt(tokenizer, ["a", "b"])
    base, _ = _ours(model, encoder, ids, pixel_values, grid_thws)
    other_ids, other_pixels, other_grids = _prompt(tokenizer, ["c", "b"])  # same size as "a", other content
    assert other_ids == ids and torch.equal(other_grids, grid_thws)
    changed, _ = _ours(model, encoder, ids, other_pixels, other_grids)
    feats = encoder(pixel_values, grid_thws)
    zeroed, _ = _ours(model, encoder, ids, pixel_values, grid_thws, features=torch.zeros_like(feats))
    driver = SequenceDriver(model, max_seqs=1)
    no_features = driver.greedy(0, expand_media_pads(ids, feature_rows(grid_thws, (2, 2)), MEDIA_ID), STEPS)
    assert changed != base and zeroed != base and no_features != base


def test_pad_count_must_match_rows(encoder, tokenizer):
    ids, pixel_values, grid_thws = _prompt(tokenizer, ["a"])
    with pytest.raises(ValueError, match="expand"):
        media_inputs(ids, encoder(pixel_values, grid_thws), MEDIA_ID)  # pads not expanded
