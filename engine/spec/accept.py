"""The accept/reject rule of speculative decoding, as pure functions of the target's and the drafter's probabilities.

Notation: the drafter proposed d tokens x_1..x_d; `p[i]` ([d+1, V]) is the target's (processed) distribution of
the token after the prefix plus x_1..x_i (row 0: after the prefix alone, row d: the bonus position); `q[i]`
([d, V]) is the distribution x_{i+1} was drawn from (None: a deterministic drafter, q one-hot at the draft, so
q(x) = 1 for the proposed x and 0 elsewhere). Every function returns `(a, y)`: the first `a` drafts are accepted
and y is the token that follows them (a correction after a rejection, or the bonus token when a == d), so a step
emits a + 1 tokens.

- `accept_greedy`: temperature 0. The target's choice is deterministic, so accept while the draft equals it.
- `accept_standard`: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Accepting x_i with
  probability min(1, p(x)/q(x)) and otherwise drawing from the normalised residual max(0, p - q) gives, for every
  token t, P(t) = q(t)·min(1, p(t)/q(t)) + (1 - Σ_s min(q(s), p(s)))·max(0, p(t) - q(t))/Σ_s max(0, p(s) - q(s))
  = min(q(t), p(t)) + max(0, p(t) - q(t)) = p(t): the emitted token is distributed exactly as the target's.
- `accept_block`: block verification (Sun et al. 2024, "Block verification accelerates speculative decoding";
  vLLM's `rejection_sample_method: block`). It judges the draft as a block: a running weight w_i = min(1,
  w_{i-1}·p_{i-1}(x_i)/q_{i-1}(x_i)) (w_0 = 1) measures how much of the joint target mass the prefix x_1..x_i keeps;
  the longest prefix is kept whose stop test passes (η_i < h_i with h_i = r_i / (r_i + 1 - w_i), r_i the mass of
  max(0, w_i·p_i - q_i); h_d = w_d), so a late good token can rescue an earlier doubtful one. The follow-up token
  comes from the residual max(0, w_a·p_a - q_a) (or p_d after the whole block). The output block has the target's
  joint distribution, and accepts at least as many tokens as `standard` in expectation.
Random numbers come only from the request's own generator (seeded requests reproduce); categorical draws use the
exponential race of engine/sampling.py (argmax of weight / Exp(1) noise), which works on unnormalised weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_choice: Sequence[int], draft: Sequence[int]) -> tuple[int, int]:
    """`target_choice[i]`: the target's argmax after the prefix + draft[:i] (len(draft) + 1 entries)."""
    a = 0
    while a < len(draft) and draft[a] == target_choice[a]:
        a += 1
    return a, int(target_choice[a])


def accept_standard(p: torch.Tensor, q: torch.Tensor | None, draft: Sequence[int],
                    generator: torch.Generator | None) -> tuple[int, int]:
    u = torch.rand(len(draft), generator=generator, device=p.device)  # [d]
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        if float(u[i]) * q_x < float(p[i, x]):  # u < p(x)/q(x): accept with probability min(1, p(x)/q(x))
            continue
        residual = (p[i] - _q_row(q, i, x, p)).clamp(min=0)  # max(0, p - q): the mass the draft under-covers
        return i, _draw(residual if float(residual.sum()) > 0 else p[i], generator)
    return len(draft), _draw(p[len(draft)], generator)  # every draft accepted: the bonus token comes from p_d


def accept_block(p: torch.Tensor, q: torch.Tensor | None, draft: Sequence[int],
                 generator: torch.Generator | None) -> tuple[int, int]:
    d = len(draft)
    eta = torch.rand(d, generator=generator, device=p.device)  # [d]
    weights = [1.0]  # w_0 = 1
    kept = 0
    for i in range(1, d + 1):
        x = draft[i - 1]
        q_x = 1.0 if q is None else float(q[i - 1, x])
        w = min(1.0, weights[-1] * float(p[i - 1, x]) / q_x)  # w_i = min(1, w_{i-1} p(x_i) / q(x_i))
        weights.append(w)
        if i < d:
            r = float((w * p[i] - _q_row(q, i, draft[i], p)).clamp(min=0).sum())  # residual mass after x_1..x_i
            h = r / (r + 1.0 - w) if r > 0 else 0.0
        else:
            h = w
        if float(eta[i - 1]) < h:
            kept = i  # the longest prefix whose stop test passes
    if kept == d:
        return d, _draw(p[d], generator)
    residual = (weights[kept] * p[kept] - _q_row(q, kept, draft[kept], p)).clamp(min=0)
    return kept, _draw(residual if float(residual.sum()) > 0 else p[kept], generator)


def accept(p: torch.Tensor, q: torch.Tensor | None, draft: Sequence[int], method: str,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Sampled verification by `method` ("standard" | "block")."""
    if method == "block":
        return accept_block(p, q, draft, generator)
    return accept_standard(p, q, draft, generator)


def _q_row(q: torch.Tensor | None, i: int, x: int, like: torch.Tensor) -> torch.Tensor:
    """q[i] as a [V] row; one-hot at the draft x when the drafter is deterministic."""
    if q is not None:
        return q[i]
    row = torch.zeros_like(like[i])
    row[x] = 1.0
    return row


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A categorical draw from non-negative weights [V] (need not sum to 1)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
