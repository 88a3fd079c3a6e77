"""Loads (and makes) the K3 vision encoder's weights: `vision_tower.*` and `mm_projector.*` of a checkpoint folder.

Contract:
- `load_vision(model_dir, LoadConfig)` returns the `VisionEncoder` of a `kimi_k3` folder, or None for a folder
  that serves text only: no `vision_config` in config.json, or no vision tensors in its safetensors (one log line
  says which). The text model loads separately (`engine.model.loader.load_model`, which leaves these tensors to
  this module). Names and shapes are checked from the safetensors headers before any data is read; one
  `CheckpointError` names every missing, unexpected (under the vision prefixes) and mis-shaped tensor.
- `load_format="dummy"` fills seeded random weights instead (`init_vision_weights`); `fastsafetensors` reads with
  safetensors (the tower is small). `dtype` resolves as for the text model (`auto`: the checkpoint's dtype on CUDA,
  fp32 on CPU). The official code casts the tower to the text model's dtype; so does this.
- `init_vision_weights(encoder, seed)` is deterministic (same seed, same config → same bytes) and draws from its own
  generator, so adding a tower to a preset leaves the text weights of the same seed unchanged. Magnitudes keep
  activations O(1): matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), biases N(0, 0.02²), the position grid
  N(0, 1) as the official initialiser.
- `vision_tensors(encoder, dtype)` -> {official name: tensor} for `save_weights(..., extra_tensors=...)`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig, load_model_config
from engine.model.init import materialize
from engine.model.loader import (
    LOAD_FORMATS,
    CheckpointError,
    LoadConfig,
    checkpoint_files,
    read_header,
    resolve_dtype,
)
from engine.vision.encoder import VISION_PREFIXES, VisionEncoder

logger = logging.getLogger(__name__)

VISION_SEED_OFFSET = 1_000_003  # the vision generator's seed is seed + this, apart from the text model's stream
NORM_NAMES = ("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")


def init_vision_weights(encoder: VisionEncoder, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed + VISION_SEED_OFFSET)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            shape = tuple(param.shape)
            if name.endswith(NORM_NAMES):
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("bias"):
                value = 0.02 * torch.randn(shape, generator=gen)
            elif name.endswith("pos_emb.weight"):
                value = torch.randn(shape, generator=gen)
            else:  # [out, in...]: a linear layer or the patch convolution
                value = torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
            param.copy_(value.to(param.dtype))


def vision_tensors(encoder: VisionEncoder, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype).contiguous().clone() for name, t in encoder.state_dict().items()}


def build_vision(config: ModelConfig, dtype: torch.dtype, device: str) -> VisionEncoder:
    """The encoder with uninitialised storage in `dtype` on `device`."""
    with torch.device("meta"):
        encoder = VisionEncoder(config.vision)
    materialize(encoder, device, lambda name, declared: dtype if declared.is_floating_point else declared)
    return encoder.eval().requires_grad_(False)  # each parameter allocated in `dtype`: no fp32 tower first


def load_vision(model_dir: str | Path, load_config: LoadConfig = LoadConfig()) -> VisionEncoder | None:
    if load_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_config.load_format!r}: expected one of {LOAD_FORMATS}")
    config = load_model_config(model_dir)
    if config.vision is None:
        logger.info("%s has no vision_config: text-only model", model_dir)
        return None
    dtype = resolve_dtype(load_config.dtype, load_config.device, config)
    if load_config.load_format == "dummy":
        encoder = build_vision(config, dtype, load_config.device)
        init_vision_weights(encoder, seed=load_config.seed)
        return encoder
    header = {name: entry for name, entry in read_header(checkpoint_files(Path(model_dir))).items()
              if name.startswith(VISION_PREFIXES)}
    if not header:
        logger.info("%s has a vision_config but no vision_tower.* / mm_projector.* tensors: text-only", model_dir)
        return None
    encoder = build_vision(config, dtype, load_config.device)
    _check_names(header, encoder)
    _copy(encoder, header)
    return encoder


def _check_names(header: dict[str, tuple[Path, tuple[int, ...]]], encoder: VisionEncoder) -> None:
    wanted = {name: tuple(t.shape) for name, t in encoder.state_dict().items()}
    problems = [f"missing: {n}" for n in wanted if n not in header]
    problems += [f"unexpected: {n}" for n in header if n not in wanted]
    problems += [f"mis-shaped: {n}: checkpoint {list(header[n][1])}, model expects {list(shape)}"
                 for n, shape in wanted.items() if n in header and header[n][1] != shape]
    if problems:
        raise CheckpointError("vision weights do not match vision_config:\n  " + "\n  ".join(sorted(problems)))


def _copy(encoder: VisionEncoder, header: dict[str, tuple[Path, tuple[int, ...]]]) -> None:
    state = encoder.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name, (path, _) in header.items():
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    state[name].copy_(f.get_tensor(name).to(state[name].dtype))
