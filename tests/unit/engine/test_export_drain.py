"""Exports are read out of the pools by the cache manager's own writes: nobody calls the exchange before a pool
write. A fake runner holds the pools' contents; the scheduler and the exchange are the engine's."""

from __future__ import annotations

import pytest
import torch

from engine.exchange import CacheExchange
from engine.memory.state_manager import StateManager
from engine.request import RequestStatus
from engine.transfer import CacheLayout, encode_block
from tests.unit.engine.test_scheduler import BS, _complete, make, req

FINGERPRINT = b"f" * 32


class PoolContents:
    """The runner's side of the pools: one value per block position and per slot, readable and writable."""

    def __init__(self, num_blocks: int, num_slots: int):
        self.kv = torch.arange(num_blocks * BS, dtype=torch.float32).reshape(1, num_blocks, BS, 1)  # [L, n, bs, 1]
        self.state = torch.arange(num_slots, dtype=torch.float32).reshape(num_slots, 1) + 1000  # [slots, 1]

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        return self.kv[:, ids].clone()  # [L, len(ids), bs, 1]

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        return {"recurrent": self.state[slot].clone()}

    def write_blocks(self, ids: list[int], kv: torch.Tensor) -> None:
        self.kv[:, ids] = kv

    def forward(self, out) -> None:
        """What a step's forward does to the pools: it writes every block its chunks cover."""
        for chunk in out.chunks:
            self.kv[:, chunk.req.block_ids] = -1.0


def engine_parts(num_blocks: int = 3):
    manager, sched = make(num_blocks=num_blocks, interval=64, snapshot_slots=2)
    runner = PoolContents(num_blocks, manager.state_pool.num_slots)
    exchange = CacheExchange(manager, runner, CacheLayout(FINGERPRINT, BS, (1, BS, 1), {"recurrent": (1,)}))
    exchange.exporting = True
    return manager, sched, runner, exchange


def finished_prompt(manager, sched):
    """Request `a` (9 tokens) prefilled and finished: a snapshot at 8 (slot 4) ends its cached blocks 0 and 1."""
    a = req("a", range(9))
    sched.add(a)
    while a.num_computed_tokens < a.num_prompt_tokens:
        _complete(manager, sched.schedule())
        manager.copies_applied()
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    assert manager.state_pool.get_snapshot(a.block_hashes[1]) == 4
    assert manager.block_pool.free_queue() == [2, 1, 0]
    return a


@pytest.fixture(params=[True, False], ids=["drains", "no-drain"])
def drains(request, monkeypatch) -> bool:
    """False: the negative control, a state manager whose writes do not drain (what remembering collect() was for)."""
    if not request.param:
        monkeypatch.setattr(StateManager, "drain_exports", lambda self: None)
    return request.param


def test_an_eviction_during_admission_is_exported_before_the_forward_writes_the_block(drains):
    manager, sched, runner, exchange = engine_parts()
    a = finished_prompt(manager, sched)
    written = runner.read_blocks([0, 1])  # [1, 2, bs, 1]: a's prefix as a computed it
    hog = req("hog", range(100, 112))
    sched.add(hog)
    out = sched.schedule()  # admits hog: its 8 tokens take block 2, then evict a's block 1 (and the snapshot at 8)
    assert hog.block_ids == [2, 1] and manager.state_pool.num_snapshots == 0
    runner.forward(out)
    if not drains:  # the export is lost to the outbox, and its block holds hog's KV by the time anyone reads it
        assert exchange.take_outbox() == []
        [late] = manager.take_exports()
        assert not torch.equal(runner.read_blocks([b for _, b in late.blocks]), written)
        return
    [export] = exchange.take_outbox()
    assert (export.reason, export.block_hash, export.num_tokens) == ("evicted", a.block_hashes[1], 8)
    assert [h for h, _ in export.blocks] == a.block_hashes[:2]
    assert torch.equal(torch.stack([kv for _, kv in export.blocks], dim=1), written)
    assert torch.equal(export.state["recurrent"], torch.tensor([1004.0]))  # slot 4's contents
    manager.check_integrity(sched.holding())


def test_an_import_that_evicts_exports_before_it_writes(drains):
    manager, sched, runner, exchange = engine_parts()
    a = finished_prompt(manager, sched)
    written = runner.read_blocks([0, 1])
    imported = [encode_block(torch.full((1, BS, 1), -7.0), bytes([i]) * 32, FINGERPRINT) for i in range(2)]
    assert exchange.import_cached_blocks(imported) == 2  # blocks 2, then 1: a's snapshot goes with block 1
    outbox = exchange.take_outbox()
    if not drains:
        assert outbox == []
        return
    [export] = outbox
    assert export.block_hash == a.block_hashes[1]
    assert torch.equal(torch.stack([kv for _, kv in export.blocks], dim=1), written)
    assert torch.equal(runner.read_blocks([1]), torch.full((1, 1, BS, 1), -7.0))  # then the import wrote block 1
