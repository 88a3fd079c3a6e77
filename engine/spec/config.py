"""`SpeculativeConfig`: the `--speculative-config` JSON (vLLM's field names) and the drafter registry.

Contract:
- `SpeculativeConfig.parse(value)` takes a JSON object string, a dict or a `SpeculativeConfig` (None stays None)
  and returns the frozen, validated config. Fields (vLLM's names and defaults): `method` (`ngram` | `mtp` |
  `dspark`, required), `num_speculative_tokens` (k >= 1, required; for `dspark` vLLM's default, the drafter's
  trained `block_size` read from `model`'s config.json), `model` (the drafter checkpoint folder: required
  by `dspark`; `mtp` reads the target's own MTP layers, `ngram` needs none), `prompt_lookup_min` /
  `prompt_lookup_max` (n-gram lengths; vLLM's defaulting: both unset -> 5 and 5, one set -> the other equals it;
  min <= max), `draft_sample_method` (`greedy` | `probabilistic`), `rejection_sample_method` (`standard` |
  `block`), `num_speculative_tokens_per_batch_size` (vLLM's dynamic speculative decoding: a list of
  `[range_start, range_end, k]`, inclusive batch-size ranges, sorted, non-overlapping, the first starting at 1,
  k >= 0; `tokens_for_batch(n)` is the k of a batch of n running requests: its range's, a gap or the tail after
  the last range carries the previous range's k, capped at `num_speculative_tokens`; 0 decodes plain). Any other
  field, a wrong type or value raises `EngineConfigError` naming the field.
- `DRAFTER_FACTORIES` maps a method to `"module:function"` of its factory (imported lazily), None while the method
  is not built in this tree: such a method is refused at parse time with a message naming it. A factory is
  `build(config: SpeculativeConfig, target: engine.spec.drafter.DraftTarget) -> Drafter`.
Torch-free: `engine.config` and the command lines import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from engine.errors import EngineConfigError
from engine.json_config import json_fields

METHODS = ("ngram", "mtp", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM: both prompt_lookup_min and _max unset

# method -> "module:function" of its drafter factory; None: not built here (refused)
DRAFTER_FACTORIES: dict[str, str | None] = {
    "ngram": "engine.spec.ngram:build",
    "mtp": "engine.spec.mtp:build",  # Kimi K3's MTP layers
    "dspark": "engine.spec.dspark:build",  # a k3_dspark drafter checkpoint
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_fields(value, "speculative_config", cls)
        if value.get("method") == "dspark" and "num_speculative_tokens" not in value and value.get("model"):
            value["num_speculative_tokens"] = _trained_block_size(value["model"])
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise EngineConfigError(f"speculative_config: {name!r} is required")
        schedule = value.get("num_speculative_tokens_per_batch_size")
        if isinstance(schedule, list):
            value["num_speculative_tokens_per_batch_size"] = tuple(
                tuple(e) if isinstance(e, list) else e for e in schedule)
        return cls(**value)

    def __post_init__(self):
        _check_choice("method", self.method, METHODS)
        if DRAFTER_FACTORIES.get(self.method) is None:
            raise EngineConfigError(f"speculative_config: method {self.method!r} is not built in this kdamesh "
                                    f"(available: {[m for m, f in DRAFTER_FACTORIES.items() if f]})")
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise EngineConfigError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise EngineConfigError(f"speculative_config: model must be a checkpoint path, got {self.model!r}")
        if self.method == "dspark" and self.model is None:
            raise EngineConfigError("speculative_config: model (the k3_dspark drafter checkpoint) is required "
                                    "for method 'dspark'")
        if self.method == "ngram" and self.model is not None:
            raise EngineConfigError("speculative_config: model is not used by method 'ngram' (prompt lookup)")
        _check_choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _check_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                           _checked_schedule(self.num_speculative_tokens_per_batch_size))
        self._resolve_lookup()

    def tokens_for_batch(self, batch_size: int) -> int:
        """The drafts a request may verify in a step of `batch_size` running requests (vLLM's dense lookup)."""
        k = self.num_speculative_tokens
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return k
        chosen = next((n for start, _, n in reversed(schedule) if start <= batch_size), schedule[0][2])
        return min(k, chosen)

    def _resolve_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise EngineConfigError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.method != "ngram":
            if lo is not None or hi is not None:
                name = "prompt_lookup_min" if lo is not None else "prompt_lookup_max"
                raise EngineConfigError(f"speculative_config: {name} applies to method 'ngram' only")
            return
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise EngineConfigError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)
                           if getattr(self, f.name) != f.default or f.name in ("method", "num_speculative_tokens")})


def _trained_block_size(folder: str) -> int:
    """vLLM's default k for DSpark: the drafter's trained `block_size` (or `dspark_block_size`) from its config."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineConfigError(f"speculative_config: num_speculative_tokens is not given and the DSpark drafter's "
                                f"block_size cannot be read from {path}: {exc}") from None
    size = raw.get("block_size") or raw.get("dspark_block_size")
    if not _is_int(size) or size < 1:
        raise EngineConfigError(f"speculative_config: num_speculative_tokens is not given and {path} has no "
                                f"block_size to default it to")
    return size


def factory_path(method: str) -> str:
    """"module:function" of the method's drafter factory (the method was checked by `SpeculativeConfig`)."""
    path = DRAFTER_FACTORIES.get(method)
    if path is None:
        raise EngineConfigError(f"speculative method {method!r} is not built in this kdamesh")
    return path


def _checked_schedule(schedule) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's rules for `num_speculative_tokens_per_batch_size` (vllm/v1/spec_decode/dynamic/utils.py) -> the
    entries sorted by range start."""
    if schedule is None:
        return None
    name = "speculative_config: num_speculative_tokens_per_batch_size"
    if not isinstance(schedule, tuple) or not schedule:
        raise EngineConfigError(f"{name} must be a non-empty list of [range_start, range_end, "
                                f"num_speculative_tokens] entries, got {schedule!r}")
    previous_end = 0
    for entry in schedule:
        if not isinstance(entry, tuple) or len(entry) != 3 or not all(_is_int(v) for v in entry):
            raise EngineConfigError(f"{name}: each entry is [range_start, range_end, num_speculative_tokens] "
                                    f"(integers), got {list(entry) if isinstance(entry, tuple) else entry!r}")
        start, end, k = entry
        if start <= 0 or end < start or k < 0:
            raise EngineConfigError(f"{name}: entry {list(entry)} needs 1 <= range_start <= range_end and "
                                    "num_speculative_tokens >= 0")
    schedule = tuple(sorted(schedule))
    for start, end, k in schedule:
        if start <= previous_end:
            raise EngineConfigError(f"{name}: ranges must not overlap ({[start, end, k]})")
        previous_end = end
    if schedule[0][0] != 1:
        raise EngineConfigError(f"{name}: the first range must start at 1 (every batch size needs a k)")
    return schedule


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EngineConfigError(f"speculative_config: {name} must be one of {list(choices)}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
