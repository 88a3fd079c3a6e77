"""The flags of the local mesh: `kdamesh up` and `kdamesh serve MODEL` (a drop-in for `vllm serve`).

Contract:
- `add_mesh_flags(parser, model_positional)` generates every flag `up` / `serve MODEL` take from `LaunchConfig`
  (deploy/mesh_plan.py) and the option objects it holds: the engine's (`EngineArgs`, both workers), the workers'
  (`PrefillServiceConfig`, `DecodeServiceConfig`), the cache service's and the gateway's (`GatewayConfig`), minus
  what the mesh plan assigns (addresses, ports), plus `VllmCompat`. `launch_config_from(ns)` builds the
  `LaunchConfig` from them (a value an option object refuses raises its ValueError, naming it).
- `VllmCompat` holds the `vllm serve` flags accepted at their no-op value only: `refusal(ns)` is the message naming
  the first such flag set to something else (`--kv-cache-dtype` other than auto, `--gpu-memory-utilization` at all:
  the KV cache is sized by `--kv-cache-memory`), a `--tensor-parallel-size` < 1 or a `--speculative-config` that
  does not parse (engine/spec/config.py: the message names the JSON field), else None. A refused flag is never
  silently accepted. The worker roles (deploy/serve.py) take the same flags.
- `--speculative-config '{json}'` (vLLM's field names) goes to both workers: every request of a worker speculates
  (docs/api.md says which run plain).
- `--trust-remote-code` is accepted and has no effect: the model code is part of kdamesh, nothing is downloaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from telemetry.options import add_options, option

PARSER_CHOICES = "'auto' (the model family's format), 'none', kimi_k3 or kimi_k2"


@dataclass(frozen=True)
class VllmCompat:
    """`vllm serve` flags accepted at their no-op value only (`refusal`)."""

    kv_cache_dtype: str = option("--kv-cache-dtype", default="auto",
                                 help="auto only (the KV cache has the model's dtype)")
    gpu_memory_utilization: float | None = option("--gpu-memory-utilization", default=None, parse=float,
                                                  help="refused: size the KV cache with --kv-cache-memory")
    trust_remote_code: bool = option("--trust-remote-code", default=False, kind="switch",
                                     help="accepted, no effect (the model code is built in)")


def refusal(ns: argparse.Namespace) -> str | None:
    """The message naming the first flag that asks for a feature not built yet (see the module docstring)."""
    if ns.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {ns.tensor_parallel_size}: must be at least 1"
    if ns.speculative_config is not None:
        from engine.errors import EngineConfigError
        from engine.spec.config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(ns.speculative_config)
        except EngineConfigError as e:
            return f"--speculative-config: {e}"
    if ns.kv_cache_dtype != "auto":
        return f"--kv-cache-dtype {ns.kv_cache_dtype}: only auto (the model's dtype) is built"
    if ns.gpu_memory_utilization is not None:
        return "--gpu-memory-utilization: not built; size the KV cache of each worker with --kv-cache-memory"
    return None


def add_mesh_flags(p: argparse.ArgumentParser, model_positional: bool) -> None:
    from deploy.mesh_plan import LaunchConfig

    if model_positional:
        p.add_argument("model", help="checkpoint folder (config.json, *.safetensors, tokenizer) or demo-k3")
    add_options(p, LaunchConfig, skip=("model",) if model_positional else ())


def launch_config_from(ns: argparse.Namespace, log_level: str, log_format: str, trace_exporter: str):
    """The launcher's config from `add_mesh_flags` flags and the global logging flags."""
    from deploy.mesh_plan import LaunchConfig
    from telemetry.options import from_namespace

    return from_namespace(LaunchConfig, ns, base=LaunchConfig(), model=ns.model, log_level=log_level.upper(),
                          log_format=log_format, trace_exporter=trace_exporter)
