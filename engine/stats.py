"""What the engine reports about itself (`EngineStats`, published after every step) and the identity of the
weights it serves (`model_fingerprint`, part of every cache key)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.fair_share import TenantLoad
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
    # speculative decoding (engine/spec/decoding.py), vLLM's counters: verifications with drafts, draft tokens,
    # accepted drafts, accepted drafts per position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # fair share (engine/fair_share.py): each tenant with work now, and the preemptions that made room for a tenant
    tenants: tuple[TenantLoad, ...] = ()
    num_fair_preemptions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache (0 before any)."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verification (vLLM's convention: the bonus token counts); 0 before any."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


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


def cache_fingerprint(weights: bytes, kv_cache_dtype: str) -> bytes:
    """The fingerprint cache keys use: the weights' and, for an FP8 latent cache, its storage (FP8 blocks, and the
    KDA states computed over them, are never mixed with a model-dtype cache's)."""
    if kv_cache_dtype == "auto":
        return weights
    return hashlib.sha256(weights + b"|kv_cache_dtype=fp8_e4m3").digest()  # 'fp8' and 'fp8_e4m3' are one format


def engine_stats(manager, scheduler, phase_times, plan, spec) -> EngineStats:
    """The `EngineStats` of an engine's parts now (`spec`: its `engine.spec.decoding.SpecDecoding` or None)."""
    pool, states = manager.block_pool, manager.state_pool
    return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                       kv_usage=pool.usage, num_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
                       num_cached_blocks=pool.num_cached_blocks, num_state_groups=states.num_groups,
                       num_free_state_groups=states.num_free_groups, num_snapshots=states.num_snapshots,
                       num_snapshot_slots=states.num_snapshot_slots,
                       prefix_lookup_tokens=manager.lookup_tokens, prefix_hit_tokens=manager.hit_tokens,
                       num_preemptions=scheduler.num_preemptions, phase_times=phase_times.snapshot(),
                       snapshot_bytes=states.num_snapshots * plan.bytes_per_state,
                       snapshot_budget_bytes=plan.snapshot_budget_bytes,
                       num_junctions=manager.num_junctions, num_snapshot_exports=manager.num_exports,
                       num_snapshot_evictions=states.num_snapshot_evictions,
                       num_snapshots_taken=manager.num_snapshots_taken,
                       spec_num_drafts=spec.num_drafts if spec else 0,
                       spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
                       spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
                       spec_accepted_per_pos=tuple(spec.accepted_per_pos) if spec else (),
                       tenants=scheduler.tenant_loads(), num_fair_preemptions=scheduler.num_fair_preemptions)
