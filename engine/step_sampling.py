"""The step's sampling: every logits row of a step sampled and verified at once on the device, one read-back.

Contract:
- `StepSampler.sample(logits [R, V] fp32, chunks)`: `chunks` are the step's chunks that need logits, in the
  runner's row order (a plain chunk owns one row, a verification `1 + len(draft)`). Every row is one `SampleRow`
  (engine/sampling.py): a plain chunk's row samples its request's next output position; verification row i is
  the request's output position `num_output_tokens + i`, its penalties counting the drafts before it and its
  min_tokens suppression as if they were accepted. All rows are processed and picked by the same tensor ops; the
  verifications are then accepted together (engine/spec/accept.py: greedy rows by `accept_greedy_rows`, sampled
  rows by `accept_rows` with the request's counter-based noise: stream ACCEPT keyed by the verification's first
  output position for its uniforms, RESIDUAL at the follow-up token's position for its draw; no number is ever used
  by two verifications of a request). Logprobs (when any row asks) are of the raw logits.
- Exactly one device -> host transfer per call (`read_back`): the ids of every row (a verification's rows hold its
  accepted drafts then the token after them), the accepted counts, the logprobs. What depends on those values
  (a row finished, a stop id) is decided on the host afterwards.
- Returns, per chunk, the tokens it emits (`SampleResult`s: one, or a verification's a accepted drafts and the token
  after them) and, per chunk, (drafts verified, drafts accepted) with 0 drafts for a plain chunk.
- A chunk's request gives: `params`, `prompt_token_ids`, `output_token_ids`, `num_output_tokens`, `seed`, the stop
  ids `output.stop_ids`, `grammar` (a request with a grammar never verifies and is not suppressed by min_tokens)
  and `draft.probs` (the drafter's distribution, None for one-hot drafts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import (
    STREAM_ACCEPT, STREAM_RESIDUAL, DeviceSample, RowBatch, SampleResult, SampleRow, Sampler, categorical,
    logprob_fields, read_back, row_keys, row_uniforms, spread_keys, upload)
from engine.spec.accept import accept_greedy_rows, accept_rows


@dataclass
class StepSample:
    """Host results of one step's sampling, per chunk that needed logits (in the order given)."""

    tokens: list[list[SampleResult]]
    verified: list[tuple[int, int]]  # (drafts, accepted); (0, 0) for a plain chunk


class StepSampler:
    def __init__(self, rejection_sample_method: str = "standard"):
        self.method = rejection_sample_method
        self.sampler = Sampler()

    def sample(self, logits: torch.Tensor, chunks: Sequence) -> StepSample:
        rows = [row for c in chunks for row in _rows(c.req, c.draft)]
        assert logits.shape[0] == len(rows), "one logits row per sampled position"
        if not rows:
            return StepSample([], [])
        batch = RowBatch.build(rows, logits.device)
        x, tokens = self.sampler.process_and_pick(logits, rows, batch)  # [R, V], [R]
        verifying = [i for i, c in enumerate(chunks) if c.draft]
        firsts = _firsts(chunks)
        accepted = None
        if verifying:
            tokens, accepted = self._verify(x, tokens, [chunks[i] for i in verifying],
                                            [firsts[i] for i in verifying], batch)
        picked = DeviceSample(tokens) if batch.logprobs_k is None else \
            logprob_fields(logits, tokens, batch.logprobs_k)
        host = read_back(picked.tensors() + ([accepted] if accepted is not None else []))  # the one read-back
        a_host = [int(a) for a in host.pop()] if accepted is not None else []
        results = picked.to_results(host, batch.logprobs, batch.logprobs_k)
        return self._per_chunk(chunks, firsts, results, dict(zip(verifying, a_host)))

    def _verify(self, x: torch.Tensor, tokens: torch.Tensor, chunks: Sequence, firsts: Sequence[int],
                batch: RowBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The verifying chunks' rows accepted at once -> (ids [R] with each verification's accepted drafts and
        follow-up token in its rows, accepted counts [B])."""
        device = x.device
        lengths = [len(c.draft) for c in chunks]
        D = max(lengths)
        index = upload([[f + min(j, d) for j in range(D + 1)] for f, d in zip(firsts, lengths)], torch.long,
                       device)  # [B, D+1] the rows of each verification (its last repeated as padding)
        draft = upload([list(c.draft) + [0] * (D - len(c.draft)) for c in chunks], torch.long, device)  # [B, D]
        num_drafts = upload(lengths, torch.long, device)  # [B]
        greedy = [c.req.params.greedy for c in chunks]
        if all(greedy):
            a, y = accept_greedy_rows(tokens[index], draft, num_drafts)
        else:
            a, y = self._accept_sampled(x, index, draft, num_drafts, chunks, batch, firsts)
            if any(greedy):
                a_g, y_g = accept_greedy_rows(tokens[index], draft, num_drafts)
                is_greedy = upload(greedy, torch.bool, device)
                a, y = torch.where(is_greedy, a_g, a), torch.where(is_greedy, y_g, y)
        positions = torch.arange(D + 1, device=device)[None, :]  # [1, D+1]
        emitted = torch.where(positions < a[:, None], torch.cat([draft, draft[:, :1]], dim=1), y[:, None])
        rows = [(b, j) for b, d in enumerate(lengths) for j in range(d + 1)]
        at = upload([[b, j, firsts[b] + j] for b, j in rows], torch.long, device)  # [n, 3]
        tokens = tokens.clone()
        tokens[at[:, 2]] = emitted[at[:, 0], at[:, 1]]
        return tokens, a

    def _accept_sampled(self, x, index, draft, num_drafts, chunks, batch: RowBatch, firsts):
        B, D = draft.shape
        p = torch.softmax(x, dim=-1)[index]  # [B, D+1, V]
        q = _draft_probs(chunks, D, p.shape[-1], p.device)  # [B, D, V] or None
        seeds = batch.seeds[upload(list(firsts), torch.long, x.device)]  # [B]
        starts = batch.positions[upload(list(firsts), torch.long, x.device)]  # [B] output position of row 0
        # keyed by the verification's first position: a later verification (which starts past this one's accepted
        # tokens) never reuses a uniform this one looked at (block verification looks at all of them)
        uniforms = row_uniforms(spread_keys(row_keys(seeds, starts, STREAM_ACCEPT), D))  # [B, D]

        def draw(weights: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
            return categorical(weights, row_keys(seeds, starts + at, STREAM_RESIDUAL))

        return accept_rows(p, q, draft, num_drafts, self.method, uniforms, draw)

    @staticmethod
    def _per_chunk(chunks, firsts, results: list[SampleResult], accepted: dict[int, int]) -> StepSample:
        tokens, verified = [], []
        for i, c in enumerate(chunks):
            a = accepted.get(i, 0)
            tokens.append(results[firsts[i]: firsts[i] + a + 1])
            verified.append((len(c.draft), a))
        return StepSample(tokens, verified)


def _rows(req, draft: tuple[int, ...]) -> list[SampleRow]:
    """The sampler's view of a chunk's positions: one row, or one per verified position (the output so far plus
    the drafts before it)."""
    p = req.params
    n_out = req.num_output_tokens
    output = req.output_token_ids if p.has_penalties else None
    suppressible = req.grammar is None
    return [SampleRow(p, req.prompt_token_ids, output + list(draft[:i]) if output is not None else (),
                      req.seed, tuple(req.output.stop_ids) if suppressible and n_out + i < p.min_tokens else (),
                      n_out + i)
            for i in range(len(draft) + 1)]


def _firsts(chunks) -> list[int]:
    firsts, at = [], 0
    for c in chunks:
        firsts.append(at)
        at += 1 + len(c.draft)
    return firsts


def _draft_probs(chunks, D: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """The drafters' distributions [B, D, V] (one-hot rows for a deterministic draft); None when every draft is."""
    if all(c.req.draft is None or c.req.draft.probs is None for c in chunks):
        return None
    q = torch.zeros(len(chunks), D, vocab, device=device)
    for b, c in enumerate(chunks):
        probs = c.req.draft.probs if c.req.draft is not None else None
        d = len(c.draft)
        if probs is not None:
            q[b, :d] = probs[:d].to(device, torch.float32)
        else:
            q[b, torch.arange(d), torch.tensor(c.draft)] = 1.0
    return q
