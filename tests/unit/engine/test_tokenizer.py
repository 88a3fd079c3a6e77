"""Tokenizer layer: round trips, special-token safety, tokenizer.json reading, streaming detokenisation, the shipped
asset's reproducibility, and id-for-id parity with the official `tokenization_kimi.TikTokenTokenizer`.

Everything is seeded (hypothesis runs derandomized, no example database) and runs on the small generated vocabulary.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reference.official_text import official_text_modules
from engine import tokenizer_build as tb
from engine.tokenizer import (
    MAX_CONSECUTIVE_RUN_CHARS,
    TIKTOKEN_MAX_ENCODE_CHARS,
    IncrementalDetokenizer,
    KimiTokenizer,
    load_tiktoken_ranks,
    split_long_runs,
)

FAMILIES = ("kimi_linear", "kimi_k3")
SEEDED = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FRAGMENTS = [
    "hello", " world", "The", "tokenizer", "'s", "'LL", "123456789", "3.14", "\n", "\r\n", "\t", "   ", "\n\n\n",
    "你好", "世界和平", "東京", "안녕하세요", "Привет", "مرحبا", "नमस्ते", "e\u0301", "n\u0303\u0323", "\u200d",
    "😀", "👩‍💻", "👨‍👩‍👧‍👦", "🇯🇵", "🏳️‍🌈", "𝄞", "𠀀", "\u00a0", "\u3000", "\x00", "\x7f", "<|", "|>", "<", "|",
]
SPECIAL_NAMES = sorted({*tb.K2_SPECIAL_TOKENS.values(), *tb.K3_SPECIAL_TOKENS.values(), "<|reserved_token_8000|>"})

any_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=120)
fragment_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), any_text), max_size=12).map("".join)
texts = st.one_of(any_text, fragment_text)
texts_with_specials = st.lists(
    st.one_of(st.sampled_from(SPECIAL_NAMES), st.sampled_from(FRAGMENTS), any_text), max_size=12
).map("".join)
LONG_TEXTS = [
    "a" * (MAX_CONSECUTIVE_RUN_CHARS * 2 + 7),
    " " * (MAX_CONSECUTIVE_RUN_CHARS + 1) + "x",
    "\n" * (MAX_CONSECUTIVE_RUN_CHARS + 3) + "tail",
    "中" * (MAX_CONSECUTIVE_RUN_CHARS + 10),
    ("word 😀 中文 " * 41_000)[: TIKTOKEN_MAX_ENCODE_CHARS + 1234],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiktoken-format tokenizer folder per family, written by write_tokenizer."""
    return {family: tb.write_tokenizer(tmp_path_factory.mktemp(family), family) for family in FAMILIES}


@pytest.fixture(scope="module")
def toks(folders) -> dict[str, KimiTokenizer]:
    return {family: KimiTokenizer.from_pretrained(path) for family, path in folders.items()}


# --------------------------------------------------------------------------------------------------------------
# Round trip and basic facts


@pytest.mark.parametrize("family", FAMILIES)
def test_vocabulary_layout(toks, family):
    tok = toks[family]
    base = tb.SMALL_NUM_BASE_TOKENS
    assert (tok.num_base_tokens, tok.vocab_size) == (base, 8192)
    assert len(tok.special_tokens) == 256 and set(tok.special_tokens.values()) == set(range(base, base + 256))
    assert tok.special_tokens == {**tok.special_tokens, **tb.special_token_ids(family, base)}
    assert tok.special_tokens[f"<|reserved_token_{base + 100}|>"] == base + 100
    assert (tok.bos_token_id, tok.eos_token_id) == (base, base + 1)
    assert (tok.unk_token_id, tok.pad_token_id) == (base + 254, base + 255)
    assert tok.stop_token_ids == (base + 1,)  # no generation_config.json: eos


def test_released_offsets():
    k2, k3 = tb.special_token_ids("kimi_linear", 163_584), tb.special_token_ids("kimi_k3", 163_584)
    assert (k2["<|im_end|>"], k2["<|im_middle|>"], k2["<|tool_call_end|>"]) == (163_586, 163_601, 163_599)
    assert (k2["[UNK]"], k2["[PAD]"]) == (163_838, 163_839)
    markers = (k3["<|end_of_msg|>"], k3["<|open|>"], k3["<|close|>"], k3["<|sep|>"])
    assert markers == (163_586, 163_587, 163_588, 163_589)
    assert k3["<|media_pad|>"] == 163_605  # media_placeholder_token_id of the release
    assert tb.stop_token_ids("kimi_k3", 163_584)[0] == 163_586
    with pytest.raises(ValueError):
        tb.special_token_ids("llama", 10)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["plain", "with_special_look_alikes"])
@SEEDED
@given(data=st.data())
def test_user_text_round_trips_and_is_never_special(toks, family, kind, data):
    tok = toks[family]
    text = data.draw(texts if kind == "plain" else texts_with_specials)
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)  # base tokens only: never a special id
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.id_to_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.decode(tok.encode(text, allow_special=True)) == text


@pytest.mark.parametrize("text", LONG_TEXTS, ids=["letters", "spaces", "newlines", "han", "over_400k"])
def test_round_trip_long(toks, text):
    tok = toks["kimi_k3"]
    assert tok.decode(tok.encode(text)) == text


def test_token_strings(toks):
    tok = toks["kimi_k3"]
    ids = tok.encode("Hello wörld<|open|>", allow_special=True)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-1] == "<|open|>" and [tok.token_to_id(p) for p in pieces] == ids
    assert tok.convert_ids_to_tokens(ord("A")) == "A" and tok.token_to_id("Ġ") == ord(" ")
    assert tok.token_to_id("no-such-token-xyz") is None
    with pytest.raises(ValueError):
        tok.id_to_bytes(tok.vocab_size)


def test_stop_ids_from_generation_config(folders, tmp_path):
    for value, expected in ((7938, (7938,)), ([7938, 7937], (7938, 7937))):
        folder = tb.write_tokenizer(tmp_path / str(value), "kimi_k3")
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert KimiTokenizer.from_pretrained(folder).stop_token_ids == expected
    with pytest.raises(FileNotFoundError):
        KimiTokenizer.from_pretrained(tmp_path / "missing")


# --------------------------------------------------------------------------------------------------------------
# Special tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_special_text_is_plain_unless_allowed(toks, family):
    tok = toks[family]
    for name, token_id in tb.special_token_ids(family, tok.num_base_tokens).items():
        text = f"say {name} now"
        plain = tok.encode(text)
        assert all(i < tok.num_base_tokens for i in plain) and tok.decode(plain) == text
        assert token_id in tok.encode(text, allow_special=True)
        assert tok.encode(name, allow_special=True) == [token_id]
        assert tok.decode([token_id]) == name and tok.decode([token_id], skip_special_tokens=True) == ""


def test_k3_markers(toks):
    tok = toks["kimi_k3"]
    ids = tb.special_token_ids("kimi_k3", tok.num_base_tokens)
    text = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    encoded = tok.encode(text, allow_special=True)
    assert [i for i in encoded if tok.is_special(i)] == [
        ids["<|open|>"], ids["<|sep|>"], ids["<|close|>"], ids["<|sep|>"], ids["<|end_of_msg|>"]
    ]
    assert tok.decode(encoded) == text
    assert tok.decode(encoded, skip_special_tokens=True) == 'message role="user"himessage'


# --------------------------------------------------------------------------------------------------------------
# tokenizer.json


@pytest.fixture(scope="module")
def json_tok(tmp_path_factory) -> KimiTokenizer:
    folder = tb.write_tokenizer_json(tmp_path_factory.mktemp("json"), "kimi_k3")
    assert not (folder / "tiktoken.model").exists()
    return KimiTokenizer.from_pretrained(folder)


def test_tokenizer_json_layout(json_tok, toks):
    tok = toks["kimi_k3"]
    assert (json_tok.vocab_size, json_tok.num_base_tokens) == (tok.vocab_size, tok.num_base_tokens)
    assert json_tok.special_tokens == tok.special_tokens
    assert (json_tok.bos_token_id, json_tok.eos_token_id, json_tok.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    )


@SEEDED
@given(text=texts_with_specials)
def test_tokenizer_json_round_trip(json_tok, toks, text):
    ids = json_tok.encode(text)
    assert json_tok.decode(ids) == text
    assert not any(json_tok.is_special(i) for i in ids)
    assert ids == toks["kimi_k3"].encode(text)  # same ranks, same pre-split regex -> same ids
    special_ids = json_tok.encode(text, allow_special=True)
    assert json_tok.decode(special_ids) == text
    assert special_ids == toks["kimi_k3"].encode(text, allow_special=True)


# --------------------------------------------------------------------------------------------------------------
# Streaming detokenisation


@SEEDED
@given(text=texts, seed=st.integers(0, 2**16))
def test_incremental_detokenizer(toks, text, seed):
    tok = toks["kimi_k3"]
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
    assert detok.pending_bytes == b""
    assert "".join(deltas) + detok.finish() == text
    # random batch sizes give the same text
    rng, batched, pos = random.Random(seed), IncrementalDetokenizer(tok), 0
    out = []
    while pos < len(ids):
        step = rng.randint(1, 4)
        out.append(batched.push(ids[pos : pos + step]))
        pos += step
    assert "".join(out) + batched.finish() == text


def test_incremental_holds_partial_characters(toks):
    tok = toks["kimi_k3"]
    ids = tok.encode("🧬龥ꙮ")  # characters absent from the corpus: split into byte tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some ids are partial characters on their own
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == "🧬龥ꙮ" and all("\ufffd" not in d for d in deltas)
    truncated = IncrementalDetokenizer(tok)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])][:1]
    assert truncated.push(partial) == "" and truncated.pending_bytes
    assert truncated.finish() == tok.decode(partial)  # flushed as U+FFFD
    with pytest.raises(RuntimeError):
        truncated.push(1)


def test_incremental_skip_special(toks):
    tok = toks["kimi_k3"]
    ids = tok.encode("think 中<|sep|>answer<|end_of_msg|>", allow_special=True)
    kept, skipped = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(kept.push(i) for i in ids) + kept.finish() == "think 中<|sep|>answer<|end_of_msg|>"
    assert "".join(skipped.push(i) for i in ids) + skipped.finish() == "think 中answer"


# --------------------------------------------------------------------------------------------------------------
# The shipped asset


def test_asset_is_reproducible():
    ranks = load_tiktoken_ranks(tb.SMALL_TIKTOKEN_PATH)
    assert len(ranks) == tb.SMALL_NUM_BASE_TOKENS
    assert all(ranks[bytes([b])] == b for b in range(256))
    rebuilt = tb.build_small_tiktoken()
    assert rebuilt == tb.SMALL_TIKTOKEN_PATH.read_bytes(), (
        "retraining on engine/assets/corpus.txt no longer reproduces kimi_small.tiktoken "
        "(tokenizers version change?); see python -m engine.tokenizer_build --check"
    )


def test_written_files_are_released_format(folders):
    config = json.loads((folders["kimi_k3"] / "tokenizer_config.json").read_text())
    # tokenizer_class names transformers' fast tokenizer (tokenizer.json), not Moonshot's "TikTokenTokenizer", which
    # AutoTokenizer can only resolve through remote code; auto_map still names the (shipped) TikTokenTokenizer
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    entry = config["added_tokens_decoder"][str(tb.SMALL_NUM_BASE_TOKENS + 2)]
    assert entry == {"content": "<|end_of_msg|>", "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
    special_map = json.loads((folders["kimi_linear"] / "special_tokens_map.json").read_text())
    assert special_map["eos_token"]["content"] == "[EOS]" and "<|im_end|>" in special_map["additional_special_tokens"]


# --------------------------------------------------------------------------------------------------------------
# Parity with the official tokenizer (llmcompressor.modeling.kimi_k3.tokenization_kimi, loaded by file path)


@pytest.fixture(scope="module")
def official_cls():
    importlib.import_module("transformers")
    with official_text_modules() as modules:
        yield modules["tokenization_kimi"].TikTokenTokenizer


@pytest.fixture(scope="module")
def official(official_cls, folders):
    return {family: official_cls.from_pretrained(str(path)) for family, path in folders.items()}


@pytest.mark.parametrize("family", FAMILIES)
@SEEDED
@given(text=texts_with_specials)
def test_parity_with_official(official, toks, family, text):
    ref, tok = official[family], toks[family]
    with_special = tok.encode(text, allow_special=True)
    assert with_special == ref.encode(text)  # the official default treats special text as specials
    plain = tok.encode(text)
    assert plain == ref.encode(text, allow_special_tokens=False)
    assert tok.decode(with_special) == ref.decode(with_special)
    assert tok.decode(plain) == ref.decode(plain)


@pytest.mark.parametrize("text", LONG_TEXTS[:4], ids=["letters", "spaces", "newlines", "han"])
def test_parity_with_official_long(official, toks, text):
    assert toks["kimi_k3"].encode(text) == official["kimi_k3"].encode(text, allow_special_tokens=False)


@SEEDED
@given(text=st.text(alphabet=st.sampled_from("ab \n\t中"), max_size=40), max_run=st.integers(1, 5))
def test_split_matches_official(official_cls, text, max_run):
    expected = list(official_cls._split_whitespaces_or_nonwhitespaces(text, max_run))
    assert split_long_runs(text, max_run) == expected


def test_official_metadata(official, toks):
    for family in FAMILIES:
        ref, tok = official[family], toks[family]
        assert ref.special_tokens == tok.special_tokens
        assert (ref.bos_id, ref.eos_id, ref.pad_id, ref.unk_id) == (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id
        )
        sample = list(range(0, tok.num_base_tokens, 97))
        assert ref.convert_ids_to_tokens(sample) == tok.convert_ids_to_tokens(sample)
