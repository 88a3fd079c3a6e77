"""JSON Schema checks and rewrites for structured output (no grammar objects here).

Contract:
- `check_schema(schema, what, param)` -> a deep copy of `schema` after checking that it is JSON, a valid JSON
  Schema (with `jsonschema`, when installed) and compilable by xgrammar; `InvalidRequestError(param=param)`
  otherwise.
- `json_safe_schema(schema)`: a copy where every string with `minLength`/`maxLength` (and no `pattern`/`format`)
  gets an equivalent `pattern` that also excludes control characters, quotes, backslashes and UTF-16 surrogates,
  which xgrammar 0.2.9 would otherwise allow there (invalid JSON; surrogates decode to three U+FFFD and break the
  length).
- `argument_plan(schema)`: how K3 writes a tool's arguments — one `argument` block per property (declared order;
  required ones always, optional ones may be left out; strings raw, other types JSON) when every property has one
  JSON type (or a list of types) and its strings need no JSON-only keywords: `[(key, [(xtml type, value schema),
  …], required)]`; otherwise (anyOf, $ref, minLength, pattern, …) None: the call holds one JSON block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError

_JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_XTML_TYPE = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}
# keywords a string property may carry and still be written raw in a K3 argument block
_RAW_STRING_KEYS = {"type", "description", "title", "enum", "const", "default", "examples", "deprecated",
                    "readOnly", "writeOnly", "$comment"}
# keywords of an arguments object that the per-argument (tag) encoding represents exactly
_TAG_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                    "$comment", "default", "examples", "strict"}


def check_schema(schema: Any, what: str, param: str) -> dict:
    """A deep copy of `schema` after checking it is a JSON Schema object that xgrammar can compile."""
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{what} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    try:
        schema = json.loads(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} is not JSON: {exc}", param=param) from None
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # optional: xgrammar's converter below catches most invalid schemas too
        pass
    else:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise InvalidRequestError(f"{what} is not a valid JSON Schema: {exc.message}", param=param) from None
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json_safe_schema(schema))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the converter's message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(f"{what} is not supported: {message}", param=param) from None
    return schema


def json_safe_schema(schema: Any) -> Any:
    """A copy where every length-bounded string without pattern/format gets an equivalent pattern that keeps out
    control characters, UTF-16 surrogates, quotes and backslashes (xgrammar's length-bounded strings would let raw
    control characters and surrogates through: not JSON, and a surrogate decodes to three characters)."""
    if isinstance(schema, list):
        return [json_safe_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: json_safe_schema(value) for key, value in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and types == ["string"])
    if is_string and ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out:
        low = out.get("minLength", 0)
        high = out.get("maxLength")
        if isinstance(low, int) and (high is None or isinstance(high, int)):
            out["pattern"] = "^[^\\x00-\\x1f\"\\\\\\ud800-\\udfff]{%d,%s}$" % (low, "" if high is None else high)
            out.pop("minLength", None)
            out.pop("maxLength", None)
    return out




def argument_plan(schema: Mapping | None) -> list[tuple[str, list[tuple[str, dict]], bool]] | None:
    """[(key, [(xtml type, value schema), …], required)] for the per-argument encoding, or None when the schema
    needs the JSON block."""
    if schema is None or not isinstance(schema, Mapping) or not set(schema) <= _TAG_OBJECT_KEYS:
        return None
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), Mapping):
        return None
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
        return None
    plan = []
    for key, sub in properties.items():
        branches = _value_branches(sub)
        if branches is None or not key:
            return None
        plan.append((key, branches, key in required))
    return plan


def _value_branches(schema: Any) -> list[tuple[str, dict]] | None:
    """[(xtml type, schema of the value for that type)], or None when a value has no single-type encoding."""
    if not isinstance(schema, Mapping) or any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "$ref", "if")):
        return None
    schema = dict(schema)
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if values is not None:
        kinds = {_json_type_of(v) for v in values}
        if len(kinds) != 1 or None in kinds:
            return None
        (kind,) = kinds
        types = [kind]
    else:
        declared = schema.get("type")
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list) or not types or not all(t in _JSON_TYPES for t in types):
            return None
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
    branches = []
    for t in types:
        sub = dict(schema, type=t) if values is None else schema
        if t == "string" and not set(sub) <= _RAW_STRING_KEYS:
            return None  # minLength, pattern, format, …: only JSON strings express them exactly
        branches.append((_XTML_TYPE[t], sub))
    if len({x for x, _ in branches}) != len(branches):
        return None
    return branches


def _json_type_of(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number" if math.isfinite(value) else None
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else None

