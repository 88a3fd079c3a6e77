"""Pure tensor ops for Kimi Delta Attention, MLA, MoE, short convolutions and norms.

Contract: plain tensors (and index tensors such as `cu_seqlens`, `state_indices`, `block_tables`) in, plain tensors
out; nothing here imports from `engine/` or any service. Every op has a readable `naive.py` oracle and a torch
implementation; faster backends are picked by `kernels.registry.get_kernel`.
"""

from kernels.registry import chosen_backend, get_kernel, prepare_compiled_ops

__all__ = ["get_kernel", "chosen_backend", "prepare_compiled_ops"]
