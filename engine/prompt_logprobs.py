"""Prompt logprobs (vLLM's `prompt_logprobs=k`): per prompt position, the logprob of the prompt token there.

Contract:
- A request with `params.prompt_logprobs = k` gets `Request.prompt_logprobs`: a list as long as the prompt, `None`
  first (nothing precedes the first token), then for position p a dict token id -> `Logprob(logprob, rank,
  decoded_token)` holding the prompt token `token_ids[p]` and the top k tokens: `log_softmax` in fp32 of the raw
  logits (no temperature, penalties or grammar) after `token_ids[:p]`.
- They are computed in the prefill pass itself: each prefill chunk `[start, end)` asks the runner for the logits
  at its positions `start … min(end, N - 1) - 1` (`rows_wanted`), in the same forward (chunked prefill included);
  `record` turns them into entries. No second forward.
- Cost: such a chunk's forward returns `[rows, vocab]` fp32 logits (a 2048-token chunk of a 163840-token vocabulary
  is 1.3 GiB), reduced to the top k at once; `max_forward_tokens` bounds it. Other requests pay nothing.
- The prefix cache is skipped for such requests (engine/memory/manager.py `lookup`): the cached part of a prompt
  has no logits, so the whole prompt is computed and `num_cached_tokens` is 0. A recomputation after preemption
  writes the same positions again.
"""

from __future__ import annotations

import torch

from engine.outputs import Logprob, PositionLogprobs


def wants_prompt_logprobs(req) -> bool:
    return req.params.prompt_logprobs is not None


def rows_wanted(req, start: int, num_tokens: int) -> int:
    """How many leading positions of the chunk `[start, start + num_tokens)` need logits for prompt logprobs."""
    if not wants_prompt_logprobs(req):
        return 0
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None] * req.num_prompt_tokens
    return max(0, min(start + num_tokens, req.num_prompt_tokens - 1) - start)


def record(req, start: int, logits: torch.Tensor, tokenizer) -> None:
    """Fills the entries of positions `start + 1 …` from the logits `[n, V]` at positions `start …`."""
    n = logits.shape[0]
    if n == 0:
        return
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    targets = torch.tensor(req.prompt_token_ids[start + 1: start + 1 + n], dtype=torch.long,
                           device=logprobs.device)  # [n]
    chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [n]
    k = req.params.prompt_logprobs
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)  # [n, k]

    def decode(token: int) -> str | None:
        return tokenizer.decode([token]) if tokenizer is not None else None

    for i in range(n):
        token = int(targets[i])
        entry: PositionLogprobs = {token: Logprob(float(chosen[i, 0]), int(ranks[i]), decode(token))}
        for rank in range(k):
            top = int(top_ids[i, rank])
            if top not in entry:
                entry[top] = Logprob(float(top_values[i, rank]), rank + 1, decode(top))
        req.prompt_logprobs[start + 1 + i] = entry
