"""`kdamesh bench serve`'s datasets: random prompts of exact lengths with a shared prefix, prefix repetition and
custom JSONL prompts, on a generated tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from servebench.datasets import (length_range, ordinary_ids, sample_custom, sample_prefix_repetition, sample_random,
                                 text_of_length)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.tokenizer import KimiTokenizer
    from engine.tokenizer_build import write_tokenizer

    return KimiTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok"), "kimi_k3"))


def test_random_prompts_have_exact_lengths_and_a_shared_prefix(tokenizer):
    reqs = sample_random(tokenizer, 12, input_len=40, output_len=6, prefix_len=16, seed=3)
    assert [len(tokenizer.encode(r.prompt)) for r in reqs] == [56] * 12  # text re-encodes to the asked length
    assert all(r.prompt_len == 56 and r.expected_output_len == 6 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:8]) for r in reqs}) == 1  # the prefix (its start is never re-merged)
    assert len({r.prompt for r in reqs}) == 12
    again = sample_random(tokenizer, 12, input_len=40, output_len=6, prefix_len=16, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    special = tokenizer.special_token_ids
    ids = sample_random(tokenizer, 4, input_len=30, output_len=2, prefix_len=10, seed=0, token_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 40 and not special & set(r.prompt) for r in ids)
    assert len({tuple(r.prompt[:10]) for r in ids}) == 1


def test_random_range_ratio(tokenizer):
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(1, 0.5, minimum=1) == (1, 2)
    with pytest.raises(ValueError):
        length_range(10, 1.0)
    reqs = sample_random(tokenizer, 60, input_len=20, output_len=8, range_ratio=0.5, seed=1, token_ids=True)
    assert {r.prompt_len for r in reqs} <= set(range(10, 31)) and len({r.prompt_len for r in reqs}) > 5
    assert {r.expected_output_len for r in reqs} <= set(range(4, 13))


def test_text_of_length_round_trips(tokenizer):
    rng = np.random.default_rng(0)
    allowed = ordinary_ids(tokenizer)
    text, ids, mismatch = text_of_length(tokenizer, allowed[:50].tolist(), 50, allowed, rng)
    assert mismatch == 0 and tokenizer.encode(text) == ids and len(ids) == 50


def test_prefix_repetition(tokenizer):
    reqs = sample_prefix_repetition(tokenizer, 10, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5,
                                    seed=0, token_ids=True, shuffle=False)
    assert len(reqs) == 9  # 10 // 3 prompts per prefix
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[2] != prefixes[3]
    assert all(r.prompt_len == 40 and r.expected_output_len == 5 for r in reqs)
    text = sample_prefix_repetition(tokenizer, 6, prefix_len=24, suffix_len=8, num_prefixes=2, output_len=5, seed=0)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 32 for r in text)
    with pytest.raises(ValueError):
        sample_prefix_repetition(tokenizer, 2, num_prefixes=3)


def test_custom_jsonl(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two"}\n\n{"prompt": "three", "output_tokens": 9}\n')
    reqs = sample_custom(path, 5, tokenizer=tokenizer, output_len=4, seed=0)
    assert len(reqs) == 5  # oversampled to --num-prompts
    assert {r.prompt for r in reqs} == {"one two", "three"}
    assert {(r.prompt, r.expected_output_len) for r in reqs} == {("one two", 4), ("three", 9)}
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in reqs)
    assert len(sample_custom(path, 5, tokenizer=tokenizer, oversample=False)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError):
        sample_custom(bad, 1)
