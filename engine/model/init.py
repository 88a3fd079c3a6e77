"""Seeded random weights for generated checkpoints and `--load-format dummy`.

Contract: `init_random_weights(model, seed)` fills every parameter deterministically (same seed, same model config →
the same bytes on any machine), with magnitudes that keep activations O(1) so tests compare meaningful numbers:
linear layers N(0, 1/fan_in), norm weights 1 + N(0, 0.1²) (so a dropped norm weight changes the output), KDA decay
parameters as flash-linear-attention initialises them, and a small router correction bias.
`sample_tensor(name, shape, seed)` draws one tensor by the same rules from a generator seeded by (seed, name) alone,
so any rank can draw any checkpoint tensor and slice it (`--load-format dummy` under tensor parallelism).
`materialize(module, device, dtype_of)` gives a module built on the meta device its storage, one parameter at a
time, each directly in `dtype_of(name, declared dtype)`: building a model never allocates it in fp32 first.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

NORM_SUFFIXES = ("norm.weight", "layernorm.weight")


def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data.copy_(_sample(name, tuple(param.shape), gen).to(param.dtype))


def materialize(module: nn.Module, device: torch.device | str,
                dtype_of: Callable[[str, torch.dtype], torch.dtype]) -> nn.Module:
    """Uninitialised storage on `device` for every meta parameter (in `dtype_of(name, dtype)`; a shared parameter
    once, under its first name) and meta buffer of `module`, in place."""
    made: dict[int, nn.Parameter] = {}
    for module_name, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                full = f"{module_name}.{name}" if module_name else name
                storage = torch.empty(param.shape, dtype=dtype_of(full, param.dtype), device=device)
                made[id(param)] = nn.Parameter(storage, requires_grad=param.requires_grad)
            sub._parameters[name] = made[id(param)]
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.is_meta:
                sub._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
    return module


def sample_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return _sample(name, shape, gen)


def _sample(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith(NORM_SUFFIXES):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return 0.01 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if name.endswith("_res_proj.weight"):
        return 0.1 * torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)
