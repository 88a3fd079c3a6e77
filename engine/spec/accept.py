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
All three run over a batch of verifying rows at once, as tensor ops with no read-back (`accept_greedy_rows`,
`accept_rows`: drafts padded to the longest, `num_drafts` per row; a loop over draft positions, never over rows).
Their randomness is passed in: uniforms `[B, D]` and a categorical `draw(weights [B, V], at [B]) -> ids [B]` on
unnormalised weights (the engine's: engine/sampling.py's counter-based uniforms keyed by the request's seed and
output position, and its inverse-CDF `categorical`, so seeded requests reproduce).
`accept(p, q, draft, method, generator)` and `accept_greedy(choice, draft)` are the one-row forms (a
`torch.Generator`'s numbers, draws by the exponential race: argmax of weight / Exp(1) noise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Draw = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (weights [B, V], position index [B]) -> ids [B]


def accept_greedy_rows(choice: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """choice [B, D+1]: the target's argmax after the prefix + draft[:i]; draft [B, D] -> (accepted [B], the
    token after them [B])."""
    valid = torch.arange(draft.shape[1], device=draft.device)[None, :] < num_drafts[:, None]  # [B, D]
    a = ((draft == choice[:, :-1]) & valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    return a, choice.gather(1, a[:, None])[:, 0]


def accept_rows(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, num_drafts: torch.Tensor, method: str,
                uniforms: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled verification of B rows by `method` ("standard" | "block"): p [B, D+1, V] the target's
    probabilities, q [B, D, V] or None (one-hot drafts), draft [B, D] (entries past `num_drafts` [B] are ignored,
    any valid id), uniforms [B, D] in (0, 1) -> (accepted [B], the token after them [B])."""
    B, D = draft.shape
    valid = torch.arange(D, device=draft.device)[None, :] < num_drafts[:, None]  # [B, D]
    p_x = p[:, :D].gather(2, draft[:, :, None])[:, :, 0]  # [B, D] p_i(x_{i+1})
    q_x = torch.ones_like(p_x) if q is None else torch.where(valid, q.gather(2, draft[:, :, None])[:, :, 0], 1.0)
    if method == "block":
        a, w_a = _block_kept(p, q, draft, num_drafts, valid, p_x, q_x, uniforms)
    else:
        a = ((uniforms * q_x < p_x) & valid).long().cumprod(dim=1).sum(dim=1)  # u < p(x)/q(x)
        w_a = torch.ones(B, dtype=p.dtype, device=p.device)
    p_a = _at(p, a)  # [B, V]
    rejected = a < num_drafts
    residual = (w_a[:, None] * p_a - _q_rows(q, draft, a.clamp(max=D - 1), p_a)).clamp(min=0)  # [B, V]
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    return a, draw(torch.where(use_residual[:, None], residual, p_a), a)


def _block_kept(p, q, draft, num_drafts, valid, p_x, q_x, eta) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's kept prefix length [B] and its weight w_kept [B] (see the module docstring)."""
    B, D = draft.shape
    w = torch.ones(B, dtype=p.dtype, device=p.device)
    weights, kept = [w], torch.zeros(B, dtype=torch.long, device=p.device)
    for i in range(1, D + 1):
        w = torch.clamp(w * p_x[:, i - 1] / q_x[:, i - 1], max=1.0)  # w_i = min(1, w_{i-1} p(x_i) / q(x_i))
        weights.append(w)
        if i < D:
            nxt = torch.full((B,), i, dtype=torch.long, device=p.device)
            r = (w[:, None] * p[:, i] - _q_rows(q, draft, nxt, p[:, i])).clamp(min=0).sum(dim=-1)  # residual mass
            h = torch.where(r > 0, r / (r + 1.0 - w), 0.0)
            h = torch.where(num_drafts == i, w, h)
        else:
            h = w
        passed = (eta[:, i - 1] < h) & valid[:, i - 1]
        kept = torch.where(passed, i, kept)  # the longest prefix whose stop test passes
    return kept, torch.stack(weights, dim=1).gather(1, kept[:, None])[:, 0]


def _at(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, N, V], index [B] -> t[b, index[b]] [B, V]."""
    return t.gather(1, index[:, None, None].expand(-1, 1, t.shape[2]))[:, 0]


def _q_rows(q: torch.Tensor | None, draft: torch.Tensor, at: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q[b, at[b]] as [B, V] rows; one-hot at the draft there when the drafter is deterministic."""
    if q is not None:
        return _at(q, at)
    x = draft.gather(1, at[:, None])  # [B, 1]
    return torch.zeros_like(like).scatter(1, x, 1.0)


# -- one row, a torch.Generator's numbers ---------------------------------------------------------------------


def accept_greedy(target_choice: Sequence[int], draft: Sequence[int]) -> tuple[int, int]:
    """`target_choice[i]`: the target's argmax after the prefix + draft[:i] (len(draft) + 1 entries)."""
    a, y = accept_greedy_rows(torch.tensor([list(target_choice)]), torch.tensor([list(draft)], dtype=torch.long),
                              torch.tensor([len(draft)]))
    return int(a), int(y)


def accept(p: torch.Tensor, q: torch.Tensor | None, draft: Sequence[int], method: str,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Sampled verification of one row by `method`: p [d+1, V], q [d, V] or None."""
    d = len(draft)
    uniforms = torch.rand(1, d, generator=generator, device=p.device)  # [1, d]
    a, y = accept_rows(p[None], None if q is None else q[None], torch.tensor([list(draft)], device=p.device),
                       torch.tensor([d], device=p.device), method, uniforms,
                       lambda weights, _: torch.tensor([_draw(weights[0], generator)]))
    return int(a), int(y)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A categorical draw from non-negative weights [V] (need not sum to 1)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
