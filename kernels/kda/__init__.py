"""Kimi Delta Attention (KDA) kernels: the gated delta rule over packed variable-length batches.

Per sequence and head, with state S [K, V] (fp32; fp64 for fp64 inputs) and for each token t:

    S <- S * exp(g_t)[:, None];  S <- S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)

q and k arrive L2-normalised; g (per-channel log-decay <= 0, from `gate`) and beta arrive precomputed.
Layouts: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; `cu_seqlens` [N+1] int64 (None: one sequence).

Modules:
- `naive`: `kda_naive`, the token-by-token oracle.
- `chunked`: `chunk_kda` (chunkwise WY form, the fast torch path) and `kda_prefill_pooled` (registry op `kda_prefill`).
- `recurrent`: `fused_recurrent_kda` (time loop, for short inputs) and `kda_decode_pooled` (registry op `kda_decode`).
- `cpu_step`: the decode step on our CPU kernel (kernels/cpu/kda_step.c), in place on the pool; `recurrent` takes it
  wherever it `runs` (fp32 on a CPU where the kernel built).
- `gate`: `kda_gate_softplus` (Kimi Linear) and `kda_gate_lower_bound` (Kimi K3).
- `triton_chunked`, `triton_recurrent`: Triton versions of the two pooled ops (imported lazily by the registry only).

Functional forms take `initial_state` [N, H, K, V] or None and return (o, final_state); pooled forms read and write
`state_pool[state_indices[n]]` in place and return o.
"""

from kernels.kda.chunked import chunk_kda, kda_prefill_pooled
from kernels.kda.gate import kda_gate_lower_bound, kda_gate_softplus
from kernels.kda.naive import kda_naive
from kernels.kda.recurrent import fused_recurrent_kda, kda_decode_pooled

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "kda_decode_pooled",
    "kda_gate_lower_bound",
    "kda_gate_softplus",
    "kda_naive",
    "kda_prefill_pooled",
]
