"""Sizing: what one rank of a (tensor/expert-parallel) deployment holds, and how many requests fit. Torch-free.

Contract:
- `rank_weight_bytes(config, tp, ep, experts_format, dtype_bytes)` -> `WeightBytes`: the bytes one rank's model
  keeps resident, exactly as engine/model builds it (split parameters at 1/N, replicated ones whole, the fused
  projections' padding rows, fp32 where the model keeps fp32, packed MXFP4 experts at 17/32 byte per parameter).
  tests/unit/parallel/test_plan.py checks it against the storage of the models built for the tiny presets.
- `kv_bytes_per_token(config, dtype_bytes, kv_cache_dtype)`: MLA latent bytes per token of context (replicated:
  every rank holds them; FP8 rows are one byte a value plus a 4-byte scale); `state_bytes_per_request(config, dtype_bytes, tp)`: one rank's KDA state slot (its H/N heads: conv window
  in the model dtype, recurrent state fp32). `CacheTensors.allocate` allocates exactly these.
- `plan(config, PlanArgs)` -> `Plan`: per GPU usable memory = `gpu_memory * gpu_memory_utilization` minus the rank's
  weights (activations and CUDA graphs must fit in the remaining `1 - utilization`); a request at `context_len`
  costs its state slice plus `context_len` tokens of latents per rank; `concurrency` is requests per replica
  (`gpus // tp` replicas); the handoff (TP-independent: the whole KDA state + the prompt's latents) and its
  transfer time at `link_gbps`. `fits` is False, with the reason, when the weights or a single request do not fit.
- Divisibility is checked like the model does (`ParallelConfig.split`): a split that does not divide raises
  `ParallelError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import ModelConfig
from engine.parallel.config import ParallelConfig, ParallelError

FUSED_ROWS_MULTIPLE = 16  # engine.model.fused pads a FusedLinear's rows to this
FUSED_GATE_UP_MAX = 1024  # engine.model.common: MLPs up to this intermediate (per rank) fuse gate/up
FP32 = 4
FP8_SCALE_BYTES = 4  # kernels.attention.fp8_latent.SCALE_BYTES: one fp32 scale per token row
MXFP4_BYTES = 17 / 32  # a packed value (1/2 byte) plus one uint8 scale per 32


@dataclass(frozen=True)
class WeightBytes:
    split: int  # parameters each rank holds 1/N of (attention heads, MLP columns, vocabulary), this rank's part
    replicated: int  # norms, router, latents, low-rank projections, fused padding: the same on every rank
    experts: int  # routed experts on this rank (split by intermediate, or by expert under EP)

    @property
    def total(self) -> int:
        return self.split + self.replicated + self.experts


def _pad(rows: int) -> int:
    return -(-rows // FUSED_ROWS_MULTIPLE) * FUSED_ROWS_MULTIPLE


class _Tally:
    def __init__(self, dtype_bytes: int):
        self.d = dtype_bytes
        self.split = self.replicated = self.experts = 0.0

    def add(self, numel: float, split: bool, fp32: bool = False) -> None:
        nbytes = numel * (FP32 if fp32 else self.d)
        if split:
            self.split += nbytes
        else:
            self.replicated += nbytes

    def fused(self, parts: list[tuple[int, bool]], width: int) -> None:
        """A FusedLinear of `width` inputs over (rows, split) parts; the padding counts as replicated."""
        for rows, split in parts:
            self.add(rows * width, split)
        total = sum(rows for rows, _ in parts)
        self.add((_pad(total) - total) * width, False)


def _kda(t: _Tally, config: ModelConfig, pc: ParallelConfig) -> None:
    k, h = config.kda, config.hidden_size
    heads = pc.split(k.num_heads, "KDA heads (linear_attn_config.num_heads)")
    proj = heads * k.head_dim
    gate = (proj, True) if k.full_rank_output_gate else (k.head_dim, False)
    t.fused([(3 * proj, True), (k.head_dim, False), (heads, True), gate], h)
    t.add(3 * proj * k.conv_kernel_size + heads + proj, True, fp32=True)  # convs, A_log, dt_bias
    t.add(proj * k.head_dim, True)  # f_b_proj
    if not k.full_rank_output_gate:
        t.add(proj * k.head_dim, True)  # g_b_proj
    t.add(k.head_dim, False)  # o_norm
    t.add(h * proj, True)  # o_proj


def _mla(t: _Tally, config: ModelConfig, pc: ParallelConfig) -> None:
    m, h = config.mla, config.hidden_size
    heads = pc.split(m.num_heads, "MLA heads (num_attention_heads)")
    q_dim = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    parts = [(m.q_lora_rank, False) if m.q_lora_rank else (q_dim, True), (m.kv_lora_rank + m.qk_rope_head_dim, False)]
    t.fused(parts + ([(heads * m.v_head_dim, True)] if m.output_gate else []), h)
    if m.q_lora_rank:
        t.add(m.q_lora_rank, False)
        t.add(q_dim * m.q_lora_rank, True)
    t.add(m.kv_lora_rank, False)
    t.add(heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank, True)
    t.add(h * heads * m.v_head_dim, True)


def _mlp(t: _Tally, hidden: int, intermediate: int, pc: ParallelConfig, what: str) -> None:
    inter = pc.split(intermediate, what)
    if inter <= FUSED_GATE_UP_MAX:
        t.fused([(2 * inter, True)], hidden)
    else:
        t.add(2 * inter * hidden, True)
    t.add(hidden * inter, True)


def _moe(t: _Tally, config: ModelConfig, pc: ParallelConfig, packed: bool) -> None:
    moe, h = config.moe, config.hidden_size
    width = moe.latent_size or h
    t.add(moe.num_experts * (h + 1), False, fp32=True)  # router and correction bias
    if pc.enable_expert_parallel:
        experts, inter = pc.split(moe.num_experts, "routed experts (num_experts)"), moe.intermediate_size
    else:
        experts = moe.num_experts
        inter = pc.split(moe.intermediate_size, "routed expert intermediate size (moe_intermediate_size)")
    if packed and (inter % 32 or width % 32):
        raise ParallelError(f"MXFP4 experts need widths that are multiples of 32: expert width {width}, "
                            f"intermediate per rank {inter} (use --enable-expert-parallel to keep whole experts)")
    t.experts += experts * 3 * inter * width * (MXFP4_BYTES if packed else t.d)
    if moe.num_shared_experts:
        _mlp(t, h, moe.intermediate_size * moe.num_shared_experts, pc, "shared expert intermediate size")
    if moe.latent_size:
        t.add(width * h, False)  # routed_expert_down_proj
        t.add(h * pc.split(width, "routed_expert_hidden_size"), True)  # routed_expert_up_proj
        if moe.latent_use_norm:
            t.add(width, False)


def rank_weight_bytes(config: ModelConfig, tp: int = 1, ep: bool = False, experts_format: str = "dense",
                      dtype_bytes: int = 2) -> WeightBytes:
    pc = ParallelConfig(tp, 0, ep)
    t, h = _Tally(dtype_bytes), config.hidden_size
    vocab = pc.split(config.vocab_size, "vocab_size")
    t.add(vocab * h * (1 if config.tie_word_embeddings else 2), True)
    t.add(h * (3 if config.attn_res_block_size else 1), False)  # final norm (+ output attn-res norm and proj)
    for spec in config.layers:
        (_kda if spec.mixer == "kda" else _mla)(t, config, pc)
        if spec.ffn == "moe":
            _moe(t, config, pc, experts_format == "mxfp4")
        else:
            _mlp(t, h, config.intermediate_size, pc, "intermediate_size")
        t.add(2 * h + (4 * h if spec.residual == "attn_res" else 0), False)  # layer norms (+ attn-res mixes)
    return WeightBytes(round(t.split), round(t.replicated), round(t.experts))


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """'fp8' / 'fp8_e4m3': one byte per latent value plus a per-token fp32 scale per layer
    (kernels/attention/fp8_latent.py's rows); 'auto': the model dtype."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return len(config.mla_layer_ids) * (config.mla.cache_dim + FP8_SCALE_BYTES)
    return len(config.mla_layer_ids) * config.mla.cache_dim * dtype_bytes


def state_bytes_per_request(config: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    if config.kda is None:
        return 0
    k = config.kda
    heads = ParallelConfig(tp).split(k.num_heads, "KDA heads (linear_attn_config.num_heads)")
    conv = 3 * heads * k.head_dim * (k.conv_kernel_size - 1) * dtype_bytes
    return len(config.kda_layer_ids) * (conv + heads * k.head_dim * k.head_dim * FP32)


@dataclass(frozen=True)
class PlanArgs:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpus: int | None = None  # default: one replica (= tensor_parallel_size)
    gpu_memory: int = 141 * 10**9  # bytes per GPU (H200: 141 GB)
    gpu_memory_utilization: float = 0.9
    context_len: int = 32768
    link_gbps: float = 400.0  # prefill -> decode link, gigabits per second
    dtype_bytes: int = 2
    experts_format: str = "auto"  # auto: as the config declares (MXFP4 stays packed)
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype: auto (dtype_bytes) or fp8 rows


@dataclass(frozen=True)
class Plan:
    args: PlanArgs
    experts_format: str
    weights: WeightBytes
    kv_per_token: int
    state_per_request: int  # per rank
    request_bytes: int  # per rank, at context_len
    usable_bytes: int  # per GPU after weights
    replicas: int
    concurrency: int  # requests per replica at context_len
    handoff_bytes: int
    handoff_seconds: float
    fits: bool
    reason: str


def declared_experts_format(config: ModelConfig) -> str:
    quant = config.raw.get("text_config", config.raw).get("quantization_config") or {}
    return "mxfp4" if quant.get("format") == "mxfp4-pack-quantized" else "dense"


def plan(config: ModelConfig, args: PlanArgs) -> Plan:
    tp = args.tensor_parallel_size
    fmt = declared_experts_format(config) if args.experts_format == "auto" else args.experts_format
    weights = rank_weight_bytes(config, tp, args.enable_expert_parallel, fmt, args.dtype_bytes)
    kv = kv_bytes_per_token(config, args.dtype_bytes, args.kv_cache_dtype)
    state = state_bytes_per_request(config, args.dtype_bytes, tp)
    request = state + args.context_len * kv
    usable = int(args.gpu_memory * args.gpu_memory_utilization) - weights.total
    gpus = args.gpus or tp
    replicas = gpus // tp
    concurrency = max(0, usable // request) if request else 0
    handoff = state_bytes_per_request(config, args.dtype_bytes) + args.context_len * kv
    reason = ""
    if replicas == 0:
        reason = f"{gpus} GPUs cannot hold one replica of tensor-parallel size {tp}"
    elif usable <= 0:
        reason = (f"weights need {_gb(weights.total)} per GPU; "
                  f"{_gb(args.gpu_memory)} x {args.gpu_memory_utilization} usable")
    elif concurrency == 0:
        reason = f"one request at {args.context_len} tokens needs {_gb(request)} per GPU; {_gb(usable)} left"
    return Plan(args, fmt, weights, kv, state, request, usable, replicas, int(concurrency), handoff,
                handoff * 8 / (args.link_gbps * 1e9), not reason, reason)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def format_plan(p: Plan) -> str:
    a, w = p.args, p.weights
    lines = [
        f"tensor-parallel {a.tensor_parallel_size}{' + expert-parallel' if a.enable_expert_parallel else ''}, "
        f"{p.replicas} replica(s) on {a.gpus or a.tensor_parallel_size} GPUs of {_gb(a.gpu_memory)}, "
        f"experts {p.experts_format}, {a.dtype_bytes}-byte weights, "
        f"{'FP8 (e4m3 + per-token scale)' if a.kv_cache_dtype != 'auto' else f'{a.dtype_bytes}-byte'} KV",
        f"weights per rank: {_gb(w.total)} (split {_gb(w.split)}, replicated {_gb(w.replicated)}, "
        f"routed experts {_gb(w.experts)})",
        f"KV per token (MLA latents, every rank): {p.kv_per_token} B; KDA state per request per rank: "
        f"{p.state_per_request / 2**20:.2f} MiB",
        f"per request at {a.context_len} tokens, per rank: {_gb(p.request_bytes)}; usable after weights: "
        f"{_gb(max(p.usable_bytes, 0))}",
        f"handoff (whole state + prompt latents): {_gb(p.handoff_bytes)}, {p.handoff_seconds * 1e3:.1f} ms at "
        f"{a.link_gbps:g} Gb/s",
    ]
    if p.fits:
        lines.append(f"fits: {p.concurrency} concurrent requests at {a.context_len} tokens per replica, "
                     f"{p.concurrency * p.replicas} in all")
    else:
        lines.append(f"does not fit: {p.reason}")
    return "\n".join(lines)
