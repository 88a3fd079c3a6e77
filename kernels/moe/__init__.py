"""kernels/moe: router (`router.py`), gated activations (`activation.py`) and routed experts (`naive.py` oracle,
`grouped.py` fast torch path). Pick the experts implementation with `kernels.registry.get_kernel("moe_experts")`.
"""

from kernels.moe.activation import GatedActivation
from kernels.moe.router import route

__all__ = ["GatedActivation", "route"]
