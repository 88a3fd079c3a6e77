"""Loads (and writes) model weights by their official checkpoint names.

Contract:
- `load_model(model_dir, LoadConfig)` builds `KimiForCausalLM` from `config.json` and fills every parameter from
  `*.safetensors` (a sharded `model.safetensors.index.json` too). Before any data is read, the checkpoint's names and
  shapes are checked against the model; one `CheckpointError` names every missing, unexpected and mis-shaped tensor.
- Vision weights of a K3 checkpoint (`vision_tower.*`, `mm_projector.*`) are set aside with one log line: the
  vision encoder loads them (`engine.vision.loader.load_vision`).
- Routed experts may be stored as MXFP4 (`weight_packed` + `weight_scale`, compressed-tensors
  `mxfp4-pack-quantized`); they are dequantised to the compute dtype on load. Plain `weight` tensors work too.
- `load_format`: `safetensors`, `fastsafetensors` (falls back to safetensors with a warning where it cannot run)
  or `dummy` (seeded random weights, no weight files read). `dtype`: `auto` (the checkpoint's dtype on CUDA,
  float32 on CPU), `float32`, `bfloat16`, `float16`. Parameters the design keeps in fp32 (gates, router, conv
  weights, KDA decay parameters) stay fp32.
- The empty model's fused weight groups are bound before any data is read (`engine.model.fused`): parameters keep
  their official names and shapes, and loading writes into the fused tensors through them.
- `save_weights(model, out_dir)` writes the inverse mapping (official names), sharded when over `max_shard_bytes`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from engine.model.config import ModelConfig, load_model_config
from engine.model.fused import bind_fused_weights
from engine.model.init import init_random_weights
from engine.model.model import KimiForCausalLM
from engine.model.mxfp4 import dequantize_mxfp4, mxfp4_shapes, quantize_mxfp4

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("safetensors", "fastsafetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SET_ASIDE_PREFIXES = ("vision_tower.", "mm_projector.")
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias", "conv1d.weight")
_STACKED = re.compile(r"^(?P<head>.*\.experts)\.(?P<w>w[123])$")
PROGRESS_MIN_BYTES = 512 << 20


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names each offending tensor."""


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "safetensors"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0  # dummy weights only
    progress: bool | None = None  # None: a bar for large checkpoints on a terminal


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes: a parameter, or one expert's slice of a stacked parameter."""

    param_name: str
    index: int | None
    shape: tuple[int, ...] | None  # None: shape checked by `accepts` (A_log)

    def accepts(self, shape: tuple[int, ...], num_heads: int) -> bool:
        if self.shape is not None:
            return tuple(shape) == self.shape
        numel = 1
        for s in shape:
            numel *= s
        return numel == num_heads or (len(shape) == 1 and shape[0] >= num_heads)


def resolve_dtype(name: str, device: str, config: ModelConfig) -> torch.dtype:
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"--dtype {name!r}: expected auto, {', '.join(DTYPES)}")
    if torch.device(device).type == "cpu":
        return torch.float32
    return DTYPES.get(str(config.torch_dtype), torch.bfloat16)


def checkpoint_layout(model: KimiForCausalLM) -> dict[str, TensorTarget]:
    """Official checkpoint name → target, for every tensor the model needs."""
    prefix = model.config.weight_prefix
    layout: dict[str, TensorTarget] = {}
    for name, param in model.named_parameters():
        match = _STACKED.match(name)
        if match:
            for e in range(param.shape[0]):
                official = f"{prefix}{match['head']}.{e}.{match['w']}.weight"
                layout[official] = TensorTarget(name, e, tuple(param.shape[1:]))
        elif name.endswith("self_attn.A_log"):
            layout[prefix + name] = TensorTarget(name, None, None)
        else:
            layout[prefix + name] = TensorTarget(name, None, tuple(param.shape))
    return layout


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: str) -> KimiForCausalLM:
    """The model with uninitialised storage in `dtype` (fp32 where the design keeps fp32)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config)
    model = model.to_empty(device=device)
    for name, param in model.named_parameters():
        target = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
        param.data = param.data.to(target)
    bind_fused_weights(model)  # projections of one input share a tensor; loading fills it through the views
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, load_config: LoadConfig = LoadConfig()) -> KimiForCausalLM:
    if load_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_config.load_format!r}: expected one of {LOAD_FORMATS}")
    config = load_model_config(model_dir)
    dtype = resolve_dtype(load_config.dtype, load_config.device, config)
    model = build_empty_model(config, dtype, load_config.device)
    if load_config.load_format == "dummy":
        init_random_weights(model, seed=load_config.seed)
        return model
    if load_config.load_format == "fastsafetensors":
        _warn_fastsafetensors_fallback(load_config.device)
    files = checkpoint_files(Path(model_dir))
    header = read_header(files)
    layout = checkpoint_layout(model)
    plan = validate(header, layout, config)
    _copy_tensors(model, header, plan, load_config)
    return model


def _warn_fastsafetensors_fallback(device: str) -> None:
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        logger.warning("fastsafetensors is not installed; loading with safetensors instead")
        return
    logger.warning("fastsafetensors reads straight to GPU memory only; on %s loading with safetensors", device)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard files that do not exist: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def read_header(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name → (file, shape), reading headers only."""
    header: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                header[name] = (path, tuple(f.get_slice(name).get_shape()))
    return header


@dataclass(frozen=True)
class LoadItem:
    target: TensorTarget
    sources: dict[str, str]  # role ("weight" | "packed" | "scale") -> checkpoint name


def validate(header: dict[str, tuple[Path, tuple[int, ...]]], layout: dict[str, TensorTarget],
             config: ModelConfig) -> dict[str, LoadItem]:
    """Matches checkpoint tensors to targets; raises one `CheckpointError` listing every problem."""
    num_heads = config.kda.num_heads if config.kda else 0
    plan: dict[str, LoadItem] = {}
    used: set[str] = set()
    missing, misshaped = [], []
    for official, target in layout.items():
        item, problem = _match_target(official, target, header, num_heads)
        if item is None:
            (missing if problem is None else misshaped).append(problem or official)
            continue
        plan[official] = item
        used.update(item.sources.values())
    set_aside = [n for n in header if n.startswith(SET_ASIDE_PREFIXES)]
    unexpected = sorted(n for n in header if n not in used and n not in set_aside)
    if set_aside:
        logger.info("set aside %d vision tensors (vision_tower.*, mm_projector.*) for engine.vision.load_vision",
                    len(set_aside))
    if missing or unexpected or misshaped:
        raise CheckpointError(_describe_problems(missing, unexpected, misshaped))
    return plan


def _match_target(official: str, target: TensorTarget, header: dict, num_heads: int
                  ) -> tuple[LoadItem | None, str | None]:
    if official in header:
        shape = header[official][1]
        if not target.accepts(shape, num_heads):
            want = target.shape if target.shape is not None else f"{num_heads} heads"
            return None, f"{official}: checkpoint {list(shape)}, model expects {list(want) if isinstance(want, tuple) else want}"
        return LoadItem(target, {"weight": official}), None
    base = official.removesuffix(".weight")
    packed, scale = f"{base}.weight_packed", f"{base}.weight_scale"
    if target.index is not None and packed in header and scale in header:
        want_packed, want_scale = mxfp4_shapes(target.shape)
        got_packed, got_scale = header[packed][1], header[scale][1]
        if got_packed != want_packed:
            return None, f"{packed}: checkpoint {list(got_packed)}, expected {list(want_packed)} for MXFP4"
        if got_scale != want_scale:
            return None, f"{scale}: checkpoint {list(got_scale)}, expected {list(want_scale)} for MXFP4"
        return LoadItem(target, {"packed": packed, "scale": scale}), None
    return None, None


def _describe_problems(missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = ["checkpoint does not match the model config:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if names:
            lines.append(f"  {len(names)} {title} tensor(s):")
            lines.extend(f"    {n}" for n in names)
    return "\n".join(lines)


def _copy_tensors(model: KimiForCausalLM, header: dict[str, tuple[Path, tuple[int, ...]]],
                  plan: dict[str, LoadItem], load_config: LoadConfig) -> None:
    params = dict(model.named_parameters())
    items = sorted(plan.values(), key=lambda it: str(header[next(iter(it.sources.values()))][0]))
    total_bytes = sum(p.numel() * p.element_size() for p in params.values())
    show = load_config.progress if load_config.progress is not None else (
        sys.stderr.isatty() and total_bytes >= PROGRESS_MIN_BYTES)
    with ExitStack() as stack, tqdm(total=len(items), desc="loading weights", unit="tensor", disable=not show) as bar:
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            path = header[name][0]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            return handles[path].get_tensor(name)

        for item in items:
            _assign(params[item.target.param_name], item, read)
            bar.update(1)


def _assign(param: nn.Parameter, item: LoadItem, read) -> None:
    target = item.target
    if "weight" in item.sources:
        tensor = read(item.sources["weight"])
    else:
        tensor = dequantize_mxfp4(read(item.sources["packed"]), read(item.sources["scale"]))
    if target.shape is None:  # A_log: [1,1,H,1], [H] or padded [P >= H]
        tensor = tensor.reshape(-1)[: param.shape[0]]
    dest = param.data if target.index is None else param.data[target.index]
    dest.copy_(tensor.to(dest.dtype))


def save_weights(model: KimiForCausalLM, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = 2 << 30, experts_mxfp4: bool = False,
                 extra_tensors: dict[str, torch.Tensor] | None = None) -> list[Path]:
    """Writes the model's weights under official names; shards (with an index file) above `max_shard_bytes`.

    With `experts_mxfp4`, routed experts are written as `weight_packed` + `weight_scale` (the K3 release layout);
    the caller should have quantised the model's experts first so that the written values round-trip exactly.
    `extra_tensors` (official name -> tensor, e.g. the K3 vision weights) are written after the text weights.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(_official_tensors(model, dtype, experts_mxfp4)) | (extra_tensors or {})
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        path = out / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        paths.append(out / name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return paths


def _official_tensors(model: KimiForCausalLM, dtype: torch.dtype,
                      experts_mxfp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    k3 = model.config.family == "kimi_k3"
    for official, target in checkpoint_layout(model).items():
        tensor = params[target.param_name].detach()
        if target.index is not None:
            tensor = tensor[target.index]
        if target.shape is None:  # A_log in the released layout of each family
            tensor = _released_a_log(tensor, k3)
        if experts_mxfp4 and target.index is not None:
            packed, scale = quantize_mxfp4(tensor)
            base = official.removesuffix(".weight")
            yield f"{base}.weight_packed", packed
            yield f"{base}.weight_scale", scale
            continue
        keep_fp32 = target.param_name.endswith(FP32_PARAM_SUFFIXES)
        yield official, tensor.to(torch.float32 if keep_fp32 else dtype).contiguous().clone()


def _released_a_log(a_log: torch.Tensor, k3: bool) -> torch.Tensor:
    if k3:  # K3 stores A_log padded to [128]
        padded = torch.zeros(max(128, a_log.shape[0]), dtype=a_log.dtype)
        padded[: a_log.shape[0]] = a_log
        return padded
    return a_log.reshape(1, 1, -1, 1)  # Kimi Linear: [1, 1, H, 1]


def _split_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards
