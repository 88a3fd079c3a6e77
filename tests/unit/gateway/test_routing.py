"""Routing: cost = uncached blocks + load_weight × in-flight requests, over healthy workers, with pinned choices;
and the P/D decision (`PDDecider`: remote prefill only for enough uncached tokens, with room in the prefill pool)."""

from __future__ import annotations

import pytest

from gateway.routing import (NoHealthyWorker, PDDecider, Router, RouterConfig, parse_worker_list,
                             prompt_block_hashes, should_prefill_remotely)

A, B, C = "a:1", "b:1", "c:1"
BS = 16


def prompt(n_blocks: int, seed: int = 0, salt: str | None = "tenant") -> list[bytes]:
    tokens = [seed * 100_000 + i for i in range(n_blocks * BS + 5)]  # + a partial block, never hashed
    return prompt_block_hashes(tokens, BS, salt)


def test_empty_router_prefers_list_order():
    r = Router([A, B, C])
    pick = r.pick(prompt(4))
    assert (pick.address, pick.cached_blocks, pick.uncached_blocks, pick.cost) == (A, 0, 4, 4)


def test_load_spreads_requests_without_prefixes():
    r = Router([A, B, C])
    assert [r.route().address for _ in range(5)] == [A, B, C, A, B]
    r.finish(C)  # C had 1 in flight, now 0
    assert r.route().address == C


def test_prefix_affinity():
    r = Router([A, B, C])
    r.start(B, prompt(10))
    pick = r.pick(prompt(10))
    assert (pick.address, pick.cached_blocks, pick.uncached_blocks, pick.active) == (B, 10, 0, 1)
    r.finish(B)
    # a prompt sharing 6 blocks of that prefix, then diverging: the blocks after the divergence are uncached
    tokens = list(range(10 * BS))
    tokens[6 * BS + 3] = -1
    pick = r.pick(prompt_block_hashes(tokens, BS, "tenant"))
    assert (pick.address, pick.cached_blocks, pick.uncached_blocks) == (B, 6, 4)
    # another tenant's identical tokens hash differently: no affinity
    assert r.pick(prompt(10, salt="other")).address == A


def test_prefix_affinity_beats_load_up_to_a_point():
    """B holds the whole 32-block prompt; A holds nothing. Load weight 8: B wins while 8 × (B's load − A's load) < 32,
    ties at 4 extra requests (list order: A), and loses beyond."""
    hashes = prompt(32)
    expected = {0: B, 1: B, 2: B, 3: B, 4: A, 5: A}
    for extra, winner in expected.items():
        r = Router([A, B], RouterConfig(load_weight=8.0))
        r.start(B, hashes)
        r.finish(B)
        for _ in range(extra):
            r.start(B)
        pick = r.pick(hashes)
        assert pick.address == winner, extra
        assert r.pick(hashes).cost == min(32.0, 8.0 * extra)


def test_partial_overlap_cost_ordering():
    r = Router([A, B, C], RouterConfig(load_weight=2.0))
    r.start(A, prompt(4))   # A: 4 of 12 blocks, 1 in flight → 8 + 2 = 10
    r.start(B, prompt(10))  # B: 10 of 12, 1 in flight → 2 + 2 = 4
    r.start(B)              # B: 2 in flight → 2 + 4 = 6
    costs = [(p.address, p.cached_blocks, p.active, p.cost) for p in r.costs(prompt(12))]  # C: 12 + 0
    assert costs == [(A, 4, 1, 10.0), (B, 10, 2, 6.0), (C, 0, 0, 12.0)]
    assert r.pick(prompt(12)).address == B


def test_equal_costs_break_ties_by_list_order():
    r = Router([C, B, A], RouterConfig(load_weight=2.0))
    r.start(A, prompt(2))  # A: 0 uncached + 2 × 1 = 2; B, C: 2 uncached + 0 = 2: a three-way tie → C, listed first
    assert [p.cost for p in r.costs(prompt(2))] == [2.0, 2.0, 2.0]
    assert [r.pick(prompt(2)).address for _ in range(3)] == [C, C, C]
    r.mark_unhealthy(C)
    assert r.pick(prompt(2)).address == B


def test_unhealthy_workers_are_skipped():
    r = Router([A, B])
    r.start(A, prompt(8))
    r.mark_unhealthy(A)
    assert r.pick(prompt(8)).address == B
    r.mark_unhealthy(B)
    with pytest.raises(NoHealthyWorker, match="a:1, b:1"):
        r.pick()
    r.mark_healthy(A)
    pick = r.pick(prompt(8))
    # A came back: its remembered prefixes were forgotten, its in-flight request still counts
    assert (pick.address, pick.cached_blocks, pick.active) == (A, 0, 1)


def test_prefix_memory_is_bounded_lru():
    r = Router([A, B], RouterConfig(prefix_capacity=8))
    first, second = prompt(6, seed=1), prompt(6, seed=2)
    r.start(A, first)
    r.start(A, second)
    r.finish(A)
    r.finish(A)
    assert r.pick(second).cached_blocks == 6
    # the older chain lost its deepest blocks first: what remains is still its prefix
    pick = r.pick(first)
    assert (pick.address, pick.cached_blocks) == (A, 2)


def test_finish_never_goes_negative_and_unknown_addresses_fail():
    r = Router([A])
    r.finish(A)
    assert r.active(A) == 0
    with pytest.raises(KeyError):
        r.start("nowhere:1")
    with pytest.raises(KeyError):
        r.mark_unhealthy("nowhere:1")


def test_parse_worker_list():
    assert parse_worker_list(" a:1, b:2 ,") == ("a:1", "b:2")
    assert parse_worker_list(["a:1,b:2", "c:3"]) == ("a:1", "b:2", "c:3")
    assert parse_worker_list(None) == ()
    with pytest.raises(ValueError, match="listed twice: a:1"):
        parse_worker_list("a:1,a:1")
    with pytest.raises(ValueError, match="at least one"):
        Router([])


def test_block_hashes_are_chained_and_salted():
    assert len(prompt(3)) == 3
    assert prompt(3)[:2] == prompt(2)
    assert prompt(2, salt="x") != prompt(2, salt="y")


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
    (PDDecider(0), 4, 1, 9, 0, True, "remote"),  # a probe claiming more than the prompt counts as all cached
])
def test_pd_decider(decider, prompt_tokens, n, cached, inflight, have_prefill, route):
    assert decider.decide(prompt_tokens, n, cached, inflight, have_prefill=have_prefill) == route


def test_pd_decider_probes_only_when_the_answer_matters():
    decider = PDDecider(min_uncached_tokens=40)
    assert not decider.needs_probe(39) and decider.needs_probe(40)
    assert not decider.needs_probe(400, n=2) and not decider.needs_probe(400, have_prefill=False)
    assert not PDDecider(0).needs_probe(10_000)  # always remote: nothing to ask
    with pytest.raises(ValueError):
        PDDecider(min_uncached_tokens=-1)


def test_set_addresses_adds_empty_workers_and_drops_removed_ones():
    r = Router([A, B])
    r.start(A, prompt(4))
    r.start(B, prompt(12, seed=1))
    assert r.set_addresses([B, C]) == ((C,), (A,))
    assert r.addresses == (B, C)
    assert r.pick(prompt(4)).address == C  # A's prefix left with A; C is empty and idle, B busy
    assert r.pick(prompt(12, seed=1)).address == B  # B kept its state (0 + 8 × 1 < 12)
    r.finish(A)  # A's request in flight ends after A left: nothing to do
    assert r.active(B) == 1 and r.is_healthy(C)
    with pytest.raises(ValueError):
        r.set_addresses([B, B])
    r.set_addresses([])
    with pytest.raises(NoHealthyWorker):
        r.pick()
