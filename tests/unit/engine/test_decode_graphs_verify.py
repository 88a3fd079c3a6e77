"""Speculative verification steps compiled by inductor on CPU (engine/decode_graphs.py: Q = k + 1 tokens a row,
the cache ops' verify forms inline, kernels/graph_ops.py).

- A scripted drafter proposes the plain greedy continuation, wrong at one position every third step, so steps
  accept all drafts, some, or none: speculative compiled == speculative eager == plain eager (greedy tokens;
  logprobs within 1e-4), one prompt and a batch padding the bucket of 4, on tiny-k3 (KDA and MLA layers); the
  full verification steps (k drafts a row) ran compiled (counted), shorter ones near `max_tokens` eager, without a
  graph break.
- Negative control: the same compiled steps with every kept state sent to the scratch slot (the settled state a
  lost out-slot write leaves) change the output.
inductor builds C++ for each graph (tens of seconds on two cores): one bucket, decode and verify.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import decode_graphs
from engine.spec.drafter import Draft, Drafter
from tests.unit.engine.conftest import random_prompts
from tests.unit.engine.test_decode_graphs import assert_same, generate
from tests.unit.engine.test_decode_graphs_inline import INDUCTOR

K = 3
PARAMS = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
SPEC = {"method": "ngram", "num_speculative_tokens": K}  # its drafter is replaced by the scripted one


class ScriptedDrafter(Drafter):
    """Proposes each prompt's known greedy continuation, with the second draft wrong every third position."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        self.answers, self.vocab = answers, vocab

    def propose(self, queries):
        return [self._draft(list(q.token_ids), q.num_tokens) for q in queries]

    def _draft(self, tokens: list[int], n: int) -> Draft:
        prompt = next(p for p in self.answers if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)  # outputs so far (the last is the step's input)
        draft = self.answers[prompt][done: done + n]
        if done % 3 == 1 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % self.vocab
        return Draft(tuple(draft))


@pytest.fixture(scope="module")
def engines(tiny_k3_dir):
    def make(**kw):
        return LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, speculative_config=SPEC, **kw)
    return LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True), \
        make(enforce_eager=True), make(compilation_config=INDUCTOR)


def script(llms, prompts, plain) -> None:
    answers = {tuple(p): tokens for p, (tokens, _) in zip(prompts, plain)}
    for llm in llms:
        llm.engine.spec.drafter = ScriptedDrafter(answers, llm.engine.config.vocab_size)


def verify_rows_run(graphs, monkeypatch) -> list[int]:
    seen, real = [], graphs.run

    def counting(rows):
        seen.append(rows.tokens_per_row)
        return real(rows)

    monkeypatch.setattr(graphs, "run", counting)
    return seen


def test_compiled_verification_equals_eager(engines, monkeypatch):
    plain, spec_eager, spec_compiled = engines
    graphs = spec_compiled.engine.runner.runner.graphs
    assert graphs.verify_tokens == K + 1
    seen = verify_rows_run(graphs, monkeypatch)
    torch._dynamo.utils.counters.clear()
    for prompts in (random_prompts(1, 20, 21, seed=41), random_prompts(3, 12, 30, seed=43)):
        want = generate(plain, prompts, PARAMS)
        script([spec_eager, spec_compiled], prompts, want)
        assert_same(generate(spec_eager, prompts, PARAMS), want)
        assert_same(generate(spec_compiled, prompts, PARAMS), want)
    assert seen.count(K + 1) >= 6, seen  # verification steps ran compiled
    assert set(seen) == {1, K + 1}, seen  # only full verifications: shorter ones are not compiled
    accepted = spec_compiled.engine.stats().spec_num_accepted_tokens
    assert 0 < accepted < spec_compiled.engine.stats().spec_num_draft_tokens  # some drafts accepted, some not
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compiled_verification_with_its_kept_states_lost_differs(engines, monkeypatch):
    """Negative control: every kept state sent to the scratch slot (-1) changes the output."""
    plain, _, spec_compiled = engines
    real = decode_graphs.DecodeRows.of

    def losing(pieces, block_size):
        rows = real(pieces, block_size)
        if rows.tokens_per_row == 1:
            return rows
        return decode_graphs.DecodeRows(rows.ids, rows.seq_lens, rows.slot_mapping, rows.state_slots,
                                        rows.block_tables, [-1] * len(rows.out_slots), rows.tokens_per_row)

    monkeypatch.setattr(decode_graphs.DecodeRows, "of", staticmethod(losing))
    prompts = random_prompts(1, 20, 21, seed=47)
    want = generate(plain, prompts, PARAMS)
    script([spec_compiled], prompts, want)
    got = generate(spec_compiled, prompts, PARAMS)
    assert [t for t, _ in got] != [t for t, _ in want] or not torch.allclose(
        torch.tensor(got[0][1]), torch.tensor(want[0][1]), atol=1e-4)
