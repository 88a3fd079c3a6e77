"""`--speculative-config` parsing (vLLM's field names, clear errors naming the field) and n-gram prompt lookup."""

from __future__ import annotations

import pytest

from engine.config import EngineArgs
from engine.errors import EngineConfigError
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import lookup


def test_parse_defaults_like_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert c.rejection_sample_method == "standard" and c.draft_sample_method == "greedy"


@pytest.mark.parametrize("value, field", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}', "bogus"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}',
     "rejection_sample_method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "x"}', "draft_sample_method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}', "model"),
    ("not json", "JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}',
     "first range must start at 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], '
     '[4, 8, 0]]}', "must not overlap"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4]]}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}',
     "num_speculative_tokens_per_batch_size"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(EngineConfigError, match=field):
        SpeculativeConfig.parse(value)


def test_batch_size_schedule_is_vllms_dense_lookup():
    """vLLM's example: [(1, 16, 3), (32, 128, 2)] maps 17-31 to 3 (a gap carries the previous k), the tail past
    128 to 2; every k is capped at num_speculative_tokens; unsorted ranges are sorted (as vLLM does)."""
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "num_speculative_tokens_per_batch_size": [[32, 128, 2], [1, 16, 3]]})
    assert [c.tokens_for_batch(n) for n in (1, 16, 17, 31, 32, 128, 129, 4096)] == [3, 3, 3, 3, 2, 2, 2, 2]
    capped = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                      "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 3, 0]]})
    assert [capped.tokens_for_batch(n) for n in (1, 2, 3, 9)] == [2, 2, 0, 0]
    assert SpeculativeConfig.parse(capped.to_json()) == capped
    plain = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert [plain.tokens_for_batch(n) for n in (1, 64)] == [3, 3]  # negative control: no schedule, always k


def test_engine_args_take_k_from_the_config():
    args = EngineArgs(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert args.num_speculative_tokens == 4 and isinstance(args.speculative_config, SpeculativeConfig)
    with pytest.raises(EngineConfigError, match="num_speculative_tokens"):
        EngineArgs(model="m", num_speculative_tokens=2, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 4})
    with pytest.raises(EngineConfigError, match="max_forward_tokens"):
        EngineArgs(model="m", max_forward_tokens=2, speculative_config={"method": "ngram",
                                                                       "num_speculative_tokens": 4})


def test_ngram_lookup_semantics():
    # longest n-gram first, its earliest occurrence, never past the known tokens
    assert lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 1, 3, 2) == (9, 2)
    assert lookup([5, 1, 2, 8, 1, 2], 1, 2, 3) == (8, 1, 2)
    assert lookup([4, 1, 2, 6, 1, 2], 1, 1, 2) == (6, 1)  # n = 1: "2" first occurs at index 2 -> 6, 1
    assert lookup([1, 2, 3], 1, 3, 3) == ()  # no earlier occurrence
    assert lookup([7, 7], 2, 3, 2) == ()  # fewer tokens than needed for a match
    assert lookup([3, 4, 3], 1, 2, 5) == (4, 3)  # stops at the end of the known tokens


def _lookup_by_hand(tokens, min_n, max_n, k):
    """vLLM's rule spelled out: the longest n, the earliest start, the tokens after it."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return ()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for j in range(total - n):
            if tokens[j: j + n] == tokens[total - n:]:
                return tuple(tokens[j + n: min(total, j + n + k)])
    return ()


def test_ngram_lookup_equals_the_rule_spelled_out():
    import random

    rng = random.Random(0)
    cases = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    found = 0
    for tokens in cases:
        want = _lookup_by_hand(tokens, 1, 4, 3)
        assert lookup(tokens, 1, 4, 3) == want, tokens
        found += bool(want)
    assert found > 200
    # negative control: the latest occurrence instead of the earliest differs from the rule on these cases
    latest = [tokens for tokens in cases if _lookup_by_hand(tokens, 1, 4, 3) != _latest(tokens, 1, 4, 3)]
    assert latest


def _latest(tokens, min_n, max_n, k):
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for j in reversed(range(total - n)):
            if tokens[j: j + n] == tokens[total - n:]:
                return tuple(tokens[j + n: min(total, j + n + k)])
    return ()


def test_dspark_defaults_k_to_the_drafters_trained_block_like_vllm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "k3_dspark", "block_size": 4}')
    c = SpeculativeConfig.parse({"method": "dspark", "model": str(tmp_path)})
    assert c.num_speculative_tokens == 4
    assert SpeculativeConfig.parse({"method": "dspark", "model": str(tmp_path),
                                    "num_speculative_tokens": 2}).num_speculative_tokens == 2
    (tmp_path / "config.json").write_text('{"model_type": "k3_dspark"}')  # negative control: nothing to default to
    with pytest.raises(EngineConfigError, match="num_speculative_tokens is not given"):
        SpeculativeConfig.parse({"method": "dspark", "model": str(tmp_path)})
    with pytest.raises(EngineConfigError, match="cannot be read"):
        SpeculativeConfig.parse({"method": "dspark", "model": str(tmp_path / "missing")})
