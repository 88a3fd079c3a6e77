"""What the rank-group engine tests (TP, PP, speculation under TP) run: three prompts sharing a 40-token prefix,
greedy sampling, a small cache whose blocks the prefix fills, and the tokens of `LLM` outputs."""

from __future__ import annotations

from engine.sampling import SamplingParams

PREFIX = [(31 * i + 7) % 7900 for i in range(40)]
PROMPTS = [PREFIX + [(13 * i + 2) % 7900 for i in range(5 + k)] for k in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def engine_args(collective_timeout_s: float) -> dict:
    return dict(kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=128, block_size=8,
                snapshot_interval=16, collective_timeout_s=collective_timeout_s)


def output_tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
