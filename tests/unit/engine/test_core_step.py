"""`EngineCore.step` as schedule -> execute -> update: executing a scheduled batch reads the requests and changes
none of them (tokens, progress, cache holdings, outputs); `update_from_output` alone applies the result. Checked on
a batch mixing prefill chunks, greedy and sampled decodes and n-gram verifications; the negative control is the
update itself, which does change what execute left alone."""

from __future__ import annotations

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.unit.engine.conftest import random_prompts


def _fingerprint(engine) -> list[tuple]:
    return [(r.request_id, tuple(r.token_ids), r.num_computed_tokens, tuple(r.block_ids), r.slot_offset, r.status,
             tuple(r.output.token_ids), r.draft) for r in engine._requests.values()]


def test_execute_changes_no_request_and_update_applies_the_result(tiny_k3_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = LLM(tiny_k3_dir, max_num_seqs=6, kv_cache_memory="32MiB", max_num_batched_tokens=48,
                 speculative_config=spec).engine
    repeat = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=-2.0)  # drafts
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(6, 8, 40, seed=11)):
        engine.add_request(str(i), prompt, repeat if i % 2 else sampled)
    kinds = set()
    for _ in range(12):
        out = engine._schedule()
        kinds |= {"verify" if c.draft else "decode" if c.num_tokens == 1 else "prefill" for c in out.chunks}
        before = _fingerprint(engine)
        result = engine._execute(out)
        assert _fingerprint(engine) == before  # execute reads the batch, changes nothing
        engine.update_from_output(out, result)
        assert _fingerprint(engine) != before  # negative control: the update is where things change
        engine._collect_outputs()
        engine.check_integrity()
    assert kinds == {"prefill", "decode", "verify"}
