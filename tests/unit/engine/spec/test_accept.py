"""The accept/reject rule is lossless: generating with speculation draws the target's own joint distribution.

A synthetic target and drafter over a tiny vocabulary (next-token tables keyed by position and previous token) are
run through `engine.spec.accept` for every method and draft kind; the empirical distribution of the first L
generated tokens over N samples is compared with the target's exact joint by total variation. A deliberately
biased rule (a rejection redraws from p instead of the residual) must fail the same
threshold: the negative control that proves the test can fail. Both forms are checked: one row at a time with a
`torch.Generator` (`accept`), and all N sequences at once (`accept_rows`, one call per round) with the engine's
counter-based noise keyed by (row seed, output position)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, categorical, row_keys, row_uniforms, spread_keys
from engine.spec import accept as acc

V, L, K, N = 3, 3, 3, 10_000
THRESHOLD = 0.035  # at N = 10k over 27 outcomes the correct rules measure 0.015-0.019, the biased one 0.22


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    target = torch.distributions.Dirichlet(torch.ones(V)).sample((L + K + 1, V + 1))  # [pos, prev, V]
    draft = torch.distributions.Dirichlet(torch.ones(V) * 0.7).sample((L + K + 1, V + 1))
    return target, draft


def _dist(table: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    prev = prefix[-1] if prefix else V  # V: no previous token
    return table[len(prefix), prev]


def _generate(target, draft, method, one_hot, gen, rule) -> tuple[int, ...]:
    out: list[int] = []
    while len(out) < L:
        tokens, q_rows = [], []
        for _ in range(K):
            q = _dist(draft, out + tokens)
            x = int(q.argmax()) if one_hot else int(torch.multinomial(q, 1, generator=gen))
            tokens.append(x)
            q_rows.append(q)
        p = torch.stack([_dist(target, out + tokens[:i]) for i in range(K + 1)])  # [K+1, V]
        a, y = rule(p, None if one_hot else torch.stack(q_rows), tokens, method, gen)
        out.extend(tokens[:a] + [y])
    return tuple(out[:L])


def _exact_joint(target) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=L):
        prob = 1.0
        for i, t in enumerate(seq):
            prob *= float(_dist(target, list(seq[:i]))[t])
        joint[seq] = prob
    return joint


def _tv(rule, method: str, one_hot: bool, seed: int = 0) -> float:
    target, draft = _tables(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N):
        seq = _generate(target, draft, method, one_hot, gen, rule)
        counts[seq] = counts.get(seq, 0) + 1
    return _distance(counts, target)


def _distance(counts: dict[tuple[int, ...], int], target) -> float:
    """Total variation between the empirical joint of N sequences and the target's exact one."""
    return 0.5 * sum(abs(counts.get(s, 0) / N - p) for s, p in _exact_joint(target).items())


def _biased(p, q, draft, method, gen):
    """Standard acceptance, but a rejected position redraws from p instead of the residual max(0, p - q): the
    classic bug (the drafted token is then over-represented)."""
    u = torch.rand(len(draft), generator=gen)
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        if float(u[i]) * q_x < float(p[i, x]):
            continue
        return i, acc._draw(p[i], gen)
    return len(draft), acc._draw(p[len(draft)], gen)


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("one_hot", [True, False])
@pytest.mark.parametrize("rows_at_once", [False, True], ids=["one-row", "rows-at-once"])
def test_speculative_sampling_keeps_the_target_distribution(method, one_hot, rows_at_once):
    tv, rule = (_tv_rows, acc.accept_rows) if rows_at_once else (_tv, acc.accept)
    assert tv(rule, method, one_hot) < THRESHOLD


@pytest.mark.parametrize("rows_at_once", [False, True], ids=["one-row", "rows-at-once"])
def test_a_biased_acceptance_rule_fails_the_same_threshold(rows_at_once):
    tv, rule = (_tv_rows, _biased_rows) if rows_at_once else (_tv, _biased)
    assert tv(rule, "standard", one_hot=False) > THRESHOLD


def test_greedy_accepts_the_matching_prefix():
    assert acc.accept_greedy([5, 6, 7, 8], [5, 6, 9]) == (2, 7)
    assert acc.accept_greedy([5, 6, 7, 8], [5, 6, 7]) == (3, 8)
    assert acc.accept_greedy([4, 6], [5]) == (0, 4)
    assert acc.accept_greedy([4], []) == (0, 4)


@pytest.mark.parametrize("method", ["standard", "block"])
def test_a_certain_target_accepts_its_own_tokens_and_rejects_others(method):
    p = torch.zeros(4, V)
    p[:, 1] = 1.0  # the target always says 1
    gen = torch.Generator().manual_seed(0)
    assert acc.accept(p, None, [1, 1, 1], method, gen) == (3, 1)
    assert acc.accept(p, None, [1, 2, 1], method, gen) == (1, 1)
    assert acc.accept(p, None, [0, 1, 1], method, gen) == (0, 1)


# -- all rows at once, with the engine's counter-based noise ------------------------------------------------------

def _tv_rows(rule, method: str, one_hot: bool, seed: int = 0) -> float:
    """N sequences generated together, one `accept_rows`-shaped call per round for every row; the uniforms and
    draws come from engine/sampling.py's noise keyed by (row seed, output position)."""
    target, draft = _tables(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    seeds = torch.arange(N, dtype=torch.long) * 7919 + seed
    outs: list[list[int]] = [[] for _ in range(N)]
    live = list(range(N))
    while live:
        rows = torch.tensor(live)
        pos = torch.tensor([len(outs[r]) for r in live])  # [B]
        prev = torch.tensor([outs[r][-1] if outs[r] else V for r in live])  # [B]
        tokens, q_rows, p_rows = [], [], [target[pos, prev]]
        for j in range(K):
            q = draft[pos + j, prev]  # [B, V]
            x = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen)[:, 0]
            tokens.append(x)
            q_rows.append(q)
            prev = x
            p_rows.append(target[pos + j + 1, x])
        drafts = torch.stack(tokens, 1)  # [B, K]
        uniforms = row_uniforms(spread_keys(row_keys(seeds[rows], pos, STREAM_ACCEPT), K))  # [B, K]

        def draw(weights, at):
            return categorical(weights, row_keys(seeds[rows], pos + at, STREAM_RESIDUAL))

        a, y = rule(torch.stack(p_rows, 1), None if one_hot else torch.stack(q_rows, 1), drafts,
                    torch.full((len(live),), K), method, uniforms, draw)
        for b, r in enumerate(live):
            outs[r].extend(drafts[b, : int(a[b])].tolist() + [int(y[b])])
        live = [r for r in live if len(outs[r]) < L]
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        counts[tuple(out[:L])] = counts.get(tuple(out[:L]), 0) + 1
    return _distance(counts, target)


def _biased_rows(p, q, draft, num_drafts, method, uniforms, draw):
    """`standard` over rows, but a rejection redraws from p instead of the residual (the classic bug)."""
    q_x = 1.0 if q is None else q.gather(2, draft[:, :, None])[:, :, 0]
    p_x = p[:, :-1].gather(2, draft[:, :, None])[:, :, 0]
    a = (uniforms * q_x < p_x).long().cumprod(1).sum(1)
    return a, draw(p.gather(1, a[:, None, None].expand(-1, 1, p.shape[2]))[:, 0], a)


def test_rows_of_different_draft_lengths_are_judged_alone():
    """Padding past a row's drafts never changes it: each row in a batch == the same row alone."""
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(5, 4, V), -1)  # [B, D+1, V]
    q = torch.softmax(torch.randn(5, 3, V), -1)
    draft = torch.randint(0, V, (5, 3))
    num = torch.tensor([3, 1, 2, 3, 1])
    uniforms = torch.rand(5, 3)

    def draw(weights, at):
        return weights.argmax(-1) * 10 + at  # deterministic: shows which row and position were drawn from

    for method in ("standard", "block"):
        a, y = acc.accept_rows(p, q, draft, num, method, uniforms, draw)
        for b in range(5):
            d = int(num[b])
            a1, y1 = acc.accept_rows(p[b:b + 1, :d + 1], q[b:b + 1, :d], draft[b:b + 1, :d], num[b:b + 1], method,
                                     uniforms[b:b + 1, :d], draw)
            assert (int(a[b]), int(y[b])) == (int(a1), int(y1))
        assert (a <= num).all()
    greedy_a, greedy_y = acc.accept_greedy_rows(torch.tensor([[5, 6, 7, 8], [4, 6, 0, 0]]),
                                                torch.tensor([[5, 6, 9], [4, 6, 0]]), torch.tensor([3, 1]))
    assert greedy_a.tolist() == [2, 1] and greedy_y.tolist() == [7, 6]  # row 1: its one draft, then the target's
