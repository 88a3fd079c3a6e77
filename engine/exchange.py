"""Cache contents in and out of an engine's pools: cached blocks, KDA snapshots and whole requests by value.

Contract (`EngineCore.exchange`; like the rest of `EngineCore`, called on the engine's thread only — `AsyncEngine`
wraps what the worker services need):
- `export_request(req)` -> the `RequestState` after `req`'s computed tokens (their KV, the running KDA state, the
  full-block hashes, the sampler's generator state, the cache salt).
- `export_cached_blocks(hashes)` -> serialised blocks by hash (hashes not cached here are left out);
  `import_cached_blocks(objects)` adds serialised blocks as free, cached blocks -> how many were added.
- `export_snapshot(hash)` -> the serialised snapshot or None; `import_snapshot(data)` adds one -> False when the
  prefix's last block is not cached here (import the blocks first); `export_snapshots(hashes)` -> the
  (hash, data) pairs of those held.
- `import_prefix(blocks, snapshot)` imports a prefix the cache service served: its blocks, then (KDA models) the
  snapshot at its end -> whether the prefix is now resumable here (the snapshot was added).
- Objects of another model raise `ModelMismatchError`, corrupt or mis-shaped ones `CorruptObjectError` (both
  `TransferError`, engine/transfer.py); nothing is added from an object that fails.
"""

from __future__ import annotations

import torch

from engine.memory.manager import CacheManager
from engine.request import Request
from engine.runner import ModelRunner
from engine.transfer import (CacheLayout, RequestState, check_block_tensor, check_model, check_state_tensors,
                             decode_block, decode_state, encode_block, encode_state)


class CacheExchange:
    def __init__(self, manager: CacheManager, runner: ModelRunner, layout: CacheLayout):
        self.manager = manager
        self.runner = runner
        self.layout = layout

    def export_request(self, req: Request) -> RequestState:
        computed = req.num_computed_tokens
        blocks = req.block_ids[: self.manager.blocks_for(computed)]
        state = self.runner.read_state(self.manager.running_slot(req))
        gen_state = req.generator.get_state() if req.generator is not None else None
        return RequestState(prompt_token_ids=list(req.prompt_token_ids), output_token_ids=list(req.output_token_ids),
                            num_computed_tokens=computed, block_size=self.layout.block_size,
                            fingerprint=self.layout.fingerprint, kv=self.runner.read_blocks(blocks), state=state,
                            block_hashes=list(req.block_hashes[: computed // self.layout.block_size]),
                            generator_state=gen_state, cache_salt=req.cache_salt,
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
        reserved = self.manager.reserve_blocks(list(blocks))
        if reserved:
            ids = [b for _, b in reserved]
            self.runner.write_blocks(ids, torch.stack([blocks[h] for h, _ in reserved], dim=1))
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
