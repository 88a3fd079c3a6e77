"""Split-KV decode attention: merging per-split partial results, and choosing the number of splits.

Contract:
- A decode query's context is cut into S splits; split s yields a partial output `o[s]` (its softmax-normalised
  attention over that split's keys only, fp32) and `lse[s]`, the log-sum-exp of that split's scaled scores (fp32;
  `-inf` for a split that holds no key of the row — its `o[s]` is then ignored, whatever it holds).
- `merge_partials(o [S, N, H, V], lse [S, N, H]) -> [N, H, V] fp32` returns the attention over the whole context:
  `sum_s exp(lse[s] - L) * o[s]` with `L = logsumexp_s lse[s]`. Torch ops only, no host read (it runs inside
  compiled and captured steps). A row whose splits are all empty gives zeros.
- `choose_num_splits(context_capacity, programs, ...)`: how many splits a decode batch gets, from shapes only (the
  block table's width times the block size bounds every context; `programs` is how many programs the batch fills
  without splitting), so the choice is the same for every replay of a captured bucket.
The naive reference is `kernels.attention.naive.merge_partials_naive`; the torch decode path
(`kernels.attention.torch_paged`) and the Triton one (`kernels.attention.triton_paged`) both merge through here.
"""

from __future__ import annotations

import torch

TARGET_PROGRAMS = 264  # programs that keep a GPU busy (≈ 2 per SM on a 132-SM part)
MIN_SPLIT_KEYS = 512  # keys a split walks at least: below this the merge costs more than the split saves
MAX_SPLITS = 64  # partial buffers are sized for this many splits at most


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [S, N, H, V], lse [S, N, H] fp32 -> [N, H, V] fp32 (see the module docstring)."""
    top = lse.amax(0)  # [N, H]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows with no key at all
    weight = torch.exp(lse - top)  # [S, N, H]; 0 for empty splits
    used = (weight > 0)[..., None]  # [S, N, H, 1]
    parts = torch.where(used, o.to(torch.float32), 0.0) * weight[..., None]  # [S, N, H, V]; ignores empty splits
    total = weight.sum(0)[..., None]  # [N, H, 1]
    return parts.sum(0) / torch.where(total > 0, total, 1.0)


def choose_num_splits(context_capacity: int, programs: int, target_programs: int = TARGET_PROGRAMS,
                      min_split_keys: int = MIN_SPLIT_KEYS, max_splits: int = MAX_SPLITS) -> int:
    """Splits for a decode batch: enough to fill `target_programs` (few sequences at long context get many), but
    no split shorter than `min_split_keys` keys of `context_capacity` and at most `max_splits`. Host ints only."""
    wanted = -(-target_programs // max(programs, 1))
    by_length = max(1, context_capacity // min_split_keys)
    return max(1, min(wanted, by_length, max_splits))


def merge_partials_lse(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [S, N, H, V], lse [S, N, H] -> (merged o [N, H, V] fp32, its lse [N, H] fp32 = logsumexp_s lse[s]; -inf
    where every split is empty). The merged pair is itself a partial that can be merged again (decode-context
    parallelism merges each rank's split-KV result across ranks: engine/parallel/context.py)."""
    top = lse.amax(0)  # [N, H]
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp(lse - safe).sum(0)  # [N, H]
    return merge_partials(o, lse), torch.log(total).add_(safe)  # log(0) = -inf for rows with no key
