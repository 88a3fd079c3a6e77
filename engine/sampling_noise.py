"""Counter-based random numbers for sampling and acceptance (engine/sampling.py, engine/spec/accept.py).

Contract: a row's random number is a hash of (its request's seed, its output position, a stream id) computed with
int64 tensor ops on the device — no generator state, so a seeded request draws the same numbers whatever else is
in the batch, in any order, on any engine (a handoff carries only the seed). `row_keys` makes the 32-bit keys,
`spread_keys` several independent keys per row, `row_uniforms` a float64 uniform in (0, 1) of 52-bit resolution per
key, `categorical` an inverse-CDF draw from non-negative weights per row.
"""

from __future__ import annotations

import torch

STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2, 3  # independent random streams per (seed, position)
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): split so that no product leaves int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mix(h: torch.Tensor, value) -> torch.Tensor:
    return _fmix32(((h ^ value) + _GOLDEN) & _MASK32)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """seeds [...] int64 (>= 0), positions [...] int64 -> 32-bit keys [...] (int64) of (seed, position, stream)."""
    h = _mix(torch.full_like(seeds, stream), seeds & _MASK32)
    h = _mix(h, (seeds >> 32) & _MASK32)
    return _mix(h, positions & _MASK32)


def spread_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """keys [R] -> [R, width] keys of (key, j): several independent numbers for one (seed, position, stream)."""
    return _mix(keys[:, None], torch.arange(width, dtype=torch.long, device=keys.device)[None, :])


def row_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """keys [...] -> float64 uniforms in (0, 1) [...] of 52-bit resolution (two hashes of the key)."""
    high = _mix(keys, 0x5851F42D)  # 32 bits
    low = _mix(keys, 0x14057B7E) >> 12  # 20 bits
    return (((high << 20) | low).double() + 0.5) * 2.0 ** -52


def categorical(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A categorical draw per row from non-negative weights [R, V] (need not sum to 1; each row has some mass):
    the inverse CDF at the row's uniform -> ids [R]. Always an id of positive weight."""
    cdf = weights.double().cumsum(dim=-1)  # [R, V]
    target = row_uniforms(keys) * cdf[:, -1]  # [R], strictly below the row's total
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=weights.shape[-1] - 1)
