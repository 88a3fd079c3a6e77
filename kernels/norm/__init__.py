"""kernels/norm: RMSNorm variants and L2 normalisation (see `rms_norm.py` for the numeric contract)."""

from kernels.norm.rms_norm import gated_rms_norm, l2_normalize, rms_norm, rms_norm_no_weight

__all__ = ["rms_norm", "rms_norm_no_weight", "gated_rms_norm", "l2_normalize"]
