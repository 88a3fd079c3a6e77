"""The compiled decode step (engine/decode_graphs.py, `--compilation-config`, `--enforce-eager`).

- compiled == eager: greedy tokens token for token and logprobs within 1e-4, on both families, one prompt and a
  batch that pads a bucket (3 rows in the bucket of 4), with prefix-cache hits and with n-gram speculation; the
  negative control feeds the compiled step one position off and must change the output;
- the compiled step really runs (its step counter moves, the traced graph has no graph break) and `enforce_eager`
  really runs eager (no decode graphs at all); the CPU default is eager;
- `CompilationConfig` takes vLLM's field names and refuses unknown ones by name.
The compiled runs use torch.compile's `aot_eager` backend: the same tracing (Dynamo, AOTAutograd, the custom ops'
fake kernels) as inductor without its C++ build, which takes minutes on two cores; bench/bench_decode_step.py
times inductor.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compilation import CompilationConfig
from engine.decode_graphs import DecodeRows
from engine.errors import EngineConfigError
from tests.unit.engine.conftest import random_prompts

COMPILED = {"level": 3, "backend": "aot_eager", "cudagraph_capture_sizes": [1, 4]}
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, check_integrity=True)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_same(got, want):
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def engines(model_dir, **kwargs):
    eager = LLM(model_dir, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True, **kwargs)
    compiled = LLM(model_dir, kv_cache_memory=8 << 20, max_num_seqs=4, compilation_config=COMPILED, **kwargs)
    return eager, compiled


@pytest.fixture(scope="module", params=["tiny_linear_dir", "tiny_k3_dir"])
def pair(request):
    return engines(request.getfixturevalue(request.param))


def test_compiled_equals_eager(pair):
    eager, compiled = pair
    torch._dynamo.utils.counters.clear()
    prompts = random_prompts(3, 5, 40, seed=7)
    runs_before = compiled.engine.runner.runner.graphs.num_runs
    assert_same(generate(compiled, prompts[:1]), generate(eager, prompts[:1]))
    assert_same(generate(compiled, prompts), generate(eager, prompts))  # 3 rows pad the bucket of 4
    assert compiled.engine.runner.runner.graphs.num_runs - runs_before >= 2 * (PARAMS.max_tokens - 1)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compiled_equals_eager_with_prefix_hits(pair):
    eager, compiled = pair
    shared = random_prompts(1, 40, 41, seed=11)[0]
    prompts = [shared + [5, 6], shared + [7, 8, 9]]
    first = generate(compiled, prompts[:1])
    hit = generate(compiled, prompts[1:])
    assert compiled.engine.manager.hit_tokens > 0
    assert_same(first + hit, generate(eager, prompts))


def test_compiled_off_by_one_differs(monkeypatch, pair):
    """Negative control: a compiled step fed each row's context one position short gives other tokens."""
    eager, compiled = pair
    prompt = random_prompts(1, 20, 21, seed=13)
    want = generate(eager, prompt)
    real = DecodeRows.of

    def shifted(pieces, block_size):
        rows = real(pieces, block_size)
        return DecodeRows(rows.ids, [max(1, n - 1) for n in rows.seq_lens], rows.slot_mapping, rows.state_slots,
                          rows.block_tables)

    monkeypatch.setattr(DecodeRows, "of", staticmethod(shifted))
    got = generate(compiled, prompt)
    assert [t for t, _ in got] != [t for t, _ in want] or not torch.allclose(torch.tensor(got[0][1]),
                                                                             torch.tensor(want[0][1]), atol=1e-4)


def test_compiled_speculation_equals_plain(tiny_k3_dir):
    spec = LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, compilation_config=COMPILED,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2})
    plain = LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True)
    prompts = [p * 3 for p in random_prompts(2, 4, 6, seed=5)]
    # frequency_penalty -2 makes greedy output repeat itself, so prompt lookup proposes (and verifies) drafts
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=-2.0)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert spec.engine.spec.num_drafts > 0 and spec.engine.runner.runner.graphs.num_runs > 0


def test_enforce_eager_and_cpu_default_run_eager(tiny_linear_dir):
    forced = LLM(tiny_linear_dir, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True,
                 compilation_config=COMPILED)
    default = LLM(tiny_linear_dir, kv_cache_memory=8 << 20, max_num_seqs=4)
    assert forced.engine.runner.runner.graphs is None
    assert default.engine.runner.runner.graphs is None  # CPU: eager unless a level asks for compilation
    generate(forced, random_prompts(1, 5, 6))


def test_compilation_config_fields():
    config = CompilationConfig.parse('{"mode": 3, "cudagraph_capture_sizes": [1, 2, 8], "backend": "eager"}')
    assert config.level == 3 and config.bucket_sizes(4) == (1, 2)
    assert CompilationConfig.parse(None).bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert CompilationConfig().compiles("cuda") and not CompilationConfig().compiles("cpu")
    with pytest.raises(EngineConfigError, match="cudagraph_sizes"):
        CompilationConfig.parse({"cudagraph_sizes": [1]})
    with pytest.raises(EngineConfigError, match="cudagraph_mode"):
        CompilationConfig.parse({"cudagraph_mode": "PIECEWISE_ALL"})
    with pytest.raises(EngineConfigError, match="level"):
        CompilationConfig.parse({"level": 7})
    assert CompilationConfig().inductor_options("cpu") == {"cpp_wrapper": True, "freezing": True,
                                                           "cpp.weight_prepack": False}
    assert CompilationConfig().inductor_options("cuda") == {}
    mine = CompilationConfig.parse('{"inductor_compile_config": {"cpp_wrapper": false, "max_autotune": true}}')
    assert mine.inductor_options("cpu") == {"cpp_wrapper": False, "freezing": True, "cpp.weight_prepack": False,
                                            "max_autotune": True}
    with pytest.raises(EngineConfigError, match="inductor_compile_config"):
        CompilationConfig.parse({"inductor_compile_config": ["cpp_wrapper"]})


def test_unknown_inductor_option_is_refused_by_name(tiny_linear_dir):
    config = {"level": 3, "backend": "inductor", "inductor_compile_config": {"cpp_wraper": True}}
    with pytest.raises(EngineConfigError, match="cpp_wraper"):
        LLM(tiny_linear_dir, kv_cache_memory=8 << 20, max_num_seqs=4, compilation_config=config)


def test_compiled_tensor_parallel_equals_tp1_eager(tiny_k3_dir):
    """TP=2 with compiled decode steps (every rank runs the same bucket over its own heads) gives TP=1 eager's
    greedy tokens, batched, with a prefix hit in the second round (negative control: the off-by-one test above)."""
    shared = random_prompts(1, 24, 25, seed=17)[0]
    prompts = [shared + [3], shared + [4, 5], shared + [6, 7, 8]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def rounds(llm):
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
        return [o.outputs[0].token_ids for o in first + rest]

    want = rounds(LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, enforce_eager=True))
    tp2 = LLM(tiny_k3_dir, kv_cache_memory=8 << 20, max_num_seqs=4, tensor_parallel_size=2,
              compilation_config=COMPILED, collective_timeout_s=120.0)
    try:
        assert rounds(tp2) == want
        assert tp2.engine.runner.runner.graphs.num_runs > 0
        assert tp2.engine.manager.hit_tokens > 0
    finally:
        tp2.close()
