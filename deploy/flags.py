"""The flags of the local mesh: `kdamesh up` and `kdamesh serve MODEL` (a drop-in for `vllm serve`).

Contract:
- `add_mesh_flags(parser, model_positional)` (deploy/mesh_plan.py, beside `LaunchConfig`) generates every flag
  `up` / `serve MODEL` take from `LaunchConfig` and the option objects it holds: the engine's (`EngineArgs`, both
  workers), the workers' (`PrefillServiceConfig`, `DecodeServiceConfig`), the cache service's and the gateway's
  (`GatewayConfig`), minus what the mesh plan assigns (addresses, ports), plus this module's `VllmCompat`.
  `launch_config_from(ns)` (there too) builds the `LaunchConfig` from them (a value an option object refuses raises
  its ValueError, naming it).
- `VllmCompat` holds the `vllm serve` flags accepted at their no-op value only: `refusal(ns)` is the message naming
  the first such flag set to something else, a `--tensor-parallel-size` < 1 or a `--speculative-config` that does
  not parse (engine/spec/config.py: the message names the JSON field), else None. A refused flag is never silently
  accepted. The worker roles (deploy/serve.py) take the same flags.
- `--gpu-memory-utilization` is an engine option (`EngineArgs`, vLLM's meaning: the pools get what a profile run
  leaves of that fraction of the device's memory, engine/memory_profile.py), not a compatibility no-op.
- `--speculative-config '{json}'` (vLLM's field names) goes to both workers: every request of a worker speculates
  (docs/api.md says which run plain).
- `--trust-remote-code` is accepted and has no effect: the model code is part of kdamesh, nothing is downloaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from telemetry.options import option

PARSER_CHOICES = "'auto' (the model family's format), 'none', kimi_k3 or kimi_k2"


@dataclass(frozen=True)
class VllmCompat:
    """`vllm serve` flags accepted at their no-op value only (`refusal`)."""

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
    return None
