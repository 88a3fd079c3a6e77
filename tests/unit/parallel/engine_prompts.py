"""What the rank-group engine tests (TP, PP, DCP, speculation under TP) run: three prompts sharing a 40-token
prefix, greedy sampling, a small cache whose blocks the prefix fills, the tokens and logprobs of `LLM` outputs, and
a streamed handoff's import (`stream_in`)."""

from __future__ import annotations

from engine.sampling import SamplingParams
from engine.transfer import lean_handoff

PREFIX = [(31 * i + 7) % 7900 for i in range(40)]
PROMPTS = [PREFIX + [(13 * i + 2) % 7900 for i in range(5 + k)] for k in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def engine_args(collective_timeout_s: float) -> dict:
    return dict(kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=128, block_size=8,
                snapshot_interval=16, collective_timeout_s=collective_timeout_s)


def output_tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def output_logprobs(outputs) -> list[float]:
    return [lp.logprob for o in outputs for pos in o.outputs[0].logprobs for lp in pos.values()]


def stream_in(llm, state, params: SamplingParams, zero_blocks: bool = False):
    """A streamed handoff's import (worker/handoff_fetch.py) through the engine API: the state's full blocks into
    an emptied prefix cache one block per call (a rank-group command: every rank or stage writes its share of the
    DCP-independent layout), then the lean state -> the outputs. `zero_blocks`: the negative control's blocks."""
    llm.engine.reset_prefix_cache()
    for i, h in enumerate(state.block_hashes):
        kv = state.kv[:, i:i + 1]
        assert llm.engine.exchange.import_block_tensors([h], kv * 0 if zero_blocks else kv) == 1
    outs = llm.resume([lean_handoff(state)], params, lean=True)
    assert llm.engine.scheduler.num_import_recomputes == 0
    return outs
