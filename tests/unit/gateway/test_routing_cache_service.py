"""Routing cost and the P/D decision with the cache service's KV events (gateway/routing.py `CacheServiceView`): a
prefix in a worker's own cache costs nothing, one only the cache service holds costs a transfer (reusable only on
workers that load remote prefixes, under the hit rule in the worker's hash space), one held nowhere a prefill."""

from __future__ import annotations

import pytest

from gateway.routing import CACHE, WORKER, CacheServiceView, PDDecider, Router, RouterConfig
from protos import kv_events_pb2
from tests.unit.gateway.kv_feed import BS, SPACE, holding, load, prompt, snapshot

A, B, C = "a:1", "b:1", "c:1"
CACHE_ADDRESS = "cache:1"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(key=None, n_blocks: int = 0, loads_remote: bool = True, **kw) -> kv_events_pb2.KVEventMessage:
    message = holding(key, n_blocks, **kw) if key is not None else snapshot(**kw)
    message.snapshot.loads_remote_prefix = loads_remote
    return message


def cache_service(key, n_blocks: int, snapshot_at=None) -> kv_events_pb2.KVEventMessage:
    """The cache service's snapshot: any model (no block size, no fingerprint of its own)."""
    hashes = key.hashes(SPACE)
    marks = [n_blocks] if snapshot_at is None else list(snapshot_at)
    body = kv_events_pb2.KVCacheSnapshot(block_hashes=hashes[:n_blocks], any_model=True,
                                         snapshot_hashes=[hashes[m - 1] for m in marks if m > 0])
    return kv_events_pb2.KVEventMessage(epoch=99, sequence=0, snapshot=body, load=load())


def mesh(key, clock=None):
    """A holds the prefix itself, B and C hold nothing, only B loads remote prefixes; the cache service holds it."""
    view = CacheServiceView(stale_after_s=3.0, clock=clock or Clock())
    r = Router([A, B, C], cache_view=view, clock=clock or Clock())
    r.apply_kv_event(A, worker(key, 8))
    r.apply_kv_event(B, worker())
    r.apply_kv_event(C, worker(loads_remote=False))
    view.apply_kv_event(CACHE_ADDRESS, cache_service(key, 8))
    return r, view


def test_local_is_free_a_transfer_is_cheap_uncached_is_a_prefill():
    key = prompt(8)  # 8 full blocks + 5 tokens
    r, _ = mesh(key)
    costs = {p.address: p for p in r.costs(key)}
    a, b, c = costs[A], costs[B], costs[C]
    assert (a.cached_tokens, a.local_tokens, a.transfer_tokens, a.uncached_tokens) == (8 * BS, 8 * BS, 0, 5)
    assert (b.cached_tokens, b.local_tokens, b.transfer_tokens, b.uncached_tokens) == (8 * BS, 0, 8 * BS, 5)
    assert (c.cached_tokens, c.uncached_tokens) == (0, 8 * BS + 5)  # it would not import: a prefill
    assert a.cost == 5 and b.cost == 5 + 0.125 * 8 * BS and c.cost == 8 * BS + 5
    assert r.pick(key).address == A
    r.start(A)  # one request in flight on A (128 tokens) outweighs B's transfer (16 tokens) ...
    assert r.pick(key).address == B
    r.start(B)  # ... but not a request on B as well (A: 5 + 128, B: 5 + 16 + 128)
    assert r.pick(key).address == A


def test_importable_follows_the_hit_rule_in_the_workers_hash_space():
    key = prompt(8)
    r, view = mesh(key)
    view.apply_kv_event(CACHE_ADDRESS, cache_service(key, 8, snapshot_at=[4]))  # blocks, a snapshot at 4 only
    assert {p.address: p.cached_tokens for p in r.costs(key)}[B] == 4 * BS
    other = prompt(8, salt="another tenant")  # another tenant's hashes never match
    assert {p.address: p.cached_tokens for p in r.costs(other)} == {A: 0, B: 0, C: 0}
    r.apply_kv_event(B, worker(fingerprint=b"another model".ljust(32, b"\0")))  # another hash space
    assert {p.address: p.cached_tokens for p in r.costs(key)}[B] == 0


def test_no_view_a_silent_view_or_a_silent_worker_hold_nothing_importable():
    key = prompt(8)
    assert Router([B]).pick(key).cached_tokens == 0  # without the cache service's events
    clock = Clock()
    r, view = mesh(key, clock)
    clock.now = 2.0
    r.apply_kv_event(B, worker())  # B still heard from; the view silent since 0
    assert {p.address: p.cached_tokens for p in r.costs(key)}[B] == 8 * BS
    clock.now = 3.5
    r.apply_kv_event(B, worker())
    assert {p.address: p.cached_tokens for p in r.costs(key)}[B] == 0 and not view.index.live
    view.apply_kv_event(CACHE_ADDRESS, cache_service(key, 8))
    r.clear_index(B)  # a worker the gateway cannot hear: not known to import anything either
    assert {p.address: p.cached_tokens for p in r.costs(key)}[B] == 0


def test_the_pd_decision_counts_a_prefix_only_the_cache_service_holds():
    key = prompt(40)  # 640 prompt tokens + 5
    view = CacheServiceView()
    r = Router([B], cache_view=view)
    r.apply_kv_event(B, worker())
    decider = PDDecider(min_uncached_tokens=256)
    cold = r.pick(key)
    assert decider.decide(key.num_tokens, 1, cold.cached_tokens, 0, have_prefill=True) == "remote"
    view.apply_kv_event(CACHE_ADDRESS, cache_service(key, 40))
    warm = r.pick(key)
    assert (warm.local_tokens, warm.transfer_tokens) == (0, 40 * BS)
    assert decider.decide(key.num_tokens, 1, warm.cached_tokens, 0, have_prefill=True) == "local"
    r.apply_kv_event(B, worker(loads_remote=False))  # a worker that would not import it: prefill remotely
    assert decider.decide(key.num_tokens, 1, r.pick(key).cached_tokens, 0, have_prefill=True) == "remote"


def test_a_wrong_belief_empties_the_index_that_was_wrong():
    key = prompt(8)
    r, view = mesh(key)
    b = next(p for p in r.costs(key) if p.address == B)
    assert r.observe(b, 8 * BS) is None  # imported as promised
    assert r.observe(b, 0) == CACHE and not view.index.live  # the import fell short: the view was wrong
    assert r.observe(b, 0) is None  # already emptied
    a = next(p for p in r.costs(key) if p.address == A)
    assert r.observe(a, 0) == WORKER and not r.index(A).live


def test_transfer_weight_is_checked():
    with pytest.raises(ValueError, match="transfer_weight"):
        RouterConfig(transfer_weight=1.5)
