"""Test helper: the official K3 image processor and multimodal generation, as oracles for engine/vision.

`official_processing()` is the official `kimi_k3_vision_processing` module, imported from the same synthetic
package the reference model runs in (tests/reference/k3_reference.py; these files need no stand-ins).
`official_preprocess(data, media_proc_cfg)` runs `KimiK3VisionProcessor` on one image (bytes) and returns
(pixel_values [L, 3, p, p], grid_thws [1, 3], num_tokens, prompt text). `reference_generate_with_images` runs the
official `KimiK3ForConditionalGeneration` on a prompt with one `<|media_pad|>` per image (the official model expands
it to the image's rows itself) and decodes greedily on its own cache.
"""

from __future__ import annotations

import importlib

import torch

from tests.reference.k3_reference import PACKAGE, load_reference_package, text_config


def official_processing():
    load_reference_package()
    return importlib.import_module(f"{PACKAGE}.kimi_k3_vision_processing")


def official_preprocess(data: bytes, media_proc_cfg: dict) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    processor = official_processing().KimiK3VisionProcessor(media_proc_cfg=dict(media_proc_cfg))
    num_tokens = processor.media_tokens_calculator({"type": "image", "image": data})
    media = {"type": "image", "image": data}
    out = processor.preprocess([media], return_tensors="pt")
    width, height = media["image"].size  # ensure_media_type replaced the bytes by the decoded image
    return out["pixel_values"], out["grid_thws"], num_tokens, processor.make_image_prompt(width, height)


@torch.no_grad()
def reference_generate_with_images(model, prompt: list[int], pixel_values: torch.Tensor, grid_thws: torch.Tensor,
                                   max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, the prefill's last-position logits [V])."""
    cache = load_reference_package().modeling_kimi_linear.KimiDynamicCache(text_config(model))
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, pixel_values=pixel_values, grid_thws=grid_thws, attention_mask=torch.ones_like(ids),
                past_key_values=cache, use_cache=True)
    first = out.logits[0, -1].float()
    tokens: list[int] = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == max_new_tokens:
            return tokens, first
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
