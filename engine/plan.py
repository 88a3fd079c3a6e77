"""Sizing: what each rank of a (tensor/expert/pipeline-parallel) deployment holds, and how many requests fit.
Torch-free.

Contract:
- Weights per rank: engine/plan_weights.py (`rank_weight_bytes`, `mtp_weight_bytes`), re-exported here.
- `kv_bytes_per_token(config, dtype_bytes, kv_cache_dtype, layers)`: MLA latent bytes per token of context
  (replicated: every rank of a stage holds them; FP8 rows are one byte a value plus a 4-byte scale); `state_bytes_per_request(config, dtype_bytes, tp, layers)`: one rank's KDA state slot
  (its H/N heads: conv window in the model dtype, recurrent state fp32). `CacheTensors.allocate` allocates exactly
  these. `layers` (default all) restricts both to a pipeline stage's layers.
- `step_activation_bytes(config, tokens, tp, ep, dtype_bytes)`: an estimate of the largest buffers one prefill step
  of `tokens` tokens keeps alive at once on a rank, by term: routed-expert buffers (every token's top-k rows are
  gathered on every rank, EP or not: gathered input, gate/up, activation, output and the un-permuted rows),
  K3's attention-residual snapshots and their fp32 mix, the residual stream. The engine measures the real peak
  (engine/memory_profile.py); this is what `kdamesh plan` reserves for it.
- `plan(config, PlanArgs)` -> `Plan`: per GPU, `gpu_memory * gpu_memory_utilization` holds, per rank: the weights,
  the runtime (`runtime_bytes`: CUDA context, NCCL buffers; assumed), the step activations
  (`max_num_batched_tokens`), and on a lead rank (rank 0 of a stage, where the engine runs them) the drafter's
  weights (MTP layers from the config, or a DSpark folder's; last stage) and the vision tower (first stage); what
  remains holds requests. A
  request at `context_len` costs per rank its KDA state slice times `1 + num_speculative_tokens` (the verification
  scratch slots) plus `context_len` tokens of latents (`ceil(context_len / N)` under decode-context parallelism
  `decode_context_parallel_size` N: each rank of a DCP group holds every N-th token, engine/parallel/context.py), and on the lead rank the drafter's context rows (capacity
  rounded up to a power of two, engine/spec/draft_cache.py). `concurrency` (per replica) is the smallest over the
  ranks; `load_peak` (weights + one checkpoint file per rank, engine/model/loader.py's bound) must fit the GPU too.
  With `pipeline_parallel_size` > 1 the layers are split into contiguous stages (computed here, not built: the
  engine runs one stage); each stage's ranks are planned with their own layers. The handoff (TP-independent: the
  whole KDA state + the prompt's latents) and its transfer time at `link_gbps`. `fits` is False, with the reason,
  when the weights, the load or a single request do not fit.
- Divisibility is checked like the model does (`ParallelConfig.split`): a split that does not divide raises
  `ParallelError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.model.config import ModelConfig
from engine.parallel.config import ParallelConfig, ParallelError
from engine.plan_weights import FP32, WeightBytes, mtp_weight_bytes, rank_weight_bytes, stage_layers

__all__ = ["ParallelError", "PlanArgs", "Plan", "RankBytes", "DrafterBytes", "WeightBytes", "plan", "format_plan",
           "rank_weight_bytes", "mtp_weight_bytes", "kv_bytes_per_token", "state_bytes_per_request",
           "step_activation_bytes"]
SPECULATIVE_METHODS = ("none", "ngram", "mtp", "dspark")
FP8_SCALE_BYTES = 4  # kernels.attention.fp8_latent.SCALE_BYTES: one fp32 scale per token row


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto",
                       layers: range | None = None) -> int:
    """'fp8' / 'fp8_e4m3': one byte per latent value plus a per-token fp32 scale per layer
    (kernels/attention/fp8_latent.py's rows); 'auto': the model dtype. `layers`: a stage's (default all)."""
    ids = [i for i in config.mla_layer_ids if layers is None or i in layers]
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return len(ids) * (config.mla.cache_dim + FP8_SCALE_BYTES)
    return len(ids) * config.mla.cache_dim * dtype_bytes


def state_bytes_per_request(config: ModelConfig, dtype_bytes: int, tp: int = 1, layers: range | None = None) -> int:
    if config.kda is None:
        return 0
    k = config.kda
    heads = ParallelConfig(tp).split(k.num_heads, "KDA heads (linear_attn_config.num_heads)")
    conv = 3 * heads * k.head_dim * (k.conv_kernel_size - 1) * dtype_bytes
    ids = [i for i in config.kda_layer_ids if layers is None or i in layers]
    return len(ids) * (conv + heads * k.head_dim * k.head_dim * FP32)


def step_activation_bytes(config: ModelConfig, tokens: int, tp: int = 1, ep: bool = False,
                          dtype_bytes: int = 2) -> dict[str, int]:
    """Estimated peak buffers of one prefill step of `tokens` tokens on one rank, by term (see the contract)."""
    h, terms = config.hidden_size, {}
    if config.moe is not None:
        moe = config.moe
        width = moe.latent_size or h
        inter = moe.intermediate_size if ep else moe.intermediate_size // tp
        terms["routed experts"] = tokens * moe.top_k * (3 * width + 3 * inter) * dtype_bytes
    if config.attn_res_block_size:
        blocks = math.ceil(len(config.layers) / config.attn_res_block_size)
        terms["attention residuals"] = tokens * h * (blocks * dtype_bytes + (blocks + 1) * FP32)
    terms["residual stream"] = 4 * tokens * h * FP32
    return terms


@dataclass(frozen=True)
class DrafterBytes:
    """A drafter on the lead rank: its weights, and its context rows' bytes per token of a request."""

    weights: int
    row_bytes: int


@dataclass(frozen=True)
class PlanArgs:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpus: int | None = None  # default: one replica (= tensor_parallel_size x pipeline_parallel_size)
    gpu_memory: int = 141 * 10**9  # bytes per GPU (H200: 141 GB)
    gpu_memory_utilization: float = 0.9
    context_len: int = 32768
    link_gbps: float = 400.0  # prefill -> decode link, gigabits per second
    dtype_bytes: int = 2
    experts_format: str = "auto"  # auto: as the config declares (MXFP4 stays packed)
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype: auto (dtype_bytes) or fp8 rows
    pipeline_parallel_size: int = 1  # contiguous layer stages (computed here; the engine does not run them yet)
    decode_context_parallel_size: int = 1  # DCP: a rank holds 1/N of the tokens' MLA latents (N divides TP)
    num_speculative_tokens: int = 0  # k: each running request holds 1 + k KDA state slots
    speculative_method: str = "none"  # none | ngram | mtp | dspark: the drafter the lead rank holds
    drafter: DrafterBytes | None = None  # dspark: measured from its folder (deploy/plan_cli.py); mtp: from config
    vision_bytes: int = 0  # vision tower + projector, on the lead rank
    runtime_bytes: int = 2 * 10**9  # per GPU: CUDA context, NCCL buffers, allocator slack (assumed)
    max_num_batched_tokens: int = 16384  # the largest prefill step, whose activations stay reserved
    shard_bytes: int = 5 * 10**9  # the largest checkpoint file: loading peaks at weights + one file per rank

    def __post_init__(self):
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method {self.speculative_method!r}: expected one of {SPECULATIVE_METHODS}")
        if self.speculative_method == "dspark" and self.drafter is None:
            raise ValueError("speculative_method dspark needs the drafter's folder (--drafter-dir)")
        if (self.speculative_method == "none") != (self.num_speculative_tokens == 0):
            raise ValueError("num_speculative_tokens and speculative_method go together (both set or neither)")
        ParallelConfig(self.tensor_parallel_size, 0, self.enable_expert_parallel,
                       self.decode_context_parallel_size)  # DCP must divide TP: ParallelError naming the flag


@dataclass(frozen=True)
class RankBytes:
    """One rank's memory: what stays resident before any request, and what one request adds."""

    stage: int
    lead: bool  # rank 0 of its stage: also the vision tower (first stage) and the drafter (last stage)
    weights: int
    drafter_weights: int
    vision: int
    runtime: int
    activations: int
    per_request: int
    usable: int  # gpu_memory * utilization - everything fixed: what the requests get
    load_peak: int  # weights + one checkpoint file (transient, while loading)

    @property
    def fixed(self) -> int:
        return self.weights + self.drafter_weights + self.vision + self.runtime + self.activations

    @property
    def concurrency(self) -> int:
        return max(0, self.usable // self.per_request) if self.per_request else 0


@dataclass(frozen=True)
class Plan:
    args: PlanArgs
    experts_format: str
    weights: WeightBytes  # the heaviest stage's rank
    kv_per_token: int  # the heaviest stage's (all ranks of a DCP group together)
    state_per_request: int  # per rank, the heaviest stage's
    request_bytes: int  # per rank, at context_len (the heaviest rank's)
    usable_bytes: int  # per GPU after everything fixed (the tightest rank's)
    replicas: int
    concurrency: int  # requests per replica at context_len: the smallest over the ranks
    handoff_bytes: int
    handoff_seconds: float
    fits: bool
    reason: str
    ranks: list[RankBytes] = field(default_factory=list)  # per stage: the lead rank and (TP > 1) another
    activation_terms: dict[str, int] = field(default_factory=dict)


def declared_experts_format(config: ModelConfig) -> str:
    quant = config.raw.get("text_config", config.raw).get("quantization_config") or {}
    return "mxfp4" if quant.get("format") == "mxfp4-pack-quantized" else "dense"


def _drafter(config: ModelConfig, args: PlanArgs, fmt: str) -> DrafterBytes:
    if args.speculative_method == "mtp":
        if not config.mtp_layers:
            raise ValueError("speculative_method mtp: the config declares no MTP layers (num_nextn_predict_layers)")
        rows = len(config.mtp_layers) * config.mla.cache_dim * args.dtype_bytes
        return DrafterBytes(mtp_weight_bytes(config, fmt, args.dtype_bytes), rows)
    if args.speculative_method == "dspark":
        return args.drafter
    return DrafterBytes(0, 0)


def _rank(config: ModelConfig, args: PlanArgs, fmt: str, stage: int, lead: bool, activations: int) -> RankBytes:
    tp, pp, d = args.tensor_parallel_size, args.pipeline_parallel_size, args.dtype_bytes
    layers = stage_layers(len(config.layers), pp, stage)
    weights = rank_weight_bytes(config, tp, args.enable_expert_parallel, fmt, d, pp, stage).total
    drafter = _drafter(config, args, fmt) if lead and stage == pp - 1 else DrafterBytes(0, 0)  # reads final hidden
    state = state_bytes_per_request(config, d, tp, layers) * (1 + args.num_speculative_tokens)
    rows = drafter.row_bytes * (1 << max(0, args.context_len - 1).bit_length())  # SlotRows: powers of two
    tokens = -(-args.context_len // args.decode_context_parallel_size)  # this rank's share of the latents
    request = state + tokens * kv_bytes_per_token(config, d, args.kv_cache_dtype, layers) + rows
    vision = args.vision_bytes if lead and stage == 0 else 0  # feeds the embeddings
    fixed = weights + drafter.weights + vision + args.runtime_bytes + activations
    return RankBytes(stage, lead, weights, drafter.weights, vision, args.runtime_bytes, activations, request,
                     int(args.gpu_memory * args.gpu_memory_utilization) - fixed, weights + args.shard_bytes)


def plan(config: ModelConfig, args: PlanArgs) -> Plan:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    fmt = declared_experts_format(config) if args.experts_format == "auto" else args.experts_format
    terms = step_activation_bytes(config, args.max_num_batched_tokens, tp, args.enable_expert_parallel,
                                  args.dtype_bytes)
    ranks = [_rank(config, args, fmt, s, lead, sum(terms.values()))
             for s in range(pp) for lead in ((True, False) if tp > 1 else (True,))]
    heaviest = max(range(pp), key=lambda s: rank_weight_bytes(config, tp, args.enable_expert_parallel, fmt,
                                                               args.dtype_bytes, pp, s).total)
    layers = stage_layers(len(config.layers), pp, heaviest)
    weights = rank_weight_bytes(config, tp, args.enable_expert_parallel, fmt, args.dtype_bytes, pp, heaviest)
    kv = kv_bytes_per_token(config, args.dtype_bytes, args.kv_cache_dtype, layers)
    state = state_bytes_per_request(config, args.dtype_bytes, tp, layers)
    tightest = min(ranks, key=lambda r: (r.concurrency, r.usable))
    gpus = args.gpus or tp * pp
    replicas = gpus // (tp * pp)
    handoff = state_bytes_per_request(config, args.dtype_bytes) + args.context_len * kv_bytes_per_token(
        config, args.dtype_bytes, args.kv_cache_dtype)
    return Plan(args, fmt, weights, kv, state, max(r.per_request for r in ranks), tightest.usable, replicas,
                int(tightest.concurrency), handoff, handoff * 8 / (args.link_gbps * 1e9),
                *_verdict(args, ranks, replicas, gpus, tightest), ranks, terms)


def _verdict(args: PlanArgs, ranks: list[RankBytes], replicas: int, gpus: int, tightest: RankBytes
             ) -> tuple[bool, str]:
    budget = int(args.gpu_memory * args.gpu_memory_utilization)
    reason = ""
    if replicas == 0:
        reason = (f"{gpus} GPUs cannot hold one replica of tensor-parallel size {args.tensor_parallel_size} x "
                  f"{args.pipeline_parallel_size} stage(s)")
    elif any(r.usable <= 0 for r in ranks):
        worst = min(ranks, key=lambda r: r.usable)
        reason = (f"weights need {_gb(worst.weights)} per GPU and everything fixed {_gb(worst.fixed)} "
                  f"(stage {worst.stage}{', lead rank' if worst.lead else ''}); "
                  f"{_gb(args.gpu_memory)} x {args.gpu_memory_utilization} = {_gb(budget)} usable")
    elif any(r.load_peak > args.gpu_memory for r in ranks):
        reason = (f"loading peaks at {_gb(max(r.load_peak for r in ranks))} (weights + one "
                  f"{_gb(args.shard_bytes)} file) per GPU; {_gb(args.gpu_memory)} on the GPU")
    elif tightest.concurrency == 0:
        reason = (f"one request at {args.context_len} tokens needs {_gb(tightest.per_request)} per GPU; "
                  f"{_gb(tightest.usable)} left")
    return not reason, reason


def _per_rank_kv(p: Plan) -> str:
    n = p.args.decode_context_parallel_size
    if n == 1:
        return f"{p.kv_per_token} B (replicated on every rank)"
    return f"{p.kv_per_token / n:g} B (decode-context parallel {n}: each rank holds every {n}th token)"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def format_plan(p: Plan) -> str:
    a, w = p.args, p.weights
    stages = f" x {a.pipeline_parallel_size} pipeline stages" if a.pipeline_parallel_size > 1 \
        else ""
    spec = f", speculative {a.speculative_method} k={a.num_speculative_tokens}" if a.num_speculative_tokens else ""
    lines = [
        f"tensor-parallel {a.tensor_parallel_size}{' + expert-parallel' if a.enable_expert_parallel else ''}{stages}, "
        f"{p.replicas} replica(s) on {a.gpus or a.tensor_parallel_size * a.pipeline_parallel_size} GPUs of "
        f"{_gb(a.gpu_memory)}, experts {p.experts_format}, {a.dtype_bytes}-byte weights, "
        f"{'FP8 (e4m3 + per-token scale)' if a.kv_cache_dtype != 'auto' else f'{a.dtype_bytes}-byte'} KV{spec}",
        f"weights per rank: {_gb(w.total)} (split {_gb(w.split)}, replicated {_gb(w.replicated)}, "
        f"routed experts {_gb(w.experts)})",
        f"KV per token (MLA latents): {p.kv_per_token} B, per rank {_per_rank_kv(p)}; KDA state per request per rank: "
        f"{p.state_per_request / 2**20:.2f} MiB",
        f"activations of a {a.max_num_batched_tokens}-token step per rank (estimate): "
        + ", ".join(f"{k} {_gb(v)}" for k, v in p.activation_terms.items()),
        "per rank (of GPU x utilization = "
        f"{_gb(a.gpu_memory * a.gpu_memory_utilization)}):",
    ]
    for r in p.ranks:
        lines.append(
            f"  stage {r.stage} {'lead rank' if r.lead else 'other ranks'}: weights {_gb(r.weights)} + drafter "
            f"{_gb(r.drafter_weights)} + vision {_gb(r.vision)} + runtime {_gb(r.runtime)} + activations "
            f"{_gb(r.activations)} = {_gb(r.fixed)}; requests get {_gb(max(r.usable, 0))} at {_gb(r.per_request)} "
            f"each -> {r.concurrency}; load peak {_gb(r.load_peak)}")
    lines.append(f"handoff (whole state + prompt latents): {_gb(p.handoff_bytes)}, {p.handoff_seconds * 1e3:.1f} ms "
                 f"at {a.link_gbps:g} Gb/s")
    if p.fits:
        lines.append(f"fits: {p.concurrency} concurrent requests at {a.context_len} tokens per replica, "
                     f"{p.concurrency * p.replicas} in all")
    else:
        lines.append(f"does not fit: {p.reason}")
    return "\n".join(lines)
