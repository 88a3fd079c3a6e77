"""What the engine reports about itself (`EngineStats`, published after every step) and the identity of the
weights it serves (`model_fingerprint`, part of every cache key)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.phase_times import PhaseSnapshot


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's queues and the pools' usage at one moment (counters cumulative)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks owned by requests
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_state_groups: int  # KDA running-state slot groups (one per running request)
    num_free_state_groups: int
    num_snapshots: int
    num_snapshot_slots: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    phase_times: PhaseSnapshot | None = None  # cumulative queue / prefill / decode histograms (engine.phase_times)
    snapshot_bytes: int = 0  # bytes of the snapshots held now (<= snapshot_budget_bytes)
    snapshot_budget_bytes: int = 0
    num_junctions: int = 0  # snapshot points planned where prompts branch
    num_snapshot_exports: int = 0  # snapshots handed to the outbox (evicted, turn ends)
    num_snapshot_evictions: int = 0
    num_snapshots_taken: int = 0  # state copies into snapshot slots (each costs one state's bytes of copying)

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache (0 before any)."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0


def model_fingerprint(model_dir: str | Path, dtype: torch.dtype, load_format: str, seed: int) -> bytes:
    """Names the weights and numerics: config.json, weight file headers and the first MiB of each file, dtype."""
    folder = Path(model_dir)
    h = hashlib.sha256(b"kdamesh-model-v1")
    h.update(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    h.update(str(dtype).encode())
    if load_format == "dummy":
        h.update(f"dummy:{seed}".encode())
    else:
        for path in sorted(folder.glob("*.safetensors")):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 20))
    return h.digest()
