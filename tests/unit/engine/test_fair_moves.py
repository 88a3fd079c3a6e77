"""Fair moves in steps of their own (engine/scheduler.py): the step that admits a request by fair preemption, and
the one that brings its victim back, run only those prefill chunks — the other running requests' decodes wait one
step instead of sharing a step with a prefill (on CPU a mixed step costs several decode steps) — and solo steps in
a row compute at most one step's token budget, after which the moved request's rest is chunked with the decodes.
Negative controls: an admission into a free slot, with or without another tenant, shares the step as always. The
scheduler looks for a move every step through `FairShare.could_move`, which never misses one `fair_victim` finds."""

from __future__ import annotations

from engine.fair_share import FairShare
from engine.request import RequestStatus
from tests.unit.engine.test_scheduler import make
from tests.unit.engine.test_tenant_fairness import _flood, _steps, _tenant_req

SLOTS = 8


def _ids(out) -> list[tuple[str, int]]:
    return [(c.req.request_id, c.num_tokens) for c in out.chunks]


def _filled(slots: int = SLOTS, budget: int = 64):
    """A lone tenant "a" fills `slots` of SLOTS slots with long requests and decodes a step -> (manager, sched)."""
    manager, sched = make(num_blocks=512, max_num_seqs=SLOTS, budget=budget, interval=0, snapshot_slots=0)
    _flood(sched, "a", slots)
    _steps(sched, manager, 2)
    return manager, sched


def test_a_fair_move_and_its_victims_return_run_alone():
    manager, sched = _filled()
    sched.add(_tenant_req("b0", "b", max_tokens=2))
    out = _steps(sched, manager, 1)[0]
    assert [r.request_id for r in out.preempted] == ["a7"] and _ids(out) == [("b0", 8)]  # no decode of a's
    out = _steps(sched, manager, 1)[0]
    assert sorted(_ids(out)) == [(f"a{i}", 1) for i in range(7)] + [("b0", 1)]  # b0's last token with a's
    out = _steps(sched, manager, 1)[0]  # b0 finished: a7 comes back and recomputes alone
    assert _ids(out) == [("a7", 8 + 2)]  # its prompt and two outputs (no snapshots here)
    out = _steps(sched, manager, 1)[0]
    assert sorted(_ids(out)) == [(f"a{i}", 1) for i in range(8)]
    assert sched.num_fair_preemptions == 1


def test_an_admission_into_a_free_slot_shares_the_step():  # negative control: no move, no solo step
    for tenant in ("b", "a"):
        manager, sched = _filled(slots=SLOTS - 1)
        sched.add(_tenant_req("late", tenant, max_tokens=2))
        out = _steps(sched, manager, 1)[0]
        assert not out.preempted
        assert sorted(_ids(out)) == [(f"a{i}", 1) for i in range(SLOTS - 1)] + [("late", 8)]


def test_solo_steps_in_a_row_stay_within_one_token_budget():
    manager, sched = _filled(budget=64)
    b = _tenant_req("b0", "b", max_tokens=2, prompt_len=150)
    sched.add(b)
    out = _steps(sched, manager, 1)[0]
    assert _ids(out) == [("b0", 64)]  # one budget alone
    out = _steps(sched, manager, 1)[0]  # then the decodes run, and b0's rest is chunked with them
    assert sorted(_ids(out)) == [(f"a{i}", 1) for i in range(7)] + [("b0", 64 - 7)]
    out = _steps(sched, manager, 1)[0]
    assert sorted(_ids(out)) == [(f"a{i}", 1) for i in range(7)] + [("b0", 150 - 64 - 57)]
    assert b.status is RequestStatus.RUNNING


def test_the_cheap_check_finds_a_move_only_where_fair_victim_can():
    fair = FairShare(num_slots=SLOTS, num_blocks=512)
    flood = [_tenant_req(f"a{i}", "a") for i in range(SLOTS)]
    split = flood[:4] + [_tenant_req(f"b{i}", "b") for i in range(4)]
    waiter = _tenant_req("w", "b")
    assert fair.could_move({"b"}, flood) and fair.fair_victim(waiter, flood, 0) is not None
    assert not fair.could_move({"a"}, flood)  # a lone tenant never moves
    assert not fair.could_move({"a", "b"}, split) and fair.fair_victim(waiter, split, 0) is None  # balanced
