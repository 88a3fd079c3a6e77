"""`CompilationConfig`: the `--compilation-config` JSON (vLLM's field names) for the decode step's graphs.

Contract:
- `CompilationConfig.parse(value)` takes a JSON object string, a dict or a `CompilationConfig` (None -> the
  defaults) and returns the frozen, validated config; any other field, a wrong type or value raises
  `EngineConfigError` naming the field. Fields:
  - `level` (vLLM's `level`, also accepted as `mode`): 0 runs the decode step eagerly; 1..3 compile it with
    `torch.compile` (`backend`, default `inductor`). None (the default) means "where it pays": compiled on CUDA;
    on CPU eager (the eager CPU step is sync-free and cheaper than inductor's compile time for the models a CPU
    serves; `"level": 3` compiles it on CPU too — docs/benchmarks.md has both).
  - `cudagraph_mode` (`NONE` | `FULL_DECODE_ONLY` | `FULL`; default `FULL_DECODE_ONLY`): on CUDA, decode-only
    batches replay a CUDA graph captured per batch-size bucket; `FULL` is accepted as vLLM's name for the same here
    (prefill and mixed batches always run eagerly). On CPU there are no CUDA graphs: a value other than `NONE` is
    accepted and has nothing to capture (the bucketed buffers still serve the compiled step).
  - `cudagraph_capture_sizes` (list of positive ints): the decode batch-size buckets (CPU: one compiled graph
    each; CUDA: one captured graph each). Default: 1, 2, 4, 8, then multiples of 8 up to
    `max_cudagraph_capture_size`.
  - `max_cudagraph_capture_size` (default 512, capped by the engine's `max_num_seqs`): the largest bucket; larger
    decode batches run eagerly.
  - `backend` (`inductor` | `aot_eager` | `eager`): `torch.compile`'s backend when `level` >= 1.
  - `inductor_compile_config` (vLLM's name; a JSON object of `torch._inductor.config` options, default `{}`):
    passed to `torch.compile(options=...)` over the defaults `inductor_options` gives — on CPU `cpp_wrapper: true`
    (the generated step calls its kernels from C++, not from a Python wrapper: demo-k3's step 6.0 -> 4.4 CPU ms),
    `freezing: true` (the weights are the graph's constants instead of inputs to every call — set while Dynamo
    traces as well, `compiled_with_options`, or it freezes nothing: demo-k3's batch-1 step 1.51 -> 1.40 ms; a weight
    changed after the build is not seen — kdamesh changes no weights at run time) and `cpp.weight_prepack: false`.
    Keys are checked against torch's inductor config when the graphs are built (`DecodeGraphs`): an unknown key
    raises `EngineConfigError` naming it.
- `EngineArgs.enforce_eager` overrides all of it: no compilation, no capture (a test can tell by
  `ModelRunner.graphs is None`).
Torch-free (command lines import it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineConfigError
from engine.json_config import json_fields

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")
BACKENDS = ("inductor", "aot_eager", "eager")
DEFAULT_MAX_CAPTURE = 512
# the CPU step: kernels called from a C++ wrapper; weights frozen into the graph as constants (not ~300 inputs a
# call), without inductor's weight prepacking (one-row products stay MKL's GEMV on the input-major weights)
CPU_INDUCTOR_DEFAULTS = {"cpp_wrapper": True, "freezing": True, "cpp.weight_prepack": False}


@dataclass(frozen=True)
class CompilationConfig:
    level: int | None = None
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int = DEFAULT_MAX_CAPTURE
    backend: str = "inductor"
    inductor_compile_config: dict | None = None

    @classmethod
    def parse(cls, value: "str | dict | CompilationConfig | None") -> "CompilationConfig":
        if isinstance(value, CompilationConfig):
            return value
        if value is None:
            return cls()
        value = json_fields(value, "compilation_config", cls, aliases=("mode",))
        if "mode" in value:  # vLLM's newer name for `level`
            if "level" in value and value["level"] != value["mode"]:
                raise EngineConfigError("compilation_config: `mode` and `level` disagree")
            value["level"] = value.pop("mode")
        if isinstance(value.get("cudagraph_capture_sizes"), list):
            value["cudagraph_capture_sizes"] = tuple(value["cudagraph_capture_sizes"])
        return cls(**value)

    def __post_init__(self):
        if self.level is not None and (not _is_int(self.level) or not 0 <= self.level <= 3):
            raise EngineConfigError(f"compilation_config.level must be an integer in 0..3, got {self.level!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise EngineConfigError(f"compilation_config.cudagraph_mode must be one of {CUDAGRAPH_MODES}, "
                                    f"got {self.cudagraph_mode!r}")
        if self.backend not in BACKENDS:
            raise EngineConfigError(f"compilation_config.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not _is_int(self.max_cudagraph_capture_size) or self.max_cudagraph_capture_size < 1:
            raise EngineConfigError(f"compilation_config.max_cudagraph_capture_size must be a positive integer, "
                                    f"got {self.max_cudagraph_capture_size!r}")
        if self.inductor_compile_config is not None and not (
                isinstance(self.inductor_compile_config, dict)
                and all(isinstance(k, str) for k in self.inductor_compile_config)):
            raise EngineConfigError(f"compilation_config.inductor_compile_config must be a JSON object of inductor "
                                    f"options, got {self.inductor_compile_config!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not isinstance(sizes, tuple) or not sizes
                                  or not all(_is_int(s) and s >= 1 for s in sizes)):
            raise EngineConfigError(f"compilation_config.cudagraph_capture_sizes must be a non-empty list of "
                                    f"positive integers, got {sizes!r}")

    def compiles(self, device_type: str) -> bool:
        """Whether the decode step is compiled with `torch.compile` on this device type."""
        if self.level is None:
            return device_type == "cuda"
        return self.level >= 1

    def captures(self, device_type: str) -> bool:
        """Whether decode steps replay captured CUDA graphs on this device type."""
        return device_type == "cuda" and self.cudagraph_mode != "NONE"

    def inductor_options(self, device_type: str) -> dict:
        """`torch.compile`'s inductor options on this device type: the defaults, then `inductor_compile_config`."""
        defaults = dict(CPU_INDUCTOR_DEFAULTS) if device_type == "cpu" else {}
        return {**defaults, **(self.inductor_compile_config or {})}

    def bucket_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The decode batch-size buckets, ascending, none above `max_num_seqs`."""
        top = min(self.max_cudagraph_capture_size, max_num_seqs)
        sizes = self.cudagraph_capture_sizes or (1, 2, 4, *range(8, top + 1, 8), top)
        kept = sorted({s for s in sizes if s <= top})
        return tuple(kept) if kept else (top,)


def checked_inductor_options(config: CompilationConfig, device_type: str) -> dict:
    """`config.inductor_options(device_type)`, each key checked against torch's inductor config: an unknown one
    raises `EngineConfigError` naming it (imports torch: called when graphs are built, not by command lines)."""
    import torch._inductor.config

    options = config.inductor_options(device_type)
    known = torch._inductor.config.get_config_copy()
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise EngineConfigError(f"compilation_config.inductor_compile_config: unknown inductor option {unknown[0]!r}")
    return options


def compiled_with_options(fn, backend: str, options: dict | None, **compile_kwargs):
    """`torch.compile(fn, backend=..., options=options, ...)` whose calls run with inductor's `freezing` option
    set while Dynamo traces too: Dynamo decides at trace time whether a module's parameters become graph attributes,
    which inductor can freeze into constants, from the global `torch._inductor.config.freezing`, and
    `options` reach only inductor's own compile — so `freezing: true` alone froze nothing, and every weight stayed an
    input of every call (demo-k3's step: 189 tensors handed over per call; frozen, its batch-1 step 1.51 -> 1.40 ms,
    wave 3 session 15). (Imports torch: called when graphs are built.)"""
    import torch
    import torch._inductor.config

    compiled = torch.compile(fn, backend=backend, options=options, **compile_kwargs)
    freezing = bool((options or {}).get("freezing", False))

    def call(*args, **kwargs):
        with torch._inductor.config.patch(freezing=freezing):
            return compiled(*args, **kwargs)

    return call


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
