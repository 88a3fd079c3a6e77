"""Cache contents in and out of an engine's pools: cached blocks, KDA snapshots and whole requests by value.

Contract (`EngineCore.exchange`; like the rest of `EngineCore`, called on the engine's thread only — `AsyncEngine`
wraps what the worker services need):
- `export_request(req)` -> the `RequestState` after `req`'s computed tokens (their KV, the running KDA state, the
  full-block hashes, the sampler's seed, the cache salt).
- `export_cached_blocks(hashes)` -> serialised blocks by hash (hashes not cached here are left out);
  `import_cached_blocks(objects)` adds serialised blocks as free, cached blocks -> how many were added;
  `import_block_tensors(hashes, kv)` adds blocks the caller already decoded and checked (`transfer.check_block`,
  off this thread) -> how many of `hashes` are cached here now (a streamed handoff's full blocks, which its lean
  state then takes from the cache: `EngineCore.import_request(..., lean=True)`).
- `export_snapshot(hash)` -> the serialised snapshot or None; `import_snapshot(data)` adds one -> False when the
  prefix's last block is not cached here (import the blocks first); `export_snapshots(hashes)` -> the
  (hash, data) pairs of those held.
- `import_prefix(blocks, snapshot)` imports a prefix the cache service served: its blocks, then (KDA models) the
  snapshot at its end -> whether the prefix is now resumable here (the snapshot was added).
- Objects of another model raise `ModelMismatchError`, corrupt or mis-shaped ones `CorruptObjectError` (both
  `TransferError`, engine/transfer.py); nothing is added from an object that fails. Imported blocks are remembered
  as held by the cache service (exports skip them).
- Outbox (while `exporting`, which the engine's owner turns on when it has somewhere to put them): the exchange is
  the cache manager's export reader (`CacheManager.set_export_reader`): every manager operation that lets a snapshot
  go (evicted, or a handoff's turn end) hands it over before it returns, and the exchange reads it, with its blocks
  not sent before, out of the pools as a `SnapshotExport` (CPU tensors) into `outbox` (at most `MAX_OUTBOX`; older
  ones are dropped and counted in `num_dropped`); `take_outbox()` hands them over. Nobody has to call anything
  before a pool write: the imports here write only after the manager's `reserve_*` calls have drained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.memory.manager import CacheManager
from engine.memory.state_manager import PendingExport
from engine.request import Request
from engine.runner import ModelRunner
from engine.transfer import (CacheLayout, RequestState, ShapeMismatchError, check_block_tensor, check_model,
                             check_state_tensors, decode_block, decode_state, encode_block, encode_state)

MAX_OUTBOX = 256


@dataclass(frozen=True)
class SnapshotExport:
    """A snapshot leaving this engine with the blocks of its prefix the cache service may lack."""

    reason: str  # "evicted" (for room, or its last block was) | "turn_end" (a finished handoff's turn)
    block_hash: bytes  # the hash of the prefix's last block: the snapshot's name
    cache_salt: str | None  # the engine cache salt of the request that took it (worker/tenancy.py maps it back)
    num_tokens: int  # the prefix's length
    state: dict[str, torch.Tensor]  # conv [num_kda_layers, 3*H*D, W-1], recurrent [num_kda_layers, H, D, D]
    blocks: tuple[tuple[bytes, torch.Tensor], ...]  # (hash, kv [num_mla_layers, block_size, cache_dim]), in order


class CacheExchange:
    def __init__(self, manager: CacheManager, runner: ModelRunner, layout: CacheLayout):
        self.manager = manager
        self.runner = runner
        self.layout = layout
        self.outbox: list[SnapshotExport] = []
        self.num_dropped = 0
        manager.set_export_reader(self._read_exports)

    # -- the outbox -------------------------------------------------------------------------------------------

    @property
    def exporting(self) -> bool:
        return self.manager.exporting

    @exporting.setter
    def exporting(self, on: bool) -> None:
        self.manager.exporting = on

    def _read_exports(self, pending: list[PendingExport]) -> None:
        """Reads exports the manager let go out of the pools (it calls this before anything writes them)."""
        for p in pending:
            kv = self.runner.read_blocks([b for _, b in p.blocks]) if p.blocks else None  # [L, n, bs, dim]
            blocks = tuple((h, kv[:, i]) for i, (h, _) in enumerate(p.blocks))
            self.outbox.append(SnapshotExport(p.reason, p.block_hash, p.cache_salt, p.num_tokens,
                                              self.runner.read_state(p.slot), blocks))
        if len(self.outbox) > MAX_OUTBOX:
            self.num_dropped += len(self.outbox) - MAX_OUTBOX
            del self.outbox[:-MAX_OUTBOX]

    def take_outbox(self) -> list[SnapshotExport]:
        items, self.outbox = self.outbox, []
        return items

    def export_request(self, req: Request) -> RequestState:
        computed = req.num_computed_tokens
        blocks = req.block_ids[: self.manager.blocks_for(computed)]
        state = self.runner.read_state(self.manager.running_slot(req))
        return RequestState(prompt_token_ids=list(req.prompt_token_ids), output_token_ids=list(req.output_token_ids),
                            num_computed_tokens=computed, block_size=self.layout.block_size,
                            fingerprint=self.layout.fingerprint, kv=self.runner.read_blocks(blocks), state=state,
                            block_hashes=list(req.block_hashes[: computed // self.layout.block_size]),
                            sampling_seed=req.seed, cache_salt=req.cache_salt,
                            num_cached_tokens=req.num_cached_tokens or 0)

    def export_cached_blocks(self, hashes: list[bytes]) -> dict[bytes, bytes]:
        found = [(h, self.manager.block_pool.get_cached(h)) for h in hashes]
        found = [(h, b) for h, b in found if b is not None]
        if not found:
            return {}
        data = self.runner.read_blocks([b for _, b in found])  # [L, n, bs, dim]
        return {h: encode_block(data[:, i], h, self.layout.fingerprint) for i, (h, _) in enumerate(found)}

    def import_cached_blocks(self, objects: list[bytes]) -> int:
        blocks = {}
        for data in objects:
            h, fingerprint, kv = decode_block(data)
            check_model(fingerprint, self.layout, "a block")
            check_block_tensor(kv, self.layout)
            blocks[h] = kv
        return self._import_blocks(blocks)

    def import_block_tensors(self, hashes: list[bytes], kv: torch.Tensor) -> int:
        """`kv` [num_mla_layers, len(hashes), block_size, cache_dim]: block i is the one named `hashes[i]`."""
        layers, bs, dim = self.layout.kv_block_shape
        if tuple(kv.shape) != (layers, len(hashes), bs, dim):
            raise ShapeMismatchError(f"blocks of shape {tuple(kv.shape)} for {len(hashes)} blocks of this model")
        self._import_blocks({h: kv[:, i] for i, h in enumerate(hashes)}, kv)
        return sum(1 for h in hashes if self.manager.block_pool.get_cached(h) is not None)

    def _import_blocks(self, blocks: dict[bytes, torch.Tensor], stacked: torch.Tensor | None = None) -> int:
        """`stacked`: the blocks as one tensor [L, n, bs, dim] in `blocks`' order, written as it is when every one
        of them gets a block."""
        reserved = self.manager.reserve_blocks(list(blocks))
        self.manager.note_sent(blocks)
        if reserved:
            ids = [b for _, b in reserved]
            every = stacked is not None and stacked.shape[1] == len(blocks) and \
                [h for h, _ in reserved] == list(blocks)
            self.runner.write_blocks(ids, stacked if every else torch.stack([blocks[h] for h, _ in reserved], dim=1))
            self.manager.release_blocks(ids)
        return len(reserved)

    def export_snapshot(self, block_hash: bytes) -> bytes | None:
        slot = self.manager.state_pool.get_snapshot(block_hash)
        if slot is None:
            return None
        return encode_state(self.runner.read_state(slot), block_hash, self.layout.fingerprint)

    def export_snapshots(self, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        found = [(h, self.export_snapshot(h)) for h in hashes]
        return [(h, data) for h, data in found if data is not None]

    def import_snapshot(self, data: bytes) -> bool:
        h, fingerprint, state = decode_state(data)
        check_model(fingerprint, self.layout, "a snapshot")
        check_state_tensors(state, self.layout)
        slot = self.manager.reserve_snapshot(h)
        if slot is None:
            return False
        self.runner.write_state(slot, state)
        return True

    def import_prefix(self, blocks: list[bytes], snapshot: bytes | None) -> bool:
        self.import_cached_blocks(blocks)
        return snapshot is None or self.import_snapshot(snapshot)

    def snapshot_hashes(self) -> list[bytes]:
        return self.manager.state_pool.snapshot_order()
