"""Byte sizes as people write them: the one parser every layer uses (engine flags, the cache service's flags, the
benchmarks). It lives here because telemetry is the one package every layer may import; it imports only `re`.

The rule: a number (`4096`, `1.5`, `.5`), optional spaces, an optional unit, case-insensitive:
- `B` or nothing: bytes;
- `KB`, `MB`, `GB`, `TB`: powers of 1000 (SI);
- `KiB`, `MiB`, `GiB`, `TiB` and the bare `K`, `M`, `G`, `T`: powers of 1024 (as `free -g`, `ls -h` and vLLM's
  memory flags read them).
Fractions are rounded down to whole bytes. An int (not a bool) is taken as bytes as it is.
"""

from __future__ import annotations

import argparse
import re

_SCALES = {"": 1, "b": 1,
           "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
           "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
           "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | str) -> int:
    """`4096`, `"4096"`, `"512MiB"`, `"512M"`, `"2GB"`, `"1.5 KiB"` -> bytes. Raises ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a byte size")
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(str(value))
    if not match or match[2].lower() not in _SCALES:
        raise ValueError(f"{value!r} is not a byte size (e.g. 4096, 512MiB, 2GB)")
    return int(float(match[1]) * _SCALES[match[2].lower()])


def byte_size(text: str) -> int:
    """`parse_bytes` as an argparse `type=` (a bad value is a usage error naming the flag)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
