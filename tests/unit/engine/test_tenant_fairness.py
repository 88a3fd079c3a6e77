"""Tenant fairness in the scheduler (engine/fair_share.py): admission orders the waiting tenants by usage and turns,
and a waiting tenant takes running slots and KV blocks back from a tenant over its share by preempting that
tenant's newest requests (recompute), with hysteresis; a lone tenant keeps the whole engine; weights split it."""

from __future__ import annotations

from engine.request import RequestStatus
from tests.unit.engine.test_scheduler import _complete, make, req

MAX_TOKENS = 3


def _tenant_req(rid: str, tenant: str | None, priority: int = 0, max_tokens: int = MAX_TOKENS, weight: float = 1.0,
                prompt_len: int = 8):
    r = req(rid, range(prompt_len), priority=priority, max_tokens=max_tokens)
    r.tenant, r.tenant_weight = tenant, weight
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
    # b0 arrived behind eight queued requests of tenant aa while a0, a1 ran: aa held both slots, over its share of
    # one, so its newest (a1) made room at once
    assert order.index("b0") == 2, order
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(10)]  # FCFS within a tenant
    assert [r.request_id for r in busy if r.num_preemptions] == ["a1"] and sched.num_fair_preemptions == 1


def test_without_a_tenant_of_its_own_the_late_request_waits_for_the_whole_queue():  # negative control
    manager, sched = make(num_blocks=64, max_num_seqs=2, interval=0, snapshot_slots=0)
    busy = [_tenant_req(f"a{i}", "aa") for i in range(10)]
    order = _admissions(sched, manager, busy, late=[_tenant_req("b0", "aa")])
    assert order.index("b0") == 10, order
    assert sched.num_preemptions == 0


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


# -- fair share of the running slots and pools -------------------------------------------------------------------


def _steps(sched, manager, n: int) -> list:
    """Runs `n` steps (requests finish at their max_tokens) -> the scheduler outputs."""
    outs = []
    for _ in range(n):
        out = sched.schedule()
        _complete(manager, out)
        for r in list(sched.running):
            if r.num_output_tokens >= r.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        manager.check_integrity(sched.holding())
        outs.append(out)
    return outs


def _running(sched) -> dict[str, int]:
    return {load.tenant: load.running for load in sched.tenant_loads()}


def _flood(sched, tenant: str, n: int, weight: float = 1.0, max_tokens: int = 40) -> list:
    reqs = [_tenant_req(f"{tenant}{i}", tenant, max_tokens=max_tokens, weight=weight) for i in range(n)]
    for r in reqs:
        sched.add(r)
    return reqs


def test_a_flooding_tenant_makes_room_for_a_short_request_at_once():
    manager, sched = make(num_blocks=256, max_num_seqs=8, interval=0, snapshot_slots=0)
    flood = _flood(sched, "a", 8)
    _steps(sched, manager, 2)
    assert _running(sched) == {"a": 8}  # a lone tenant fills every slot
    short = [_tenant_req(f"b{i}", "b", max_tokens=2) for i in range(2)]
    for r in short:
        sched.add(r)
    out = _steps(sched, manager, 1)[0]
    assert [r.request_id for r in out.preempted] == ["a7", "a6"]  # the largest holder's newest
    assert {c.req.request_id for c in out.chunks} >= {"b0", "b1"}  # admitted in the same step
    _steps(sched, manager, 2)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in short)
    _steps(sched, manager, 1)
    assert _running(sched) == {"a": 8}  # the preempted ones came back
    assert sched.num_preemptions == 2 and [r.num_preemptions for r in flood] == [0] * 6 + [1, 1]


def test_without_another_tenant_nothing_is_preempted():  # negative control of the test above
    manager, sched = make(num_blocks=256, max_num_seqs=8, interval=0, snapshot_slots=0)
    _flood(sched, "a", 8)
    _steps(sched, manager, 2)
    for i in range(2):
        sched.add(_tenant_req(f"late{i}", "a", max_tokens=2))
    out = _steps(sched, manager, 1)[0]
    assert not out.preempted and _running(sched) == {"a": 8}


def test_two_flooding_tenants_split_the_slots_and_stop_preempting():
    manager, sched = make(num_blocks=256, max_num_seqs=8, interval=0, snapshot_slots=0)
    _flood(sched, "a", 12, max_tokens=60)
    _steps(sched, manager, 2)
    _flood(sched, "b", 12, max_tokens=60)
    _steps(sched, manager, 1)
    assert _running(sched) == {"a": 4, "b": 4}
    preempted = sched.num_preemptions
    _steps(sched, manager, 20)  # no request finishes in these steps: the split holds without further moves
    assert _running(sched) == {"a": 4, "b": 4} and sched.num_preemptions == preempted == 4


def test_weights_split_the_slots_in_proportion():
    manager, sched = make(num_blocks=256, max_num_seqs=8, interval=0, snapshot_slots=0)
    _flood(sched, "a", 12, weight=3.0, max_tokens=60)
    _steps(sched, manager, 2)
    _flood(sched, "b", 12, weight=1.0, max_tokens=60)
    _steps(sched, manager, 10)
    assert _running(sched) == {"a": 6, "b": 2}


def test_a_tenant_over_its_share_of_the_kv_pool_gives_blocks_back():
    # slots are free, but tenant a's long prompts hold every block: b's request fits only once a's newest leave
    manager, sched = make(num_blocks=24, max_num_seqs=8, budget=256, interval=0, snapshot_slots=0)
    for i in range(3):
        sched.add(_tenant_req(f"a{i}", "a", max_tokens=40, prompt_len=31))  # 8 blocks each
    _steps(sched, manager, 1)
    assert manager.block_pool.num_free_blocks == 0 and len(sched.running) == 3
    b = _tenant_req("b0", "b", max_tokens=2, prompt_len=8)
    sched.add(b)
    out = _steps(sched, manager, 1)[0]
    assert [r.request_id for r in out.preempted] == ["a2"] and b.status is RequestStatus.RUNNING


def test_nothing_is_preempted_for_a_request_its_share_cannot_fit():
    # b's prompt needs 20 of the 24 blocks: taking a2's 8 brings a down to b's usage before b fits, so a keeps all
    manager, sched = make(num_blocks=24, max_num_seqs=8, budget=256, interval=0, snapshot_slots=0)
    for i in range(3):
        sched.add(_tenant_req(f"a{i}", "a", max_tokens=40, prompt_len=31))
    _steps(sched, manager, 1)
    b = _tenant_req("b0", "b", max_tokens=2, prompt_len=80)
    sched.add(b)
    _steps(sched, manager, 1)
    assert sched.num_preemptions == 0 and b.status is RequestStatus.WAITING and _running(sched) == {"a": 3, "b": 0}


def test_pool_pressure_preempts_the_largest_holders_newest_request():
    manager, sched = make(num_blocks=6, max_num_seqs=4, interval=0, snapshot_slots=0)
    a0, a1 = _tenant_req("a0", "a", max_tokens=40, prompt_len=4), _tenant_req("a1", "a", max_tokens=40, prompt_len=4)
    b0 = _tenant_req("b0", "b", max_tokens=40, prompt_len=4)
    for r in (a0, a1, b0):
        sched.add(r)
    _steps(sched, manager, 1)  # each holds one full block, then needs a second: 3 + 3 = 6 blocks
    out = _steps(sched, manager, 5)
    victims = [r.request_id for o in out for r in o.preempted]
    # b0 is the latest arrival (the victim of a one-tenant engine), but tenant a holds twice b's share: a1 goes
    assert victims and victims[0] == "a1", victims
