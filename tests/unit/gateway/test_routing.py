"""Routing from the workers' KV events: cost = uncached prompt tokens on that worker (its index) + load_weight ×
queue + kv_usage_weight × KV usage, over healthy workers, with pinned choices; stale beliefs emptied; pool
membership; and the P/D decision (`PDDecider`: remote prefill only for enough uncached tokens, with room)."""

from __future__ import annotations

import pytest

from gateway.prefix_index import RESYNC
from gateway.routing import (WORKER, NoHealthyWorker, PDDecider, Router, RouterConfig, parse_worker_list,
                             should_prefill_remotely)
from tests.unit.gateway.kv_feed import BS, STORED, SNAP_STORED, SPACE, batch, holding, load, prompt, snapshot

A, B, C = "a:1", "b:1", "c:1"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_empty_router_prefers_list_order():
    r = Router([A, B, C])
    pick = r.pick(prompt(4))
    assert (pick.address, pick.cached_tokens, pick.uncached_tokens, pick.cost) == (A, 0, 4 * BS + 5, 4 * BS + 5)


def test_load_spreads_requests_without_prefixes():
    r = Router([A, B, C])
    assert [r.route().address for _ in range(5)] == [A, B, C, A, B]
    r.finish(C)  # C had 1 in flight, now 0
    assert r.route().address == C


def test_prefix_affinity_follows_what_the_worker_reported():
    r = Router([A, B, C])
    key = prompt(10)
    r.apply_kv_event(B, holding(key, 10))
    pick = r.pick(key)
    assert (pick.address, pick.cached_tokens, pick.uncached_tokens) == (B, 10 * BS, 5)
    # a prompt sharing 6 blocks, then diverging: B holds a snapshot at 6 as well → 6 blocks served
    r.apply_kv_event(B, holding(key, 10, snapshot_at=(6, 10)))
    diverged = prompt(10)
    diverged.token_ids[6 * BS + 3] = -1
    assert (r.pick(diverged).address, r.pick(diverged).cached_tokens) == (B, 6 * BS)
    # another tenant's identical tokens hash differently: no affinity
    assert r.pick(prompt(10, salt="other")).address == A


def test_cost_function():
    """cost = uncached tokens + load_weight × queue + kv_usage_weight × usage; queue = in flight from here + what
    the worker reported beyond what this gateway had in flight when the report came."""
    r = Router([A, B, C], RouterConfig(load_weight=100.0, kv_usage_weight=200.0))
    key = prompt(12, extra=0)  # 192 tokens
    r.apply_kv_event(A, holding(key, 4, worker_load=load(running=1, waiting=1, kv_usage=0.5)))  # 2 of others
    for _ in range(3):
        r.start(B)
    r.apply_kv_event(B, holding(key, 10, worker_load=load(running=2, kv_usage=0.25)))  # 2 of our 3 (lagging)
    costs = [(p.address, p.cached_tokens, p.queue, p.kv_usage, p.cost) for p in r.costs(key)]
    assert costs == [(A, 64, 2, 0.5, 128 + 200 + 100), (B, 160, 3, 0.25, 32 + 300 + 50), (C, 0, 0, 0.0, 192)]
    assert r.pick(key).address == C
    r.finish(B)
    r.finish(B)  # B: 1 in flight, no others → 32 + 100 + 50
    assert (r.pick(key).address, r.pick(key).cost) == (B, 182.0)
    r.start(A)
    r.apply_kv_event(A, batch(sequence=0, worker_load=load(running=3, waiting=1)))  # ours 1, others 3
    assert r.costs(key)[0].queue == 4


def test_prefix_affinity_beats_load_up_to_a_point():
    """B holds the whole prompt (512 tokens); A nothing. Load weight 128: B wins while 128 × extra < 512, ties at 4
    (list order: A), loses beyond."""
    key = prompt(32, extra=1)
    for extra, winner in {0: B, 3: B, 4: A, 5: A}.items():
        r = Router([A, B], RouterConfig(load_weight=128.0))
        r.apply_kv_event(B, holding(key, 32))
        for _ in range(extra):
            r.start(B)
        assert r.pick(key).address == winner, extra


def test_equal_costs_break_ties_by_list_order():
    r = Router([C, B, A])
    assert [r.pick(prompt(2)).address for _ in range(3)] == [C, C, C]
    r.mark_unhealthy(C)
    assert r.pick(prompt(2)).address == B


def test_unhealthy_workers_are_skipped_and_forget_their_index():
    r = Router([A, B])
    key = prompt(8)
    r.apply_kv_event(A, holding(key, 8))
    r.start(A)
    r.mark_unhealthy(A)
    assert r.pick(key).address == B
    r.mark_unhealthy(B)
    with pytest.raises(NoHealthyWorker, match="a:1, b:1"):
        r.pick()
    r.mark_healthy(A)
    pick = r.pick(key)
    # A came back: its index was emptied (it may have restarted), its in-flight request still counts
    assert (pick.address, pick.cached_tokens, pick.queue) == (A, 0, 1)


def test_a_silent_worker_counts_as_empty():
    clock = Clock()
    r = Router([A, B], RouterConfig(stale_after_s=3.0), clock=clock)
    key = prompt(8)
    r.apply_kv_event(B, holding(key, 8))
    clock.now = 2.9
    assert r.pick(key).address == B
    clock.now = 3.1  # no heartbeat for longer than stale_after_s
    assert r.pick(key).cached_tokens == 0 and r.pick(key).address == A
    assert not r.index(B).live


def test_a_gap_or_new_epoch_empties_the_index():
    r = Router([A, B])
    key = prompt(8)
    h = key.hashes(SPACE)
    r.apply_kv_event(B, holding(key, 4))
    assert r.apply_kv_event(B, batch([(STORED, h[4])], sequence=3)) == RESYNC  # events 0..2 lost
    assert r.pick(key).address == A
    r.apply_kv_event(B, holding(key, 4, epoch=1))
    assert r.apply_kv_event(B, batch([(STORED, h[4]), (SNAP_STORED, h[4])], epoch=2)) == RESYNC
    assert r.pick(key).cached_tokens == 0


def test_a_wrong_belief_is_used_once():
    """A request that was served fewer cached tokens than the index promised empties that index at once."""
    r = Router([A, B])
    key = prompt(8)
    r.apply_kv_event(B, holding(key, 8))
    first = r.route(key)
    assert (first.address, first.cached_tokens) == (B, 8 * BS)
    assert r.observe(first, 8 * BS) is None  # as promised: nothing changes
    assert r.observe(first, 0) == WORKER  # the worker had lost it (e.g. restarted)
    r.finish(B)
    assert r.pick(key).cached_tokens == 0 and r.pick(key).address == A
    assert r.observe(first, 0) is None  # already emptied: nothing more to do


def test_finish_never_goes_negative_and_unknown_addresses_fail():
    r = Router([A])
    r.finish(A)
    assert r.active(A) == 0
    with pytest.raises(KeyError):
        r.start("nowhere:1")
    with pytest.raises(KeyError):
        r.mark_unhealthy("nowhere:1")
    assert r.apply_kv_event("nowhere:1", snapshot()) == RESYNC  # a removed worker's stream: dropped


def test_parse_worker_list():
    assert parse_worker_list(" a:1, b:2 ,") == ("a:1", "b:2")
    assert parse_worker_list(["a:1,b:2", "c:3"]) == ("a:1", "b:2", "c:3")
    assert parse_worker_list(None) == ()
    with pytest.raises(ValueError, match="listed twice: a:1"):
        parse_worker_list("a:1,a:1")
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError):
        RouterConfig(stale_after_s=0)


@pytest.mark.parametrize("uncached, minimum, saturated, remote", [
    (512, 256, False, True),
    (256, 256, False, True),
    (255, 256, False, False),
    (10_000, 256, True, False),
    (0, 0, False, True),
])
def test_should_prefill_remotely(uncached, minimum, saturated, remote):
    assert should_prefill_remotely(uncached, minimum, saturated) is remote


def test_should_prefill_remotely_rejects_negative():
    with pytest.raises(ValueError):
        should_prefill_remotely(-1, 0, False)


@pytest.mark.parametrize("decider, prompt_tokens, n, cached, inflight, have_prefill, route", [
    (PDDecider(256), 512, 1, 0, 0, True, "remote"),
    (PDDecider(256), 512, 1, 256, 0, True, "remote"),  # exactly the threshold uncached
    (PDDecider(256), 512, 1, 257, 0, True, "local"),  # the decode worker holds most of it
    (PDDecider(256), 100, 1, 0, 0, True, "local"),  # too short to be worth a transfer
    (PDDecider(256), 512, 2, 0, 0, True, "local"),  # n > 1 prefills where it decodes
    (PDDecider(256), 512, 1, 0, 0, False, "local"),  # no healthy prefill worker
    (PDDecider(256, max_prefill_inflight=2), 512, 1, 0, 1, True, "remote"),
    (PDDecider(256, max_prefill_inflight=2), 512, 1, 0, 2, True, "local"),  # prefill saturated
    (PDDecider(256, max_prefill_inflight=0), 512, 1, 0, 10_000, True, "remote"),  # 0: no limit
    (PDDecider(0), 1, 1, 1, 0, True, "remote"),  # threshold 0: always remote when possible
    (PDDecider(0), 4, 1, 9, 0, True, "remote"),  # an index claiming more than the prompt counts as all cached
])
def test_pd_decider(decider, prompt_tokens, n, cached, inflight, have_prefill, route):
    assert decider.decide(prompt_tokens, n, cached, inflight, have_prefill=have_prefill) == route



def test_pd_decider_rejects_negative_settings():
    with pytest.raises(ValueError):
        PDDecider(min_uncached_tokens=-1)


def test_set_addresses_adds_empty_workers_and_drops_removed_ones():
    r = Router([A, B])
    r.apply_kv_event(A, holding(prompt(4), 4))
    r.apply_kv_event(B, holding(prompt(12, seed=1), 12))
    r.start(A)
    r.start(B)
    assert r.set_addresses([B, C]) == ((C,), (A,))
    assert r.addresses == (B, C)
    assert r.pick(prompt(4)).address == C  # A's prefix left with A; C is empty and idle, B busy
    assert r.pick(prompt(12, seed=1)).address == B  # B kept its index (5 + 128 × 1 < 197)
    r.finish(A)  # A's request in flight ends after A left: nothing to do
    assert r.active(B) == 1 and r.is_healthy(C) and not r.index(C).live
    with pytest.raises(ValueError):
        r.set_addresses([B, B])
    r.set_addresses([])
    with pytest.raises(NoHealthyWorker):
        r.pick()
