"""`json_fields(value, name, cls)`: a JSON-object option (`--speculative-config`, `--compilation-config`) as a dict
of `cls`'s fields.

Contract: `value` is a JSON object string or a dict; the result is a new dict. Invalid JSON, a non-object, or a key
that is not a field of the dataclass `cls` raises `EngineConfigError` naming the option `name` (and the field).
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import fields

from engine.errors import EngineConfigError


def json_fields(value: str | dict, name: str, cls: type, aliases: tuple[str, ...] = ()) -> dict:
    """`aliases`: more accepted keys (the caller maps them to fields)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise EngineConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise EngineConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known - set(aliases))
    if unknown:
        raise EngineConfigError(f"{name}: unknown field {unknown[0]!r} (supported: {sorted(known | set(aliases))})")
    return dict(value)
