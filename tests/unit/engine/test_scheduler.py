"""Scheduler + cache manager without a model: exact chunks, block ids, preemption order, snapshots and hits.

`_complete(out)` plays the engine's part of a step: computed tokens advance, blocks and snapshots are committed,
and each chunk that reached the end of its tokens gets one sampled token (always id 1).
"""

from __future__ import annotations

import pytest

from engine.config import CachePlan
from engine.memory.hashing import BlockHasher, root_hash
from engine.memory.manager import CacheManager, StateInit
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make(num_blocks=16, max_num_seqs=4, budget=64, snapshot_slots=4, interval=8, has_kda=True):
    plan = CachePlan(block_size=BS, num_blocks=num_blocks, slots_per_request=1, num_running_slots=max_num_seqs,
                     num_snapshot_slots=snapshot_slots, snapshot_interval=interval, max_model_len=num_blocks * BS,
                     bytes_per_token=1, bytes_per_state=1)
    manager = CacheManager(plan, has_kda=has_kda)
    return manager, Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


_arrival = iter(range(10 ** 6))


def req(rid: str, tokens, priority: int = 0, max_tokens: int = 100) -> Request:
    return Request(request_id=rid, parent_id=rid, index=0, prompt_token_ids=list(tokens),
                   params=SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens=max_tokens,
                   arrival=next(_arrival), hasher=BlockHasher(BS, root_hash(b"model", None)), priority=priority)


def _complete(manager: CacheManager, out) -> list[tuple[int, int]]:
    copies = []
    for chunk in out.chunks:
        chunk.req.num_computed_tokens = chunk.start + chunk.num_tokens
        copies += manager.commit(chunk.req)
    for chunk in out.chunks:
        if chunk.needs_logits:
            chunk.req.append_token(1)
    return copies


def chunks(out):
    return [(c.req.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_chunked_prefill_and_decode_share_the_token_budget():
    manager, sched = make(budget=10, interval=0, snapshot_slots=0)
    a, b = req("a", range(12)), req("b", range(100, 105))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 10)] and out.state_inits == [StateInit(dst=0)]
    assert a.block_ids == [0, 1, 2]
    assert not out.chunks[0].needs_logits
    _complete(manager, out)
    out = sched.schedule()  # a finishes its prompt (2 tokens), b starts with the rest of the budget
    assert chunks(out) == [("a", 10, 2), ("b", 0, 5)] and out.state_inits == [StateInit(dst=1)]
    assert b.block_ids == [3, 4]
    assert [c.needs_logits for c in out.chunks] == [True, True]
    _complete(manager, out)
    out = sched.schedule()  # both decode
    assert chunks(out) == [("a", 12, 1), ("b", 5, 1)]
    assert a.block_ids == [0, 1, 2, 5]  # token 12 starts a fourth block
    manager.check_integrity(sched.holding())


def test_decodes_are_scheduled_before_prefill_chunks():
    manager, sched = make(budget=6, interval=0, snapshot_slots=0)
    a = req("a", range(3))
    sched.add(a)
    _complete(manager, sched.schedule())  # a is now decoding
    b = req("b", range(50, 70))
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("a", 3, 1), ("b", 0, 5)]
    _complete(manager, out)
    c = req("c", range(3))
    sched.add(c)
    out = sched.schedule()  # a's decode first; b's chunk takes the rest; c waits
    assert chunks(out) == [("a", 4, 1), ("b", 5, 5)]


def test_max_num_seqs_and_fcfs_with_priority():
    manager, sched = make(max_num_seqs=2, interval=0, snapshot_slots=0)
    reqs = [req("low", range(4), priority=5), req("x", range(4)), req("y", range(4)), req("urgent", range(4),
                                                                                       priority=-1)]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["urgent", "x", "y", "low"]
    out = sched.schedule()
    assert chunks(out) == [("urgent", 0, 4), ("x", 0, 4)]
    assert [r.request_id for r in sched.waiting] == ["y", "low"]


def test_a_waiting_request_that_does_not_fit_blocks_the_queue():
    manager, sched = make(num_blocks=4, interval=0, snapshot_slots=0)
    sched.add(req("big", range(13)))  # 4 blocks for the prompt... and the rest of the pool is gone
    sched.add(req("small", range(2)))
    out = sched.schedule()
    assert chunks(out) == [("big", 0, 13)]
    assert [r.request_id for r in sched.waiting] == ["small"]


def test_preemption_by_recompute_frees_the_latest_request_and_requeues_it_first():
    manager, sched = make(num_blocks=4, interval=0, snapshot_slots=0)
    a, b = req("a", range(7)), req("b", range(20, 27))
    sched.add(a)
    sched.add(b)
    _complete(manager, sched.schedule())
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    out = sched.schedule()  # position 7 fits in each request's second block
    assert chunks(out) == [("a", 7, 1), ("b", 7, 1)] and not out.preempted
    _complete(manager, out)
    late = req("late", range(40, 43))
    sched.add(late)
    out = sched.schedule()  # a needs a third block: b (the latest running) is preempted
    assert out.preempted == [b] and chunks(out) == [("a", 8, 1)]
    # b's blocks were freed tail first; uncached blocks go to the head of the queue, so its head block is next
    assert a.block_ids == [0, 1, 2] and b.block_ids == [] and b.state_group is None
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_tokens == 9
    assert [r.request_id for r in sched.waiting] == ["b", "late"]  # back at the front
    assert manager.block_pool.free_queue() == [3]
    assert sched.num_preemptions == 1
    manager.check_integrity(sched.holding())
    _complete(manager, out)
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    out = sched.schedule()  # b recomputes prompt + its output token
    assert chunks(out)[0] == ("b", 0, 9)
    manager.check_integrity(sched.holding())


def test_a_request_preempts_itself_when_it_is_the_latest():
    manager, sched = make(num_blocks=3, interval=0, snapshot_slots=0)
    a, b = req("a", range(4)), req("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    _complete(manager, sched.schedule())  # a: [0] (4 tokens), b: [1, 2]
    assert (a.block_ids, b.block_ids) == ([0], [1, 2])
    out = sched.schedule()  # a needs a block for position 4; the latest is b -> b goes; then a fits
    assert out.preempted == [b] and chunks(out) == [("a", 4, 1)]
    _complete(manager, out)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    c = req("c", range(30, 41))
    sched.add(c)
    out = sched.schedule()
    assert chunks(out)[0][0] == "b"


def test_prefill_chunks_end_at_snapshot_boundaries_and_snapshots_are_taken():
    manager, sched = make(interval=8, snapshot_slots=4)
    a = req("a", range(19))  # boundaries: 8, 16 (interval) and 16 (prompt end, floor(19/4)*4 and floor(18/4)*4)
    sched.add(a)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 8)]
    assert _complete(manager, out) == [(0, 4)]  # running slot 0 -> first snapshot slot (4)
    out = sched.schedule()
    assert chunks(out) == [("a", 8, 8)]
    assert _complete(manager, out) == [(0, 5)]
    out = sched.schedule()
    assert chunks(out) == [("a", 16, 3)]
    assert _complete(manager, out) == []
    assert manager.state_pool.snapshot_order() == [a.block_hashes[1], a.block_hashes[3]]
    assert manager.block_pool.num_cached_blocks == 4
    manager.check_integrity(sched.holding())


def test_prefix_hit_resumes_at_the_last_snapshot_before_the_end():
    manager, sched = make(interval=8, snapshot_slots=4)
    a = req("a", range(19))
    sched.add(a)
    for _ in range(3):
        _complete(manager, sched.schedule())
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    same = req("same", range(19))
    sched.add(same)
    out = sched.schedule()
    assert chunks(out) == [("same", 16, 3)]  # the prompt-end snapshot at 16
    assert out.state_inits == [StateInit(dst=0, src=5)]
    assert same.block_ids[:4] == a_blocks_of(manager, a) and same.num_cached_tokens == 16
    assert (manager.lookup_tokens, manager.hit_tokens) == (19 + 19, 16)
    manager.check_integrity(sched.holding())
    other = req("other", list(range(12)) + [99] * 10)  # shares 12 tokens: the snapshot at 8 applies
    sched.add(other)
    out = sched.schedule()
    # ... up to its junction at 12, where its chain leaves the cached blocks (the hybrid policy; under the periodic
    # one, up to the next boundary (16) lacking a snapshot: test_prefix_reuse_scheduler.py)
    assert chunks(out)[-1] == ("other", 8, 4)
    assert out.state_inits == [StateInit(dst=1, src=4)]


def a_blocks_of(manager: CacheManager, a: Request) -> list[int]:
    return [manager.block_pool.get_cached(h) for h in a.block_hashes[:4]]


def test_whole_prompt_cached_still_computes_a_token():
    manager, sched = make(interval=8, snapshot_slots=4)
    a = req("a", range(16))  # prompt-end boundaries: 16 and 12
    sched.add(a)
    while a.num_computed_tokens < 16:
        _complete(manager, sched.schedule())
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    again = req("again", range(16))
    sched.add(again)
    out = sched.schedule()
    assert chunks(out) == [("again", 12, 4)]  # the 16-token snapshot cannot be used: nothing left to compute


def test_short_prompt_below_the_interval_hits_when_repeated():
    manager, sched = make(interval=64, snapshot_slots=4)
    a = req("a", range(10))  # 2 full blocks, far below the interval
    sched.add(a)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 8)]  # ends at the prompt-end boundary 8
    _complete(manager, out)
    _complete(manager, sched.schedule())
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    b = req("b", range(10))
    sched.add(b)
    out = sched.schedule()
    assert chunks(out) == [("b", 8, 2)] and b.num_cached_tokens == 8


def test_block_eviction_drops_the_snapshot_of_that_prefix():
    manager, sched = make(num_blocks=4, interval=8, snapshot_slots=2)
    a = req("a", range(9))
    sched.add(a)
    _complete(manager, sched.schedule())
    _complete(manager, sched.schedule())
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    assert manager.state_pool.num_snapshots == 1
    assert manager.block_pool.free_queue() == [2, 3, 1, 0]
    a_snapshot = a.block_hashes[1]
    assert manager.state_pool.snapshot_order() == [a_snapshot]
    hog = req("hog", range(100, 112))  # needs 3 blocks: 2, 3 and then the cached 1 (the prefix tail)
    sched.add(hog)
    _complete(manager, sched.schedule())  # chunk 0..8
    assert hog.block_ids == [2, 3]
    sched.schedule()  # chunk 8..12 takes block 1, evicting a's prefix tail
    assert hog.block_ids == [2, 3, 1]
    assert a_snapshot not in manager.state_pool.snapshot_order()  # its last block is gone, so is the snapshot
    assert manager.block_pool.get_cached(a.block_hashes[0]) == 0  # the head block is still cached
    manager.check_integrity(sched.holding())


def test_abort_releases_everything():
    manager, sched = make(interval=0, snapshot_slots=0)
    a, b = req("a", range(9)), req("b", range(5))
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished and manager.block_pool.num_free_blocks == 16
    assert manager.state_pool.num_free_groups == 4
    manager.check_integrity([])


def test_without_kda_any_cached_block_boundary_is_a_hit():
    manager, sched = make(interval=8, snapshot_slots=0, has_kda=False)
    a = req("a", range(10))
    sched.add(a)
    out = sched.schedule()
    assert chunks(out) == [("a", 0, 10)]  # no snapshots, so no boundaries
    _complete(manager, out)
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    b = req("b", range(10))
    sched.add(b)
    assert chunks(sched.schedule()) == [("b", 8, 2)]


@pytest.mark.parametrize("n_prompt", [1, 4, 5])
def test_snapshot_boundaries(n_prompt):
    manager, _ = make()
    expected = {1: set(), 4: {4}, 5: {4}}[n_prompt]
    assert manager.snapshot_boundaries(req("r", range(n_prompt))) == expected
