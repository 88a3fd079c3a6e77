"""Per-rank weight bytes, exactly as engine/model builds a rank (the tally behind engine/plan.py). Torch-free.

Contract:
- `rank_weight_bytes(config, tp, ep, experts_format, dtype_bytes, stages, stage)` -> `WeightBytes`: the bytes one
  rank's model keeps resident (split parameters at 1/N, replicated ones whole, the fused projections' padding rows,
  fp32 where the model keeps fp32, packed MXFP4 experts at 17/32 byte per parameter); with `stages` > 1 pipeline
  stage `stage`'s share (`stage_layers`: contiguous layers; embedding first, LM head last). Pipeline parallelism
  is computed here, not built in the engine. tests/unit/parallel/test_plan.py checks it against the storage of the
  models built for the tiny presets.
- `mtp_weight_bytes(config, experts_format, dtype_bytes)`: the MTP drafter layers a config declares, whole (the
  drafter runs on rank 0); tests/unit/engine/test_plan_items.py checks it against `build_mtp_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import ModelConfig
from engine.parallel.config import ParallelConfig, ParallelError

FUSED_ROWS_MULTIPLE = 16  # engine.model.fused pads a FusedLinear's rows to this
FUSED_GATE_UP_MAX = 1024  # engine.model.common: MLPs up to this intermediate (per rank) fuse gate/up
FP32 = 4
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


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """Layer indices of pipeline stage `stage` of `stages`: contiguous, the first stages one longer when uneven."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


def rank_weight_bytes(config: ModelConfig, tp: int = 1, ep: bool = False, experts_format: str = "dense",
                      dtype_bytes: int = 2, stages: int = 1, stage: int = 0) -> WeightBytes:
    """One rank's resident weights; with `stages` > 1 those of pipeline stage `stage` (its layers; the embedding
    on the first stage, the final norm and LM head on the last)."""
    pc = ParallelConfig(tp, 0, ep)
    t, h = _Tally(dtype_bytes), config.hidden_size
    vocab = pc.split(config.vocab_size, "vocab_size")
    first, last = stage == 0, stage == stages - 1
    t.add(vocab * h * ((first or config.tie_word_embeddings) + (last and not config.tie_word_embeddings)), True)
    if last:
        t.add(h * (3 if config.attn_res_block_size else 1), False)  # final norm (+ output attn-res norm and proj)
    for i in stage_layers(len(config.layers), stages, stage):
        _layer(t, config, config.layers[i], pc, experts_format == "mxfp4")
    return WeightBytes(round(t.split), round(t.replicated), round(t.experts))


def _layer(t: _Tally, config: ModelConfig, spec, pc: ParallelConfig, packed: bool) -> None:
    h = config.hidden_size
    (_kda if spec.mixer == "kda" else _mla)(t, config, pc)
    if spec.ffn == "moe":
        _moe(t, config, pc, packed)
    else:
        _mlp(t, h, config.intermediate_size, pc, "intermediate_size")
    t.add(2 * h + (4 * h if spec.residual == "attn_res" else 0), False)  # layer norms (+ attn-res mixes)


def mtp_weight_bytes(config: ModelConfig, experts_format: str = "dense", dtype_bytes: int = 2) -> int:
    """The MTP drafter's layers (engine/spec/mtp_model.py), whole (the drafter runs unsharded on rank 0): per layer
    `enorm`, `hnorm`, `eh_proj`, `shared_head` (norm + its own LM head), the drafter MLA (`DraftMLA`, unfused), the
    two layer norms and the FFN (the target's MoE at TP=1)."""
    pc, total = ParallelConfig(1, 0, False), 0
    for spec in config.mtp_layers:
        t, h, m = _Tally(dtype_bytes), config.hidden_size, config.mla
        heads = m.num_heads
        t.add(2 * h + 2 * h * h + h + config.vocab_size * h + 2 * h, False)  # norms, eh_proj, shared head
        q_width = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        t.add(h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_width if m.q_lora_rank else h * q_width, False)
        t.add(h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank, False)
        t.add(m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h, False)
        if m.output_gate:
            t.add(h * heads * m.v_head_dim, False)
        if spec.ffn == "moe":
            _moe(t, config, pc, experts_format == "mxfp4")
        else:
            _mlp(t, h, config.intermediate_size, pc, "intermediate_size")
        total += round(t.split + t.replicated + t.experts)
    return total
