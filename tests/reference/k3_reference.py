"""The official Kimi K3 modeling code, loadable in tests on CPU, as the oracle for our `kimi_k3` model.

Contract:
- The official files ship inside the `llmcompressor` wheel (`llmcompressor/modeling/kimi_k3/`). They are loaded BY
  PATH as the synthetic package `kimi_k3_ref` (submodules `configuration_kimi_k3`, `modeling_kimi_linear`,
  `modeling_kimi_k3`), without importing `llmcompressor` itself: its one import of the package
  (`get_calibrate_all_experts_flag`) and the `fla` kernels it needs are stubs placed in `sys.modules` only while the
  files execute (`stubbed_modules`), then restored, so other tests see the interpreter as before. The loaded
  package is cached for the process (`load_reference_package`).
- The `fla` stand-ins are written here from the formulas (docs/architecture.md "Shared forms"), token by token in fp32, and
  share nothing with `kernels/`:
  `chunk_kda` / `fused_recurrent_kda` (gated delta rule, with fla's in-kernel q/k L2 norm, gate and beta sigmoid,
  state [N, H, V, K] when `transpose_state_layout`, else [N, H, K, V]; varlen `cu_seqlens` with B = 1),
  `ShortConvolution` (depthwise causal conv + SiLU; cache [B, C, W] = the last W inputs, oldest first),
  `FusedRMSNormGated` (fp32 `rmsnorm(x)·weight·sigmoid(g)`), `prepare_lens_from_mask`,
  `prepare_cu_seqlens_from_mask`, `tensor_cache`.
- Vision stand-ins, set on the loaded `modeling_kimi_k3`: `flash_attn_varlen_func` (non-causal varlen attention,
  fp32 per sequence; flash-attn is not installed, so the official module has None there) and `get_rope_shape`
  replaced by the plain function under its `torch.compile` wrapper (the same position-grid interpolation, eager).
- `load_reference_k3(model_dir)` builds `KimiK3ForConditionalGeneration` in fp32 with eager attention and fills its
  `language_model` from the folder's safetensors (`A_log` narrowed from the padded [128] to [H]; MXFP4 experts
  dequantised from the compressed-tensors layout). Vision weights are loaded when the folder has them, else the
  vision tower keeps its random init (text-only inputs never reach it).
- `reference_logits(model, ids)` -> [T, V] fp32 from one full forward without a cache;
  `reference_incremental_logits(model, prompt, continuation)` -> [1 + len(continuation), V] from the reference's own
  `KimiDynamicCache` path (row 0: the prompt's last position, then one row per fed continuation token);
  `reference_generate(model, prompt, n)` -> n greedy tokens on that cached path;
  `reference_generate_batch(model, prompts, n)` -> the same for equal-length prompts run as one batch (the
  benchmarks' baseline; batch rows never interact, so each row equals `reference_generate` of its prompt).
"""

from __future__ import annotations

import contextlib
import importlib.machinery, importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

PACKAGE = "kimi_k3_ref"
SUBMODULES = ("configuration_kimi_k3", "modeling_kimi_linear", "modeling_kimi_k3")
TEXT_PREFIX = "language_model."
_MISSING = object()
_LOADED: dict[str, ModuleType] = {}


# ----------------------------------------------------------------------------------------------------------------
# fla stand-ins
# ----------------------------------------------------------------------------------------------------------------

def _kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
              lower_bound: float | None) -> torch.Tensor:
    """The in-kernel forget gate. g [B, T, H, K] raw f_b_proj output -> log-decay [B, T, H, K] fp32."""
    H, K = g.shape[-2:]
    a = torch.exp(A_log.float().reshape(-1)[:H]).reshape(H, 1)  # [H, 1]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, fp32. q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [H, K, V]."""
    S = state.clone()
    out = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # decay each key channel
        predicted = torch.einsum("hk,hkv->hv", k[t], S)  # [H, V]
        S = S + beta[t].reshape(-1, 1, 1) * k[t].unsqueeze(-1) * (v[t] - predicted).unsqueeze(1)
        out.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
    return torch.stack(out), S


def _kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
         A_log=None, dt_bias=None, lower_bound=None, transpose_state_layout=False, cu_seqlens=None,
         **_ignored):
    """fla's `chunk_kda` / `fused_recurrent_kda` semantics. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]."""
    (B, T, H, K), V = q.shape, v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q32, k32, v32, beta32 = q.float(), k.float(), v.float(), beta.float()
    if use_qk_l2norm_in_kernel:
        q32 = q32 / torch.sqrt(q32.pow(2).sum(-1, keepdim=True) + 1e-6)
        k32 = k32 / torch.sqrt(k32.pow(2).sum(-1, keepdim=True) + 1e-6)
    g32 = _kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.float()
    if use_beta_sigmoid_in_kernel:
        beta32 = torch.sigmoid(beta32)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        assert B == 1, "varlen inputs are packed into batch 1"
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    out = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        if initial_state is None:
            s0 = torch.zeros(H, K, V, dtype=torch.float32, device=q.device)
        else:
            s0 = initial_state[n].float()
            s0 = s0.transpose(-1, -2) if transpose_state_layout else s0  # -> [H, K, V]
        o, s = _delta_rule(q32[b, start:end], k32[b, start:end], v32[b, start:end], g32[b, start:end],
                           beta32[b, start:end], scale, s0)
        out[b, start:end] = o
        finals.append(s.transpose(-1, -2) if transpose_state_layout else s)
    final = torch.stack(finals) if output_final_state else None
    return out.to(v.dtype), final


def chunk_kda(q, k, v, g, beta, **kwargs):
    return _kda(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, **kwargs):
    return _kda(q, k, v, g, beta, **kwargs)


class ShortConvolution(nn.Module):
    """Depthwise causal conv over the last `kernel_size` inputs, then the activation. weight [C, 1, W]."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                 **_ignored):
        super().__init__()
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        nn.init.normal_(self.weight, std=kernel_size ** -0.5)
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def _one(self, x: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C]; cache [C, W] (last W inputs, oldest first) -> y [T, C] fp32, new cache [C, W] fp32."""
        W, T = self.kernel_size, x.shape[0]
        history = (torch.zeros(self.hidden_size, W - 1, device=x.device) if cache is None
                   else cache.float()[:, 1:])  # [C, W-1]
        padded = torch.cat([history, x.float().t()], dim=1)  # [C, W-1+T]
        w = self.weight.float()[:, 0]  # [C, W]
        y = sum(w[:, j:j + 1] * padded[:, j:j + T] for j in range(W))  # [C, T]
        if self.bias is not None:
            y = y + self.bias.float().unsqueeze(-1)
        if self.activation in ("silu", "swish"):
            y = F.silu(y)
        return y.t(), padded[:, -W:]

    def forward(self, x: torch.Tensor, residual=None, mask=None, cache: torch.Tensor | None = None,
                output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, **_ignored):
        B, T, C = x.shape
        if cu_seqlens is None:
            spans = [(b, 0, T) for b in range(B)]
        else:
            bounds = [int(i) for i in cu_seqlens.tolist()]
            spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
        y = torch.zeros(B, T, C, dtype=torch.float32, device=x.device)
        finals = []
        for n, (b, start, end) in enumerate(spans):
            yn, fin = self._one(x[b, start:end], None if cache is None else cache[n])
            y[b, start:end] = yn
            finals.append(fin)
        final = torch.stack(finals).to(x.dtype) if output_final_state else None
        return y.to(x.dtype), final


class FusedRMSNormGated(nn.Module):
    """fp32 `rmsnorm(x) · weight · act(g)`, returned in x's dtype."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", **_ignored):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual=None, prenorm=False, residual_in_fp32=False):
        x32, g32 = x.float(), g.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        gate = torch.sigmoid(g32) if self.activation == "sigmoid" else g32 * torch.sigmoid(g32)
        return (y * gate).to(x.dtype)


def prepare_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=-1, dtype=torch.int32)


def prepare_cu_seqlens_from_mask(mask: torch.Tensor, out_dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return F.pad(prepare_lens_from_mask(mask).cumsum(dim=0, dtype=out_dtype), (1, 0))


def tensor_cache(fn):
    return fn


def get_calibrate_all_experts_flag() -> bool:
    return False


# Vision stand-ins (set on `modeling_kimi_k3` after it executes, see `_vision_stand_ins`).

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, deterministic=False, **_ignored):
    """flash-attn's varlen attention, non-causal only, fp32 per sequence. q, k, v [T, H, D] -> [T, H, D]."""
    assert not causal, "the vision tower's attention is non-causal"
    assert torch.equal(cu_seqlens_q, cu_seqlens_k)
    out = torch.zeros_like(q)
    bounds = [int(b) for b in cu_seqlens_q.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


def _uncompiled(fn):
    """The plain Python function under the official `get_rope_shape` (torch.compile inside a first-call decorator):
    the same interpolation, run eagerly, so tests need no compiler and no compile time."""
    for cell in fn.__closure__ or ():
        inner = getattr(cell.cell_contents, "_torchdynamo_orig_callable", None)
        if inner is not None:
            return inner
    raise RuntimeError("the official get_rope_shape is no longer a torch.compile wrapper; update the harness")


def _vision_stand_ins(modeling_k3: ModuleType) -> None:
    modeling_k3.get_rope_shape = _uncompiled(modeling_k3.get_rope_shape)
    modeling_k3.flash_attn_varlen_func = flash_attn_varlen_func


# ----------------------------------------------------------------------------------------------------------------
# Loading the official files by path
# ----------------------------------------------------------------------------------------------------------------

def _module(name: str, package: bool = False, **attrs) -> ModuleType:
    mod = ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _stub_tree() -> dict[str, ModuleType]:
    """The `fla` and `llmcompressor` modules the official files import, as stand-in modules."""
    mods = {
        "fla": _module("fla", package=True),
        "fla.modules": _module("fla.modules", package=True, ShortConvolution=ShortConvolution,
                               FusedRMSNormGated=FusedRMSNormGated),
        "fla.ops": _module("fla.ops", package=True),
        "fla.ops.kda": _module("fla.ops.kda", package=True, chunk_kda=chunk_kda,
                               fused_recurrent_kda=fused_recurrent_kda),
        "fla.ops.utils": _module("fla.ops.utils", package=True),
        "fla.ops.utils.index": _module("fla.ops.utils.index", prepare_lens_from_mask=prepare_lens_from_mask,
                                       prepare_cu_seqlens_from_mask=prepare_cu_seqlens_from_mask),
        "fla.utils": _module("fla.utils", tensor_cache=tensor_cache),
        "llmcompressor": _module("llmcompressor", package=True),
        "llmcompressor.modeling": _module("llmcompressor.modeling", package=True),
        "llmcompressor.modeling.moe": _module("llmcompressor.modeling.moe", package=True),
        "llmcompressor.modeling.moe.context": _module(
            "llmcompressor.modeling.moe.context", get_calibrate_all_experts_flag=get_calibrate_all_experts_flag),
    }
    for name, mod in mods.items():  # parent.child attributes, as a real import would set them
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


@contextlib.contextmanager
def stubbed_modules(stubs: dict[str, ModuleType | None]) -> Iterator[None]:
    """Puts `stubs` into `sys.modules` for the duration, then restores every touched name exactly."""
    saved = {name: sys.modules.get(name, _MISSING) for name in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def official_dir() -> Path:
    """`llmcompressor/modeling/kimi_k3/` of the installed wheel, found without importing `llmcompressor`."""
    spec = importlib.util.find_spec("llmcompressor") if "llmcompressor" not in sys.modules else \
        sys.modules["llmcompressor"].__spec__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the `llmcompressor` wheel (which ships the official Kimi K3 code) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "modeling" / "kimi_k3"
    if not (path / "modeling_kimi_linear.py").is_file():
        raise ImportError(f"{path} does not hold the official Kimi K3 modeling files")
    return path



def load_reference_package() -> ModuleType:
    """Executes the official files as `kimi_k3_ref.*` (once per process) and returns the package module."""
    if PACKAGE in _LOADED:
        return _LOADED[PACKAGE]
    src = official_dir()
    package = _module(PACKAGE, package=True)
    package.__path__ = [str(src)]
    sys.modules[PACKAGE] = package
    try:
        with stubbed_modules(_stub_tree()):
            for sub in SUBMODULES:
                name = f"{PACKAGE}.{sub}"
                spec = importlib.util.spec_from_file_location(name, src / f"{sub}.py")
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
                setattr(package, sub, mod)
        _vision_stand_ins(package.modeling_kimi_k3)
    except BaseException:
        for sub in SUBMODULES:
            sys.modules.pop(f"{PACKAGE}.{sub}", None)
        sys.modules.pop(PACKAGE, None)
        raise
    _LOADED[PACKAGE] = package
    return package


# ----------------------------------------------------------------------------------------------------------------
# Building and filling the reference model
# ----------------------------------------------------------------------------------------------------------------

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `mxfp4-pack-quantized`: two e2m1 codes per byte (low nibble first), one ue8m0 exponent
    per 32 input columns; w = value · 2^(scale − 127). packed [O, I/2] uint8, scale [O, I/32] uint8 -> [O, I] fp32."""
    table = torch.tensor(_E2M1 + tuple(-x for x in _E2M1))  # code bit 3 is the sign
    b = packed.to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(packed.shape[0], -1)  # [O, I]
    values = table[codes]
    exps = scale.to(torch.float32) - 127.0  # [O, I/32]
    return values * torch.pow(2.0, exps).repeat_interleave(32, dim=-1)[:, : values.shape[1]]


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = ([model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
             if index.is_file() else sorted(model_dir.glob("*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    packed = [n for n in tensors if n.endswith(".weight_packed")]
    for name in packed:
        base = name.removesuffix(".weight_packed")
        tensors[f"{base}.weight"] = _dequantize_mxfp4(tensors.pop(name), tensors.pop(f"{base}.weight_scale"))
    return tensors


def load_reference_k3(model_dir: str | Path) -> nn.Module:
    """`KimiK3ForConditionalGeneration` (official code) in fp32 / eager attention, weights from `model_dir`."""
    model_dir = Path(model_dir)
    pkg = load_reference_package()
    raw = json.loads((model_dir / "config.json").read_text())
    config = pkg.configuration_kimi_k3.KimiK3Config(
        text_config=dict(raw["text_config"]), vision_config=dict(raw.get("vision_config") or {}),
        media_placeholder_token_id=raw.get("media_placeholder_token_id", 163605),
        pad_token_id=raw.get("pad_token_id", 0))
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = pkg.modeling_kimi_k3.KimiK3ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch_default)
    model = model.float().eval().requires_grad_(False)

    state = _read_checkpoint(model_dir)
    n, mtp = raw["text_config"]["num_hidden_layers"], raw["text_config"].get("num_nextn_predict_layers") or 0
    mtp_prefixes = tuple(f"{TEXT_PREFIX}model.layers.{i}." for i in range(n, n + mtp))  # not in the official model
    state = {k: t for k, t in state.items() if not k.startswith(mtp_prefixes)}
    params = dict(model.state_dict())
    for name, tensor in list(state.items()):
        if name.endswith("self_attn.A_log") and name in params:
            state[name] = tensor.reshape(-1)[: params[name].numel()].reshape(params[name].shape)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing_text = [n for n in missing if n.startswith(TEXT_PREFIX)]
    if missing_text or unexpected:
        raise ValueError(f"reference load: missing {missing_text}, unexpected {unexpected}")
    return model


def text_config(model: nn.Module):
    return model.config.text_config


@torch.no_grad()
def reference_logits(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """One full forward without a cache. -> [T, V] fp32."""
    out = model(input_ids=torch.tensor([token_ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def _new_cache(model: nn.Module):
    return load_reference_package().modeling_kimi_linear.KimiDynamicCache(text_config(model))


@torch.no_grad()
def reference_incremental_logits(model: nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Prefill `prompt` into a `KimiDynamicCache`, then feed `continuation` one token at a time.
    -> [1 + len(continuation), V] fp32: the prompt's last-position logits, then each step's."""
    cache = _new_cache(model)
    out = model(input_ids=torch.tensor([prompt], dtype=torch.long), past_key_values=cache, use_cache=True)
    rows = [out.logits[0, -1].float()]
    for token in continuation:
        out = model(input_ids=torch.tensor([[token]], dtype=torch.long), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.no_grad()
def reference_generate(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding on the reference's own cached path (prefill once, then one token per step)."""
    cache = _new_cache(model)
    out = model(input_ids=torch.tensor([prompt], dtype=torch.long), past_key_values=cache, use_cache=True)
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            return tokens
        out = model(input_ids=torch.tensor([[token]], dtype=torch.long), past_key_values=cache, use_cache=True)


@torch.no_grad()
def reference_generate_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of equal-length prompts as one batch [B, L] on the reference's cached path (no padding)."""
    cache = _new_cache(model)
    out = model(input_ids=torch.tensor(prompts, dtype=torch.long), past_key_values=cache, use_cache=True)
    steps: list[torch.Tensor] = []
    while True:
        tokens = out.logits[:, -1].argmax(-1)  # [B]
        steps.append(tokens)
        if len(steps) == max_new_tokens:
            return torch.stack(steps, dim=1).tolist()
        out = model(input_ids=tokens[:, None], past_key_values=cache, use_cache=True)
