"""The model drafters' batched form: proposals for many requests in one call equal each request's alone (padding to
the longest cache is masked out), buffers grow by doubling and not per step, drafting reads back only the draft ids,
and the device-side draft sampling draws from the distribution it reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.spec.draft_cache import SlotRows
from engine.spec.draft_sample import DraftSampler, _splitmix, exponential_race
from engine.spec.drafter import DraftQuery
from engine.spec.dspark import build_dspark_drafter
from engine.spec.mtp import build_mtp_drafter
from tests.unit.engine.spec.drafters.conftest import tapped_sequences

K = 3
LENGTHS = (9, 17, 5)  # observed positions of the batch's requests (different cache lengths: padding in the batch)


def _build(kind, k3, k3_dir, dspark_dir, method="greedy"):
    spec = SimpleNamespace(num_speculative_tokens=K, draft_sample_method=method,
                           model=None if kind == "mtp" else str(dspark_dir))
    if kind == "mtp":
        return build_mtp_drafter(k3, k3_dir, spec, max_num_seqs=2)
    return build_dspark_drafter(k3, dspark_dir, spec, max_num_seqs=2)


@pytest.fixture(scope="module")
def sequences(k3, dspark_dir):
    """Per request: token ids and the tapped hidden rows of (FINAL_TAP,) and of DSpark's taps."""
    return tapped_sequences(k3, dspark_dir, [n + 1 for n in LENGTHS], seed=20)


def _observed(kind, k3, k3_dir, dspark_dir, sequences, method="greedy"):
    d = _build(kind, k3, k3_dir, dspark_dir, method)
    for i, (ids, taps) in enumerate(sequences):
        n = LENGTHS[i]
        d.observe(f"r{i}", 0, ids[: n // 2], taps[kind][: n // 2])
        d.observe(f"r{i}", n // 2, ids[n // 2: n], taps[kind][n // 2: n])
    return d


def _queries(sequences):
    return [DraftQuery(f"r{i}", ids[: LENGTHS[i] + 1], K) for i, (ids, _) in enumerate(sequences)]


def _corrupt(drafter, req_id, rows: slice):
    """Large noise into a request's buffer rows (its own or past its length)."""
    slot = drafter.cache.slot_of[req_id]
    view = drafter.cache.buffer[slot, rows]
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(0)) * 50)


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_batched_proposals_equal_per_request(kind, k3, k3_dir, dspark_dir, sequences):
    d = _observed(kind, k3, k3_dir, dspark_dir, sequences)
    queries = _queries(sequences)
    alone = [d.propose([q])[0] for q in queries]
    assert all(len(a.tokens) == K for a in alone) and len({a.tokens for a in alone}) > 1
    _corrupt(d, "r2", slice(LENGTHS[2], None))  # the short request's padding in the batch: never seen
    assert d.propose(queries) == alone
    assert d.propose(queries[::-1]) == alone[::-1]  # order does not matter either
    # negative control: the same noise inside a request's own rows changes its drafts (the check can fail)
    _corrupt(d, "r2", slice(0, 2))
    assert d.propose(queries)[2] != alone[2]


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_batched_sampled_proposals_equal_per_request(kind, k3, k3_dir, dspark_dir, sequences):
    d = _observed(kind, k3, k3_dir, dspark_dir, sequences, method="probabilistic")
    queries = _queries(sequences)
    alone = [d.propose([q])[0] for q in queries]
    together = d.propose(queries)
    for a, t in zip(alone, together):
        assert a.tokens == t.tokens
        torch.testing.assert_close(a.probs, t.probs, rtol=1e-4, atol=1e-6)
    # negative control: another request id draws other tokens from the same state (the draws are keyed)
    renamed = _observed(kind, k3, k3_dir, dspark_dir, [sequences[1]] * 3, method="probabilistic")
    drawn = [d.tokens for d in renamed.propose([DraftQuery(f"r{i}", sequences[1][0][: LENGTHS[0] + 1], K)
                                                for i in range(3)])]
    assert len(set(drawn)) > 1


def test_observes_of_many_requests_are_one_batched_pass(k3, k3_dir, dspark_dir, sequences, monkeypatch):
    d = _observed("mtp", k3, k3_dir, dspark_dir, sequences[:1])
    d.flush()
    calls = []
    original = d.layer.cache_rows
    monkeypatch.setattr(d.layer, "cache_rows", lambda x, p: calls.append(x.shape[0]) or original(x, p))
    for i, (ids, taps) in enumerate(sequences[1:], start=1):
        d.observe(f"r{i}", 0, ids[: LENGTHS[i]], taps["mtp"][: LENGTHS[i]])
    d.propose(_queries(sequences))
    assert calls == [LENGTHS[1] - 1 + LENGTHS[2] - 1]  # both requests' rows in one call


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_long_generation_reallocates_only_when_doubling(kind, k3, k3_dir, dspark_dir, sequences):
    d = _build(kind, k3, k3_dir, dspark_dir)
    d.cache = SlotRows(d.cache.row_shape, d.cache.dtype, d.cache.buffer.device, num_slots=1, capacity=8,
                       side_shape=tuple(d.cache.side.shape[1:]))
    ids, taps = sequences[1]
    hidden = taps[kind]
    pointers = []
    for t in range(200):  # one position per step, as a decode observes
        d.observe("r", t, [ids[t % len(ids)]], hidden[t % hidden.shape[0]][None])
        d.propose([DraftQuery("r", [ids[(t + 1) % len(ids)]] * (t + 2), K)])
        pointers.append(d.cache.buffer.data_ptr())
    changes = sum(a != b for a, b in zip(pointers, pointers[1:]))
    assert d.cache.capacity == 256 and changes == d.cache.reallocations == 5  # 8 -> 256: five doublings
    # negative control: a tensor grown by torch.cat per step (the layout before) moves every step
    grown, moved = torch.zeros(0, 4), 0
    for _ in range(20):
        before = grown.data_ptr()
        grown = torch.cat([grown, torch.ones(1, 4)])
        moved += grown.data_ptr() != before
    assert moved == 20


class _HostReads(TorchDispatchMode):
    """Counts scalar reads (`.item()`, `int(t)`) and data-dependent shapes (`nonzero`) under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_propose_reads_back_only_the_draft_ids(kind, method, k3, k3_dir, dspark_dir, sequences, monkeypatch):
    d = _observed(kind, k3, k3_dir, dspark_dir, sequences, method)
    tolist = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolist.append(tuple(t.shape)) or original(t))
    with _HostReads() as reads:
        drafts = d.propose(_queries(sequences))
    assert reads.count == 0 and tolist == [(len(LENGTHS), K)]
    assert all(dr.probs is None for dr in drafts) == (method == "greedy")
    # negative control: the per-row `pick` (an int() of each draft) is seen by the same counter
    with _HostReads() as reads:
        DraftSampler(method).pick(torch.randn(50), "r", 3)
    assert reads.count == 1


def test_exponential_race_draws_from_the_distribution():
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5, 0.0])
    n = 40_000
    seeds = _splitmix(torch.arange(n, dtype=torch.int64) * 7919 + 11)
    freq = torch.bincount(exponential_race(probs.expand(n, -1), seeds), minlength=5).double() / n
    assert (freq - probs.double()).abs().max() < 0.01 and freq[4] == 0
    # negative control: a biased race (p² instead of p) is caught by the same bound
    biased = torch.bincount(exponential_race((probs ** 2).expand(n, -1), seeds), minlength=5).double() / n
    assert (biased - probs.double()).abs().max() > 0.05


def test_sampled_pick_depends_on_request_and_position_only():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    sampler = DraftSampler("probabilistic")
    rows, _ = sampler.pick_rows(logits, ["a", "b", "c", "d"], torch.tensor([5, 6, 7, 8]))
    single = [sampler.pick(logits[i], r, p)[0] for i, (r, p) in enumerate(zip("abcd", [5, 6, 7, 8]))]
    assert rows.tolist() == single
    flat = torch.zeros(64)  # uniform logits: the draw is the key's alone
    draws = {sampler.pick(flat, "a", p)[0] for p in range(20)}
    assert len(draws) > 5  # negative control: positions give different draws


def _rows(drafter, kind, req_id):
    if kind == "dspark":
        return (drafter.context_rows(req_id),)
    return drafter.cached_rows(req_id), drafter.held_hidden(req_id)


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_queued_observes_equal_observes_computed_each_step(kind, k3, k3_dir, dspark_dir, sequences, monkeypatch):
    """Observes that queue over many steps (nothing proposes, as under a batch-size schedule's k = 0) give the
    rows (within fp32 rounding: one product over more rows) and the drafts of observes computed every step; a
    request's queue computes itself at QUEUE_ROWS positions. Negative control: one position observed with other
    hidden rows gives other rows."""
    from engine.spec import dspark, mtp

    each_step, queued, other = (_build(kind, k3, k3_dir, dspark_dir) for _ in range(3))
    flushes = []
    real_flush = queued.flush
    queued.flush = lambda: flushes.append(len(queued.queued)) or real_flush()
    for i, (ids, taps) in enumerate(sequences):
        rows = taps[kind]
        changed = rows.clone()
        changed[3] += 1.0
        for d, h in ((each_step, rows), (queued, rows), (other, changed)):
            d.observe(f"r{i}", 0, ids[:2], h[:2])
            for t in range(2, LENGTHS[i]):  # one position a step, as decoding plain
                d.observe(f"r{i}", t, ids[t: t + 1], h[t: t + 1])
                if d is each_step:
                    d.flush()
    assert flushes == [] and len(queued.queued) == len(sequences)  # every request's rows still queued
    for i in range(len(sequences)):
        got, want, changed = (_rows(d, kind, f"r{i}") for d in (queued, each_step, other))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # products over more rows: rounding
        assert not torch.allclose(changed[0], want[0], rtol=1e-5, atol=1e-5)  # the cache rows of position 3 on
    assert queued.propose(_queries(sequences)) == each_step.propose(_queries(sequences))
    monkeypatch.setattr(dspark if kind == "dspark" else mtp, "QUEUE_ROWS", 4)
    capped = _build(kind, k3, k3_dir, dspark_dir)
    ids, taps = sequences[1]
    capped.observe("r", 0, ids[:1], taps[kind][:1])
    for t in range(1, LENGTHS[1]):
        capped.observe("r", t, ids[t: t + 1], taps[kind][t: t + 1])
        waiting = capped.queued.get("r")
        assert waiting is None or len(waiting.chunks) < 4  # computed once 4 positions waited
    assert (capped.requests["r"].num_rows if kind == "mtp" else capped.requests["r"].end) > 0
