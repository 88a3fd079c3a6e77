"""Tenant-fair admission: one tenant's queued work delays another tenant's first token by a bounded number of
admissions, not by the length of the first tenant's queue; with one tenant the order stays `(priority, arrival)`."""

from __future__ import annotations

from engine.request import RequestStatus
from tests.unit.engine.test_scheduler import _complete, make, req

MAX_TOKENS = 3


def _tenant_req(rid: str, salt: str | None, priority: int = 0):
    r = req(rid, range(8), priority=priority, max_tokens=MAX_TOKENS)
    r.cache_salt = salt
    return r


def _admissions(sched, manager, reqs, late=()) -> list[str]:
    """Runs the scheduler to the end (each request stops after MAX_TOKENS tokens), `late` added after the first
    step -> request ids in admission order."""
    for r in reqs:
        sched.add(r)
    order: list[str] = []
    for step in range(200):
        if not sched.has_unfinished:
            return order
        if step == 1:
            for r in late:
                sched.add(r)
        out = sched.schedule()
        order += [init_req.request_id for init_req in sched.running if init_req.request_id not in order]
        _complete(manager, out)
        for r in list(sched.running):
            if r.num_output_tokens >= MAX_TOKENS:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    raise AssertionError("the scheduler did not drain")


def test_a_late_tenant_is_admitted_before_the_busy_tenants_queue():
    manager, sched = make(num_blocks=64, max_num_seqs=2, interval=0, snapshot_slots=0)
    busy = [_tenant_req(f"a{i}", "aa") for i in range(10)]
    order = _admissions(sched, manager, busy, late=[_tenant_req("b0", "bb")])
    # b0 arrived behind eight queued requests of tenant aa while a0, a1 ran: it waits for one admission of aa's
    # (the turns are level when it joins), not for aa's whole queue
    assert order.index("b0") == 3, order
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(10)]  # FCFS within a tenant


def test_without_a_tenant_of_its_own_the_late_request_waits_for_the_whole_queue():  # negative control
    manager, sched = make(num_blocks=64, max_num_seqs=2, interval=0, snapshot_slots=0)
    busy = [_tenant_req(f"a{i}", "aa") for i in range(10)]
    order = _admissions(sched, manager, busy, late=[_tenant_req("b0", "aa")])
    assert order.index("b0") == 10, order


def test_tenants_alternate_while_both_have_work():
    manager, sched = make(num_blocks=64, max_num_seqs=1, interval=0, snapshot_slots=0)
    order = _admissions(sched, manager, [*(_tenant_req(f"a{i}", "aa") for i in range(3)),
                                         *(_tenant_req(f"b{i}", "bb") for i in range(3))])
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_one_tenant_keeps_fcfs_and_priority_order():
    manager, sched = make(num_blocks=64, max_num_seqs=1, interval=0, snapshot_slots=0)
    reqs = [_tenant_req(f"r{i}", None) for i in range(4)]
    assert _admissions(sched, manager, reqs, late=[_tenant_req("urgent", None, priority=-1)]) == \
        ["r0", "urgent", "r1", "r2", "r3"]


def test_priority_still_comes_before_turns():
    manager, sched = make(num_blocks=64, max_num_seqs=1, interval=0, snapshot_slots=0)
    reqs = [_tenant_req("a0", "aa"), _tenant_req("b0", "bb")]
    assert _admissions(sched, manager, reqs, late=[_tenant_req("a1", "aa", priority=-1)]) == ["a0", "a1", "b0"]
