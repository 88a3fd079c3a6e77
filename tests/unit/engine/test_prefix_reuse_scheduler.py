"""The hybrid snapshot policy without a model: exact chunk cuts at junctions and hints, a waiting request deferred
for an in-flight junction, rolling turn-end snapshots, retention priorities, exports, and the snapshot budget.

Uses the model-free harness of test_scheduler.py (`_complete` plays the engine's part of a step: tokens advance,
blocks and snapshots are committed, each chunk that reached its end samples token 1).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineArgs, plan_cache
from engine.errors import EngineConfigError
from engine.memory.manager import StateInit
from engine.memory.state_pool import SnapshotPriority, StatePool
from engine.model.config import ModelConfig
from engine.model.presets import preset_config
from engine.request import RequestStatus
from tests.unit.engine.test_scheduler import _complete, chunks, make, req

P, T, H = SnapshotPriority.PERIODIC, SnapshotPriority.TURN, SnapshotPriority.HINT


def finish(manager, sched, r) -> None:
    """Runs `r` (queued first when it is new) to the end of its prompt and finishes it."""
    if r not in sched.running and r not in sched.waiting:
        sched.add(r)
    while r.num_computed_tokens < r.num_prompt_tokens:
        _complete(manager, sched.schedule())
    sched.finish(r, RequestStatus.FINISHED_LENGTH)


def test_the_periodic_policy_keeps_the_old_chunking():
    manager, sched = make(interval=8, snapshot_slots=4)
    manager.policy = dataclasses.replace(manager.policy, mode="periodic")
    finish(manager, sched, req("a", range(19)))
    other = req("other", list(range(12)) + [99] * 10)  # shares 12 tokens: the snapshot at 8 applies
    sched.add(other)
    assert chunks(sched.schedule()) == [("other", 8, 8)]  # up to the next boundary (16) lacking a snapshot
    assert manager.num_junctions == 0


def test_a_junction_cuts_the_second_request_where_its_chain_leaves_the_cached_blocks():
    manager, sched = make(interval=64, snapshot_slots=4)
    finish(manager, sched, req("a", list(range(14)) + [50] * 6))  # 20 tokens, prompt ends 16 and 20
    b = req("b", list(range(14)) + [60] * 6)  # shares 3 full blocks (12 tokens), no snapshot there
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("b", 0, 12)] and b.snapshot_points == {12: H} and manager.num_junctions == 1
    assert _complete(manager, out) == [(0, 6)]  # b's running slot -> the free slot after a's two (16, 20)
    finish(manager, sched, b)
    c = req("c", list(range(14)) + [70] * 6)
    sched.add(c)
    out = sched.schedule()
    assert chunks(out) == [("c", 12, 4)] and c.num_cached_tokens == 12  # resumes at the junction, to 16
    assert out.state_inits[0].src == manager.state_pool.get_snapshot(b.block_hashes[2])
    manager.check_integrity(sched.holding())


def test_an_in_flight_junction_cuts_the_producer_and_defers_the_waiting_request():
    manager, sched = make(interval=64, snapshot_slots=4, budget=64)
    a, b = req("a", list(range(14)) + [50] * 6), req("b", list(range(14)) + [60] * 6)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 12)] and out.deferred == [b]  # a's chunk 0..20 was cut where the two part
    assert a.snapshot_points == {12: H} and sched.waiting == [b]
    assert _complete(manager, out) == [(0, 4)]
    out = sched.schedule()  # a goes on to its prompt end, b resumes from a's junction snapshot
    assert chunks(out) == [("a", 12, 4), ("b", 12, 4)] and out.state_inits == [StateInit(dst=1, src=4)]
    assert b.num_cached_tokens == 12 and not out.deferred
    manager.check_integrity(sched.holding())


def test_a_deferred_request_does_not_block_others_and_stops_waiting_when_the_producer_leaves():
    manager, sched = make(interval=64, snapshot_slots=4, budget=64)
    a, b, c = req("a", list(range(14)) + [50] * 6), req("b", list(range(14)) + [60] * 6), req("c", range(100, 105))
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 12), ("c", 0, 4)] and out.deferred == [b]  # c overtakes the deferred b
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # the producer leaves before its chunk ran
    out = sched.schedule()
    assert chunks(out)[-1] == ("b", 0, 16) and not out.deferred  # computes itself, to its prompt end


def test_rolling_turn_end_follows_decode_across_block_boundaries():
    manager, sched = make(interval=64, snapshot_slots=4)
    a = req("a", range(6))  # prompt ends: 4
    sched.add(a)
    copies = []
    while a.num_tokens < 14:
        copies.append(_complete(manager, sched.schedule()))
    # prompt 0..4 (snapshot 4), 4..6 + sample; then decodes: 7, 8 (boundary), ... 12 (boundary), 13
    taken = [c for c in copies if c]
    assert taken == [[(0, 4)], [(0, 5)], [(0, 6)]]  # the turn end at 8, then at 12 (the one at 8 is dropped)
    states = manager.state_pool
    assert states.snapshot_order() == [a.block_hashes[0], a.block_hashes[2]]  # prompt end (4), turn end (12)
    assert states.snapshot_priority(a.block_hashes[2]) == T
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    nxt = req("next", a.token_ids[:13] + [9, 9, 9])
    sched.add(nxt)
    assert chunks(sched.schedule()) == [("next", 12, 4)]  # the next turn hits the whole previous one
    manager.check_integrity(sched.holding())


def test_retention_priorities_hints_over_turn_ends_over_periodic():
    evicted = []
    pool = StatePool(num_groups=1, slots_per_request=1, num_snapshot_slots=3, on_evict=lambda h, s: evicted.append(h))
    pool.put_snapshot(b"hint", H)
    pool.put_snapshot(b"turn", T)
    pool.put_snapshot(b"periodic", P)
    assert pool.snapshot_order() == [b"periodic", b"turn", b"hint"]
    assert pool.put_snapshot(b"turn2", T) == 3 and evicted == [b"periodic"]  # the lowest priority goes first
    assert pool.put_snapshot(b"periodic2", P) is None  # would evict a higher priority: nothing stored
    assert pool.put_snapshot(b"hint2", H) == 2 and evicted == [b"periodic", b"turn"]  # LRU within a priority
    assert pool.put_snapshot(b"turn2", H) is None and pool.snapshot_priority(b"turn2") == H  # raised, refreshed
    assert pool.snapshot_order() == [b"hint", b"hint2", b"turn2"]
    pool.check_integrity(owned_groups=[])


def test_an_evicted_snapshot_is_exported_with_the_blocks_of_its_prefix():
    manager, sched = make(num_blocks=8, interval=4, snapshot_slots=1)
    manager.exporting = True
    a = req("a", range(9))  # snapshots at 4, then 8 (evicts 4: one slot)
    sched.add(a)
    _complete(manager, sched.schedule())
    out = sched.schedule()
    assert chunks(out) == [("a", 4, 4)]
    copies = _complete(manager, out)
    assert copies == [(0, 4)] and manager.take_exports() == []  # the victim's slot awaits a's copy: not exported
    manager.copies_applied()
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    b = req("b", range(100, 109))
    sched.add(b)
    _complete(manager, sched.schedule())  # b's periodic snapshot at 4 may not evict a's prompt end (8)
    assert manager.take_exports() == [] and manager.state_pool.snapshot_order() == [a.block_hashes[1]]
    _complete(manager, sched.schedule())  # b's prompt end (8) evicts a's (slot 4, written): exported
    [export] = manager.take_exports()
    assert (export.reason, export.block_hash, export.slot, export.num_tokens) == ("evicted", a.block_hashes[1], 4, 8)
    assert [h for h, _ in export.blocks] == a.block_hashes[:2]
    assert [blk for _, blk in export.blocks] == [manager.block_pool.get_cached(h) for h in a.block_hashes[:2]]
    manager.check_integrity(sched.holding())


def test_exports_skip_blocks_the_cache_service_holds_and_reset_exports_nothing():
    manager, sched = make(num_blocks=3, interval=4, snapshot_slots=2)
    manager.exporting = True
    a = req("a", range(9))
    manager.note_sent(a.block_hashes[:1])
    finish(manager, sched, a)
    manager.copies_applied()
    hog = req("hog", range(100, 112))  # takes every block: a's are evicted, tail first
    sched.add(hog)
    for _ in range(3):
        _complete(manager, sched.schedule())
        manager.copies_applied()
    exports = {e.block_hash: e for e in manager.take_exports()}
    assert [h for h, _ in exports[a.block_hashes[1]].blocks] == [a.block_hashes[1]]  # block 0 was sent before
    manager.reset_prefix_cache()
    assert manager.take_exports() == []


def test_snapshot_budget_sizes_the_snapshot_slots():
    config = ModelConfig.from_dict(preset_config("tiny-linear"))
    base = EngineArgs(model="m", kv_cache_memory=4 << 20, max_num_seqs=2)
    state = plan_cache(base, config, 4).bytes_per_state
    plan = plan_cache(dataclasses.replace(base, snapshot_budget=5 * state + 7), config, 4)
    assert plan.num_snapshot_slots == 5 and plan.snapshot_budget_bytes == 5 * state
    assert plan_cache(dataclasses.replace(base, snapshot_budget="0"), config, 4).num_snapshot_slots == 0
    assert plan.snapshot_policy == "hybrid"
    for bad in (dict(snapshot_policy="lru"), dict(snapshot_budget="lots")):
        with pytest.raises(EngineConfigError):
            dataclasses.replace(base, **bad)


def test_the_hit_rate_log_line(caplog):
    from engine.async_engine import _HitRateLog
    from engine.core import EngineStats

    zero = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})
    log = _HitRateLog(zero, interval_s=0.0)
    with caplog.at_level("INFO", logger="engine.async_engine"):
        log.maybe_log(zero)  # nothing admitted since: no line
        log.maybe_log(dataclasses.replace(zero, prefix_lookup_tokens=4000, prefix_hit_tokens=3000, num_snapshots=3))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("Prefix cache hit rate: 75.0% (3000 of 4000 prompt tokens; 75.0% since start)")
