"""The MoE FFN of both families: sigmoid router, routed experts (dense or packed MXFP4), shared experts.

Contract:
- Routed experts are stacked tensors under `experts.` (the loader fills them from `experts.{e}.w{1,2,3}.*`):
  dense `w1`/`w3` [E, I, Dm] (gate, up) and `w2` [E, Dm, I] (down), or packed MXFP4 (`experts_format="mxfp4"`):
  `w{1,3}_packed` [E, I, Dm/2] + `w{1,3}_scale` [E, I, Dm/32] and `w2_packed` [E, Dm, I/2] + `w2_scale` [E, Dm, I/32]
  (uint8, compressed-tensors `mxfp4-pack-quantized`, kept resident at ≈0.53 bytes per parameter and dequantised per
  expert tile inside the MoE kernel). Bound, w1/w3 (and their packed/scale halves) are one `[E, 2I, ·]` tensor.
  Loaded for CPU serving, dense experts are stored input-major (`gemv_input_major`, engine/model/fused.py
  `lay_out_for_gemv`; same shapes and values): decode then reads each chosen expert's rows in place
  (kernels/moe/grouped.py `moe_experts_bagged`) instead of copying its weights.
- Under tensor parallelism the router (fp32) is replicated; routed experts are split by their intermediate size
  (w1/w3 column-, w2 row-parallel), or with `enable_expert_parallel` by expert: rank r holds experts
  `[r*E/N, (r+1)*E/N)` at full width and the tokens routed elsewhere add nothing on this rank. Either way every rank
  holds a partial sum of the routed output, and the combine is an all-reduce (tokens are replicated across the TP
  ranks, so "dispatch" is each rank picking the assignments of its own experts).
- K3's latent MoE: `routed_expert_down_proj` and `routed_expert_norm` are replicated (the experts need the whole
  latent), the routed partial sums are all-reduced before the norm, and `routed_expert_up_proj` is row-parallel
  over the latent width, so its partial sum joins the shared experts' in the layer's final all-reduce.
- `forward(x)` returns the full (all-reduced) FFN output on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.common import GatedMLP, RMSNorm, _linear, gated_activation
from engine.model.config import ModelConfig
from engine.model.fused import ParamGroup
from engine.parallel.comm import SINGLE, RankContext
from engine.parallel.config import ParallelError
from kernels import get_kernel
from kernels.moe.grouped import BagLayout, bag_layout_of_fused, bags_fit, moe_experts_bags
from kernels.casting import fp32
from kernels.cpu import expert_gemm
from kernels.cpu.small_gemm import exact_bf16
from kernels.moe.mxfp4 import GROUP, MXFP4Weight
from kernels.moe.router import route

EXPERT_FORMATS = ("dense", "mxfp4")


def _uint8(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class StackedExperts(nn.Module):
    """Routed experts as stacked tensors (w1 gate, w3 up, w2 down), filled per expert by the loader.

    `first_expert` is the global id of local expert 0 (expert parallelism); `tp_dims` (checkpoint dims of one
    expert's tensors) is set when the experts are split by intermediate size instead."""

    def __init__(self, num_experts: int, width: int, intermediate: int, first_expert: int = 0,
                 split_intermediate: bool = False, experts_format: str = "dense"):
        super().__init__()
        if experts_format not in EXPERT_FORMATS:
            raise ValueError(f"experts_format {experts_format!r}: expected one of {EXPERT_FORMATS}")
        self.first_expert = first_expert
        self.packed = experts_format == "mxfp4"
        if self.packed:
            self._init_packed(num_experts, width, intermediate)
            names = ["w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale"]
        else:
            self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width))  # [E, I, D]
            self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width))  # [E, I, D]
            self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate))  # [E, D, I]
            self.gate_up = ParamGroup([(self, "w1"), (self, "w3")], dim=1)  # bound: halves of [E, 2I, D]
            names = ["w1", "w3", "w2"]
            self.gemv_input_major = ("w1", "w3", "w2")  # CPU serving lays these out input-major (fused.py)
            # exact bf16 copies of the bound gate/up tensor and w2 for the kernel (`attach_compact_weights`)
            self.compact_gate_up: torch.Tensor | None = None
            self.compact_w2: torch.Tensor | None = None
        if split_intermediate:
            self.tp_dims = {n: 1 if n.startswith("w2") else 0 for n in names}

    def _init_packed(self, num_experts: int, width: int, intermediate: int) -> None:
        if width % GROUP or intermediate % GROUP:
            raise ParallelError(f"MXFP4 experts need widths that are multiples of {GROUP}: expert width {width}, "
                                f"intermediate per rank {intermediate} (use --enable-expert-parallel to keep "
                                f"whole experts per rank)")
        self.w1_packed = _uint8(num_experts, intermediate, width // 2)  # [E, I, D/2]
        self.w1_scale = _uint8(num_experts, intermediate, width // GROUP)  # [E, I, D/32]
        self.w3_packed = _uint8(num_experts, intermediate, width // 2)
        self.w3_scale = _uint8(num_experts, intermediate, width // GROUP)
        self.w2_packed = _uint8(num_experts, width, intermediate // 2)  # [E, D, I/2]
        self.w2_scale = _uint8(num_experts, width, intermediate // GROUP)  # [E, D, I/32]
        self.gate_up_packed = ParamGroup([(self, "w1_packed"), (self, "w3_packed")], dim=1)
        self.gate_up_scale = ParamGroup([(self, "w1_scale"), (self, "w3_scale")], dim=1)

    @property
    def num_experts(self) -> int:
        return (self.w1_packed if self.packed else self.w1).shape[0]

    def run(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act) -> torch.Tensor:
        """z [T, Dm], weights/ids [T, k] (local ids; outside [0, E) add nothing) -> [T, Dm] partial sum."""
        if not self.packed:
            tables = self._compiled_bag_tables(z, ids)
            if tables is not None:
                return moe_experts_bags(z, tables, self.num_experts, weights, ids, act)
            return get_kernel("moe_experts", z.device)(z, self.w1, self.w3, self.w2, weights, ids, act)
        w1, w3 = MXFP4Weight(self.w1_packed, self.w1_scale), MXFP4Weight(self.w3_packed, self.w3_scale)
        w2 = MXFP4Weight(self.w2_packed, self.w2_scale)
        return get_kernel("moe_experts_mxfp4", z.device)(z, w1, w3, w2, weights, ids, act)


    def _compiled_bag_tables(self, z: torch.Tensor, ids: torch.Tensor) -> BagLayout | None:
        """Inside a step compiled for CPU with few assignments: the experts' rows as embedding-bag tables, from
        the bound gate/up tensor (kernels/moe/grouped.py: a compiled step cannot find them from w1 and w3)."""
        if not torch.compiler.is_compiling() or z.device.type != "cpu" or not bags_fit(ids, self.num_experts, z):
            return None
        gate_up = self.gate_up.tensor()  # [E, 2I, D] while w1 and w3 are its halves
        if gate_up is None:
            return None
        if self.compact_gate_up is not None and expert_gemm.runs(z, self.compact_gate_up.transpose(1, 2)):
            return bag_layout_of_fused(self.compact_gate_up, self.compact_w2)  # the kernel reads half the bytes
        return bag_layout_of_fused(gate_up, self.w2)

    def attach_compact(self) -> int:
        """Exact bf16 copies of the bound gate/up tensor and w2 where both are bf16 values (see
        `engine.model.fused.attach_compact_weights`); returns the bytes added."""
        gate_up = None if self.packed else self.gate_up.tensor()
        pair = (None, None) if gate_up is None else (exact_bf16(gate_up), exact_bf16(self.w2))
        self.compact_gate_up, self.compact_w2 = pair if None not in pair else (None, None)
        return 0 if self.compact_gate_up is None else 2 * (gate_up.numel() + self.w2.numel())


class MoEGate(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class SparseMoE(nn.Module):
    """Sigmoid-routed MoE with shared experts; K3's latent form runs the routed experts at a narrower width."""

    def __init__(self, config: ModelConfig, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        moe = config.moe
        self.moe, self.ctx = moe, ctx
        width = moe.latent_size or config.hidden_size
        self.gate = MoEGate(moe.num_experts, config.hidden_size)
        if ctx.expert_parallel:
            first, stop = ctx.shard_range(moe.num_experts, "routed experts (num_experts)")
            self.experts = StackedExperts(stop - first, width, moe.intermediate_size, first_expert=first,
                                          experts_format=experts_format)
        else:
            inter = ctx.split(moe.intermediate_size, "routed expert intermediate size (moe_intermediate_size)")
            self.experts = StackedExperts(moe.num_experts, width, inter, split_intermediate=ctx.size > 1,
                                          experts_format=experts_format)
        self.act = gated_activation(config)
        self.shared_experts = (GatedMLP(config.hidden_size, moe.intermediate_size * moe.num_shared_experts, self.act,
                                        ctx, "shared expert intermediate size (moe_intermediate_size x "
                                             "num_shared_experts)")
                               if moe.num_shared_experts else None)
        if moe.latent_size:
            self.latent_start, latent_stop = ctx.shard_range(width, "routed_expert_hidden_size")
            self.routed_expert_down_proj = _linear(config.hidden_size, width)
            self.routed_expert_up_proj = _linear(latent_stop - self.latent_start, config.hidden_size, shard_dim=1)
            self.routed_expert_norm = RMSNorm(width, config.rms_norm_eps) if moe.latent_use_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D]
        moe = self.moe
        logits = F.linear(fp32(x), fp32(self.gate.weight))  # [T, E]
        weights, ids = route(logits, fp32(self.gate.e_score_correction_bias), moe.top_k, moe.num_expert_group,
                             moe.topk_group, moe.renormalize, moe.routed_scaling_factor)
        if self.experts.first_expert:
            ids = ids - self.experts.first_expert  # global -> local ids; other ranks' experts fall outside [0, E)
        z = self.routed_expert_down_proj(x) if moe.latent_size else x  # [T, Dm]
        y = self.experts.run(z, weights, ids, self.act)  # [T, Dm], partial under TP/EP
        if moe.latent_size:
            y = self.ctx.all_reduce(y)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            if self.ctx.size > 1:
                y = y[:, self.latent_start : self.latent_start + self.routed_expert_up_proj.in_features]
            y = self.routed_expert_up_proj(y)  # [T, D], partial under TP
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.ctx.all_reduce(y)
