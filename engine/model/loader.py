"""Loads (and writes) model weights by their official checkpoint names.

Contract:
- `load_model(model_dir, LoadConfig, ctx)` builds rank `ctx`'s `KimiForCausalLM` (default: the whole model) from
  `config.json` and fills every parameter from `*.safetensors` (a sharded `model.safetensors.index.json` too),
  reading only this rank's slice of each tensor (`TensorTarget.part`; engine/model/sources.py). Before any data is
  read, the checkpoint's names and FULL shapes are checked against the model; one `CheckpointError` names every
  missing, unexpected and mis-shaped tensor (under expert parallelism other ranks' experts are expected, not
  unexpected; under pipeline parallelism so are other stages' tensors, which are never read:
  engine/parallel/pipeline.py `Stage.owns_tensor`).
- Vision weights of a K3 checkpoint (`vision_tower.*`, `mm_projector.*`) are set aside with one log line: the
  vision encoder loads them (`engine.vision.loader.load_vision`). So are the MTP layers a config declares
  (`num_nextn_predict_layers`: tensors under `ModelConfig.mtp_weight_prefixes`, i.e. `model.layers.{num_hidden_layers + i}.`):
  the MTP drafter loads them (engine/spec/mtp_model.py) when speculating; otherwise they are not read.
- Routed experts may be stored as MXFP4 (`weight_packed` + `weight_scale`, compressed-tensors
  `mxfp4-pack-quantized`) or as plain `weight`s. `experts_format`: `auto` keeps them as stored (MXFP4 stays packed
  in memory, see engine/model/moe.py), `dense` dequantises MXFP4 to the compute dtype on load, `mxfp4` requires
  packed ones.
- `load_format`: `safetensors`, `fastsafetensors` (through the `fastsafetensors` package when it is installed, its
  sharded loading under tensor parallelism; else safetensors with one warning) or `dummy` (seeded random weights
  drawn per tensor name, no weight files read: every TP size gets the same model). `dtype`: `auto` (the
  checkpoint's dtype on CUDA, float32 on CPU), `float32`, `bfloat16`, `float16`. Parameters the design keeps in
  fp32 (gates, router, conv weights, KDA decay parameters) stay fp32.
- The empty model's fused weight groups are bound before any data is read (`engine.model.fused`): parameters keep
  their official names and shapes, and loading writes into the fused tensors through them.
- Memory is bounded: the model is built on the meta device and each parameter gets its storage directly in its
  serving dtype on the load device (`engine.model.init.materialize`; no fp32 model is ever built first); tensors are
  cast into their parameter as they arrive (`copy_` converts), and a source holds one file (safetensors) or one
  round of `files_per_rank` files per rank (fastsafetensors) at a time. Peak memory while loading is the final
  weights + one file (round) + a few tensors (tests/unit/model/test_bounded_loading.py measures it).
- `save_weights(model, out_dir)` writes the inverse mapping (official names), sharded when over `max_shard_bytes`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from engine.model.config import ModelConfig, load_model_config
from engine.model.fused import attach_compact_weights, bind_fused_weights, lay_out_for_gemv
from engine.model.huge_pages import place_on_huge_pages
from engine.model.init import materialize
from engine.model.model import KimiForCausalLM
from engine.model.moe import EXPERT_FORMATS
from engine.model.mxfp4 import GROUP, dequantize_mxfp4, mxfp4_shapes, quantize_mxfp4
from engine.model.sources import (CheckpointError, DummySource, FastSafetensorsSource, SafetensorsSource, Slice,
                                  checkpoint_files, detach_from_buffer, read_header)
from engine.parallel.comm import SINGLE, RankContext
from engine.parallel.config import ParallelError
from kernels.registry import log_platform

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("safetensors", "fastsafetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SET_ASIDE_PREFIXES = ("vision_tower.", "mm_projector.")
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias", "conv1d.weight")
_STACKED = re.compile(r"^(?P<head>.*\.experts)\.(?P<w>w[123])(?:_(?P<kind>packed|scale))?$")
_PACKED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight_packed$")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.w[123]\.")
PROGRESS_MIN_BYTES = 512 << 20


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "safetensors"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0  # dummy weights only
    progress: bool | None = None  # None: a bar for large checkpoints on a terminal
    experts_format: str = "auto"  # routed experts resident as: auto (as stored), dense, mxfp4 (packed)
    files_per_rank: int = 1  # fastsafetensors: checkpoint files each rank holds in buffers at once (one round)


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes: a parameter, or one expert's slice of a stacked parameter.

    `shape` is the checkpoint tensor's full shape; `part` the slice of it this rank holds (None: all of it; for
    A_log, whose stored shape varies, a slice of its heads)."""

    param_name: str
    index: int | None
    shape: tuple[int, ...] | None  # None: shape checked by `accepts` (A_log)
    part: Slice | None = None

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


def resolve_experts_format(name: str, header: dict | None, config: ModelConfig) -> str:
    """`auto`: packed when the checkpoint stores MXFP4 experts (or, without files, its config declares them)."""
    if name in EXPERT_FORMATS:
        return name
    if name != "auto":
        raise ValueError(f"experts_format {name!r}: expected auto, {', '.join(EXPERT_FORMATS)}")
    if header is not None:
        return "mxfp4" if any(_PACKED_EXPERT.search(n) for n in header) else "dense"
    quant = config.raw.get("text_config", config.raw).get("quantization_config") or {}
    return "mxfp4" if quant.get("format") == "mxfp4-pack-quantized" else "dense"


def shard_dims(model: nn.Module) -> dict[str, int]:
    """Parameter name -> the checkpoint dim it is split along across ranks (modules declare it in `tp_dims`)."""
    dims = {}
    for module_name, module in model.named_modules():
        for attr, dim in getattr(module, "tp_dims", {}).items():
            dims[f"{module_name}.{attr}" if module_name else attr] = dim
    return dims


def _full_and_part(local: tuple[int, ...], dim: int | None, ctx: RankContext) -> tuple[tuple[int, ...], Slice | None]:
    if dim is None or ctx.size == 1:
        return local, None
    full = list(local)
    full[dim] *= ctx.size
    return tuple(full), Slice(dim, ctx.rank * local[dim], local[dim])


def checkpoint_layout(model: KimiForCausalLM) -> dict[str, TensorTarget]:
    """Official checkpoint name → target, for every tensor this rank's model needs."""
    prefix, ctx = model.config.weight_prefix, model.ctx
    dims = shard_dims(model)
    layout: dict[str, TensorTarget] = {}
    for name, param in model.named_parameters():
        match = _STACKED.match(name)
        if match:
            first = model.get_submodule(match["head"]).first_expert
            suffix = f"weight_{match['kind']}" if match["kind"] else "weight"
            full, part = _full_and_part(tuple(param.shape[1:]), dims.get(name), ctx)
            for e in range(param.shape[0]):
                layout[f"{prefix}{match['head']}.{first + e}.{match['w']}.{suffix}"] = TensorTarget(name, e, full, part)
        elif name.endswith("self_attn.A_log"):
            part = Slice(0, ctx.rank * param.shape[0], param.shape[0]) if ctx.size > 1 else None
            layout[prefix + name] = TensorTarget(name, None, None, part)
        else:
            full, part = _full_and_part(tuple(param.shape), dims.get(name), ctx)
            layout[prefix + name] = TensorTarget(name, None, full, part)
    return layout


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: str, ctx: RankContext = SINGLE,
                      experts_format: str = "dense", gemv_layout: bool = False) -> KimiForCausalLM:
    """This rank's model with uninitialised storage in `dtype` (fp32 where the design keeps fp32; packed MXFP4 experts
    stay uint8); `gemv_layout`: linear weights input-major (`lay_out_for_gemv`, what `load_model` asks on CPU)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config, ctx, experts_format)
    materialize(model, device, lambda name, declared: declared if not declared.is_floating_point else
                torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype)
    if gemv_layout:
        lay_out_for_gemv(model)
    bind_fused_weights(model)  # projections of one input share a tensor; loading fills it through the views
    if device == "cpu":
        place_on_huge_pages(model)  # before loading fills them: a decode step streams every weight
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, load_config: LoadConfig = LoadConfig(),
               ctx: RankContext = SINGLE) -> KimiForCausalLM:
    """This rank's model (`ctx`: which slices; default the whole model), filled from its slices only."""
    if load_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_config.load_format!r}: expected one of {LOAD_FORMATS}")
    config = load_model_config(model_dir)
    log_platform(torch.device(load_config.device).type)  # the kernels this process will run, said once
    dtype = resolve_dtype(load_config.dtype, load_config.device, config)
    files = header = None
    if load_config.load_format != "dummy":
        files = checkpoint_files(Path(model_dir))
        header = read_header(files)
    experts_format = resolve_experts_format(load_config.experts_format, header, config)
    model = build_empty_model(config, dtype, load_config.device, ctx, experts_format, load_config.device == "cpu")
    layout = checkpoint_layout(model)
    if header is None:
        plan = dummy_plan(layout, config)
        source = DummySource({name: it.target.shape for name, it in plan.items()}, load_config.seed)
    else:
        owner, stage = _expert_owner(model), model.ctx.stage
        plan = validate(header, layout, config, lambda n: (owner(n) not in (None, model.ctx.rank)
                                                           and owner(n) < model.ctx.size)
                        or (stage.pipelined and not stage.owns_tensor(n, config.weight_prefix,
                                                                        config.num_hidden_layers)))
        source = _file_source(load_config, files, header, model, owner)
    copy_tensors(model, plan, source, load_config)
    if load_config.device == "cpu":
        compact = attach_compact_weights(model)  # exact bf16 copies for the small-batch kernel (bf16 checkpoints)
        if compact:
            logger.info("%d MiB of exact bf16 weight copies for one-to-eight-row products", compact >> 20)
            place_on_huge_pages(model)  # the copies only: what is placed stays
    return model


def _file_source(load_config: LoadConfig, files: list[Path], header: dict, model: KimiForCausalLM, owner):
    if load_config.load_format == "fastsafetensors":
        if model.ctx.stage.pipelined:
            raise ParallelError("--load-format fastsafetensors does not split by pipeline stage (its rounds read "
                                "every tensor of a file); use --load-format safetensors with "
                                "--pipeline-parallel-size > 1")
        if importlib.util.find_spec("fastsafetensors") is not None:
            logger.info("loading weights through fastsafetensors on %s", load_config.device)
            return FastSafetensorsSource(files, header, model.ctx, load_config.device, owner,
                                         SET_ASIDE_PREFIXES + model.config.mtp_weight_prefixes,
                                         load_config.files_per_rank)
        logger.warning("fastsafetensors is not installed; loading with safetensors instead")
    return SafetensorsSource(header)


def _expert_owner(model: KimiForCausalLM):
    """Checkpoint name -> the rank holding that routed expert under expert parallelism (None otherwise)."""
    moe = model.config.moe
    if moe is None or not model.ctx.expert_parallel or model.ctx.size == 1:
        return lambda name: None
    per_rank = moe.num_experts // model.ctx.size

    def owner(name: str) -> int | None:
        match = _EXPERT_INDEX.search(name)
        return None if match is None else int(match[1]) // per_rank

    return owner


@dataclass(frozen=True)
class LoadItem:
    target: TensorTarget
    sources: dict[str, str]  # role ("weight" | "packed" | "scale") -> checkpoint name
    parts: dict[str, Slice | None] = field(default_factory=dict)  # role -> this rank's slice of that tensor


def dummy_plan(layout: dict[str, TensorTarget], config: ModelConfig) -> dict[str, LoadItem]:
    """Every target drawn whole under its own name (A_log as [H])."""
    heads = (config.kda.num_heads,) if config.kda else (0,)
    plan = {}
    for official, target in layout.items():
        if target.shape is None:
            target = TensorTarget(target.param_name, target.index, heads, target.part)
        plan[official] = LoadItem(target, {"weight": official}, {"weight": target.part})
    return plan


def validate(header: dict[str, tuple[Path, tuple[int, ...]]], layout: dict[str, TensorTarget],
             config: ModelConfig, foreign=lambda name: False) -> dict[str, LoadItem]:
    """Matches checkpoint tensors to targets; raises one `CheckpointError` listing every problem.

    `foreign(name)`: a tensor another rank holds (expert parallelism), not unexpected here."""
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
    mtp = [n for n in header if n.startswith(config.mtp_weight_prefixes)] if config.mtp_layers else []
    unexpected = sorted(n for n in header if n not in used and n not in set_aside and n not in mtp
                        and not foreign(n))
    if set_aside:
        logger.info("set aside %d vision tensors (vision_tower.*, mm_projector.*) for engine.vision.load_vision",
                    len(set_aside))
    if mtp:
        logger.info("set aside %d MTP tensors (%d layer(s)) for the mtp drafter", len(mtp), len(config.mtp_layers))
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
        part = target.part
        if part is not None and target.shape is None:  # A_log: slice the heads along the dim that holds them
            part = Slice(next((d for d, n in enumerate(shape) if n > 1), 0), part.start, part.length)
        return LoadItem(target, {"weight": official}, {"weight": part}), None
    base = official.removesuffix(".weight")
    packed, scale = f"{base}.weight_packed", f"{base}.weight_scale"
    if target.index is not None and packed in header and scale in header:
        want_packed, want_scale = mxfp4_shapes(target.shape)
        got_packed, got_scale = header[packed][1], header[scale][1]
        if got_packed != want_packed:
            return None, f"{packed}: checkpoint {list(got_packed)}, expected {list(want_packed)} for MXFP4"
        if got_scale != want_scale:
            return None, f"{scale}: checkpoint {list(got_scale)}, expected {list(want_scale)} for MXFP4"
        parts = {"packed": _packed_part(target.part, 2), "scale": _packed_part(target.part, GROUP)}
        return LoadItem(target, {"packed": packed, "scale": scale}, parts), None
    return None, None


def _packed_part(part: Slice | None, columns_per_entry: int) -> Slice | None:
    """The slice of a packed/scale tensor that holds the dense slice `part` (columns shrink by the packing)."""
    if part is None or part.dim == 0:
        return part
    if part.start % GROUP or part.length % GROUP:
        raise ParallelError(f"an MXFP4 expert slice of {part.length} input columns is not a multiple of {GROUP}")
    return Slice(part.dim, part.start // columns_per_entry, part.length // columns_per_entry)


def _describe_problems(missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = ["checkpoint does not match the model config:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if names:
            lines.append(f"  {len(names)} {title} tensor(s):")
            lines.extend(f"    {n}" for n in names)
    return "\n".join(lines)


def copy_tensors(model: KimiForCausalLM, plan: dict[str, LoadItem], source, load_config: LoadConfig) -> None:
    params = dict(model.named_parameters())
    users = {name: (key, role) for key, item in plan.items() for role, name in item.sources.items()}
    wanted = {name: plan[key].parts.get(role) for name, (key, role) in users.items()}
    total_bytes = sum(p.numel() * p.element_size() for p in params.values())
    show = load_config.progress if load_config.progress is not None else (
        sys.stderr.isatty() and total_bytes >= PROGRESS_MIN_BYTES)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    with tqdm(total=len(plan), desc="loading weights", unit="tensor", disable=not show) as bar:
        for name, tensor in source.stream(wanted):
            key, role = users[name]
            got = pending.setdefault(key, {})
            got[role] = tensor
            if len(got) == len(plan[key].sources):
                _assign(params[plan[key].target.param_name], plan[key], pending.pop(key))
            else:  # waits for its partner (MXFP4 packed + scale): must not pin the source's file buffer
                got[role] = detach_from_buffer(tensor)
                bar.update(1)
    if pending:
        raise CheckpointError(f"tensors never arrived for: {sorted(pending)}")


def _assign(param: nn.Parameter, item: LoadItem, tensors: dict[str, torch.Tensor]) -> None:
    target = item.target
    if "weight" in tensors:
        tensor = tensors["weight"]
    else:
        tensor = dequantize_mxfp4(tensors["packed"], tensors["scale"])
    if target.shape is None:  # A_log: [1,1,H,1], [H] or padded [P >= H] (this rank's heads when sliced)
        tensor = tensor.reshape(-1)[: param.shape[0]]
    dest = param.data if target.index is None else param.data[target.index]
    dest.copy_(tensor)  # converts dtype and device on the way: no full-size temporary


def save_weights(model: KimiForCausalLM, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = 2 << 30, experts_mxfp4: bool = False,
                 extra_tensors: dict[str, torch.Tensor] | None = None) -> list[Path]:
    """Writes the model's weights under official names; shards (with an index file) above `max_shard_bytes`.

    With `experts_mxfp4`, routed experts are written as `weight_packed` + `weight_scale` (the K3 release layout);
    the caller should have quantised the model's experts first so that the written values round-trip exactly.
    `extra_tensors` (official name -> tensor, e.g. the K3 vision weights) are written after the text weights.
    Experts a model holds packed are written packed as they are. Only a whole (TP=1) model can be saved.
    """
    if model.ctx.size > 1:
        raise ValueError("save_weights needs the whole model; this one is one rank of a tensor-parallel model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(official_tensors(model, dtype, experts_mxfp4)) | (extra_tensors or {})
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


def official_tensors(model: KimiForCausalLM, dtype: torch.dtype,
                     experts_mxfp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) as `save_weights` writes them; any module with `config`, `ctx` and parameters."""
    params = dict(model.named_parameters())
    k3 = model.config.family == "kimi_k3"
    for official, target in checkpoint_layout(model).items():
        tensor = params[target.param_name].detach()
        if target.index is not None:
            tensor = tensor[target.index]
        if target.shape is None:  # A_log in the released layout of each family
            tensor = _released_a_log(tensor, k3)
        if not tensor.dtype.is_floating_point:  # packed MXFP4 experts, as held
            yield official, tensor.contiguous().clone()
            continue
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
