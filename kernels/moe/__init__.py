"""kernels/moe: router (`router.py`), gated activations (`activation.py`) and routed experts: `naive.py` (oracle),
`grouped.py` (fast torch path), `mxfp4.py` (packed MXFP4 weights decoded per expert tile, torch) and
`triton_fused.py` (grouped GEMMs for dense or MXFP4 weights, no host sync). Pick an implementation with
`kernels.registry.get_kernel("moe_experts")` / `get_kernel("moe_experts_mxfp4")`.
"""

from kernels.moe.activation import GatedActivation
from kernels.moe.router import route

__all__ = ["GatedActivation", "route"]
