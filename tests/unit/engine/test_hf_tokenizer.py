"""Generated checkpoints' tokenizers load with `transformers.AutoTokenizer` and give the engine's ids.

For each family the tiny presets are made with `make_checkpoint` (their tokenizer files must be byte-identical);
`AutoTokenizer.from_pretrained` loads each folder two ways — the fast tokenizer from `tokenizer.json`, and the shipped
`tokenization_kimi.TikTokenTokenizer` with `trust_remote_code=True` — and both must encode 200 seeded mixed strings to
exactly `KimiTokenizer`'s ids: with `split_special_tokens=True` as `KimiTokenizer.encode(text)` (control-token text
stays text, as in chat content and a `split_special_tokens` prompt), by default as `encode(text, allow_special=True)`
(what the gateway's `/tokenize` and `/v1/completions` make of a prompt, as vLLM does). A
`tokenizer.json` with one merge removed must fail the same comparison (negative control).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import tokenizer_build as tb
from engine.model.checkpoint import make_checkpoint
from engine.model.presets import PRESETS, preset_family
from engine.tokenizer import KimiTokenizer, byte_level_alphabet, load_tiktoken_ranks

import transformers  # noqa: E402,F401  (the dev extra pins it: a missing one fails the module, never skips it)

TINY_PRESETS = {"kimi_linear": ("tiny-linear", "linear-48b-pattern"), "kimi_k3": ("tiny-k3", "k3-93-pattern")}
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenization_kimi.py", "chat_template.jinja")
LOAD_MODES = ("fast", "remote_code")
NUM_STRINGS = 200

PIECES = {
    "cjk": ["你好", "世界和平", "東京タワー", "한국어 텍스트", "中文分词测试", "漢字かな交じり文", "𠀀"],
    "emoji": ["😀", "👩‍💻", "🇯🇵", "🏳️‍🌈", "👨‍👩‍👧‍👦", "🧬", "✨🔥"],
    "code": ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {", "SELECT * FROM t WHERE id=42;",
             '{"key": [1, 2.5, null]}', '<div class="a">', "x += 1  # note", "fn main() -> Result<(), E>"],
    "space": ["   ", "\t\t", "\n\n\n", " \n ", "\r\n", "\u00a0", "\u3000", "\x00", "\x7f", "\u200d"],
    "digits": ["3.14159", "1,000,000", "2024-06-01", "0x1F", "١٢٣"],
    "lookalike": ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|im_end|>", "<|im_user|>",
                  "<|im_middle|>", "<|tool_call_begin|>", "<|media_pad|>", "[EOS]", "[BOS]", "[PAD]", "[UNK]",
                  "[EOT]", "<think>", "</think>", "<|reserved_token_8000|>", "<|", "|>", "<|open", "[EO",
                  "<|im_end|", "<<|sep|>>", "[[EOS]]"],
    "script": ["Привет мир", "مرحبا بالعالم", "नमस्ते", "Ελληνικά", "e\u0301", "Ångström", "naïve café",
               "שלום", "ไทย"],
    "word": ["hello", " world", "The", "'s", "'LL", "don't", " I'm", "tokenizer", "Hello, World!"],
}


def _random_piece(rng: random.Random) -> str:
    kind = rng.choice([*PIECES, "run", "number", "chars"])
    if kind == "run":
        return rng.choice(" \t\n") * rng.randint(1, 40)
    if kind == "number":
        return str(rng.randint(0, 10 ** rng.randint(1, 12)))
    if kind == "chars":  # any code points but surrogates
        return "".join(chr(rng.choice([rng.randint(0x20, 0x2FFF), rng.randint(0x1F300, 0x1FAFF)]))
                       for _ in range(rng.randint(1, 6)))
    return rng.choice(PIECES[kind])


def mixed_strings(seed: int = 15, count: int = NUM_STRINGS) -> list[str]:
    """`count` seeded strings of 1-8 pieces; the first few are fixed edge cases."""
    rng = random.Random(seed)
    fixed = ["", "<|open|>", "say <|im_end|> now", "[EOS]", " " * 50, "1234567890"]
    return fixed + ["".join(_random_piece(rng) for _ in range(rng.randint(1, 8))) for _ in range(count - len(fixed))]


STRINGS = mixed_strings()


# --------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """preset -> a checkpoint folder written by make_checkpoint (the tiny presets of both families)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {p: make_checkpoint(p, root / p) for presets in TINY_PRESETS.values() for p in presets}


@pytest.fixture(scope="module")
def folders(checkpoints) -> dict[str, Path]:
    """family -> the first tiny preset's folder."""
    return {family: checkpoints[presets[0]] for family, presets in TINY_PRESETS.items()}


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory):
    """transformers copies remote code into HF_MODULES_CACHE: point it at a temporary folder, undo it afterwards."""
    dynamic = pytest.importorskip("transformers.dynamic_module_utils")
    saved, cache = dynamic.HF_MODULES_CACHE, str(tmp_path_factory.mktemp("hf_modules"))
    dynamic.HF_MODULES_CACHE = cache
    yield cache
    dynamic.HF_MODULES_CACHE = saved
    if cache in sys.path:
        sys.path.remove(cache)
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        del sys.modules[name]


def _load(folder: Path, mode: str, split_special_tokens: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(folder), trust_remote_code=mode == "remote_code", split_special_tokens=split_special_tokens
    )


@pytest.fixture(scope="module")
def hf_toks(folders, modules_cache) -> dict[tuple[str, str], object]:
    return {(family, mode): _load(folder, mode) for family, folder in folders.items() for mode in LOAD_MODES}


@pytest.fixture(scope="module")
def kimi(folders) -> dict[str, KimiTokenizer]:
    return {family: KimiTokenizer.from_pretrained(folder) for family, folder in folders.items()}


def mismatches(hf_tok, ref: KimiTokenizer, strings: list[str]) -> list[str]:
    """Strings whose ids differ from `ref` as the gateway encodes them (special-token text stays text)."""
    return [s for s in strings if hf_tok.encode(s, split_special_tokens=True) != ref.encode(s)]


# --------------------------------------------------------------------------------------------------------------
# Files


@pytest.mark.parametrize("family", TINY_PRESETS)
def test_presets_of_a_family_ship_identical_tokenizer_files(checkpoints, family):
    first, *others = TINY_PRESETS[family]
    for name in TOKENIZER_FILES:
        content = (checkpoints[first] / name).read_bytes()
        assert all((checkpoints[p] / name).read_bytes() == content for p in others), name
    assert {preset_family(p) for p in PRESETS} == set(TINY_PRESETS)  # every preset is one of these two families


def _digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in TOKENIZER_FILES}


def test_written_files_are_deterministic(folders, tmp_path):
    """The same bytes from another process (its own hash seed) as from make_checkpoint in this one."""
    code = ("import sys; from engine import tokenizer_build as tb; "
            "[tb.write_tokenizer(f'{sys.argv[1]}/{f}', f) for f in tb.FAMILIES]")
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, check=True)
    for family, folder in folders.items():
        assert _digests(tmp_path / family) == _digests(folder), family
    assert (folders["kimi_k3"] / "tokenization_kimi.py").read_text(encoding="utf-8") == tb.tokenization_module_source()


def test_shipped_module_imports_only_transformers_and_tiktoken(folders):
    tree = ast.parse((folders["kimi_k3"] / "tokenization_kimi.py").read_text(encoding="utf-8"))
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots - set(sys.stdlib_module_names) == {"tiktoken", "transformers"}


@pytest.mark.parametrize("family", TINY_PRESETS)
def test_tokenizer_config_names_what_is_shipped(folders, family):
    config = json.loads((folders[family] / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # tokenizer.json, no remote code needed
    module, cls = config["auto_map"]["AutoTokenizer"][0].split(".")
    assert config["auto_map"]["AutoTokenizer"][1] is None
    assert f"\nclass {cls}(" in (folders[family] / f"{module}.py").read_text(encoding="utf-8")
    added = json.loads((folders[family] / "tokenizer.json").read_text())["added_tokens"]
    base = tb.SMALL_NUM_BASE_TOKENS
    assert [t["id"] for t in added] == list(range(base, base + 256)) and all(t["special"] for t in added)
    assert {t["content"]: t["id"] for t in added} == KimiTokenizer.from_pretrained(folders[family]).special_tokens
    assert {str(t["id"]): t["content"] for t in added if not t["content"].startswith("<|reserved_token_")} == {
        i: entry["content"] for i, entry in config["added_tokens_decoder"].items()
    }


def test_no_base_token_is_spelled_like_a_special_token():
    """transformers looks added tokens up first: a base token spelled like one would read as the special id."""
    alphabet = byte_level_alphabet()
    pieces = {"".join(alphabet[b] for b in token) for token in load_tiktoken_ranks(tb.SMALL_TIKTOKEN_PATH)}
    for family in tb.FAMILIES:
        ids = tb.special_token_ids(family, tb.SMALL_NUM_BASE_TOKENS).values()
        names = set(tb.family_tokens(family).offsets.values())
        names |= {f"<|reserved_token_{i}|>" for i in range(tb.SMALL_NUM_BASE_TOKENS, tb.SMALL_NUM_BASE_TOKENS + 256)
                  if i not in ids}
        assert not pieces & names


# --------------------------------------------------------------------------------------------------------------
# AutoTokenizer against KimiTokenizer


def test_strings_cover_the_cases():
    assert len(STRINGS) == NUM_STRINGS and len(set(STRINGS)) > NUM_STRINGS * 0.95
    assert STRINGS == mixed_strings()  # seeded
    for kind in ("cjk", "emoji", "lookalike", "script"):
        assert sum(any(p in s for p in PIECES[kind]) for s in STRINGS) >= 20, kind


@pytest.mark.parametrize("mode", LOAD_MODES)
@pytest.mark.parametrize("family", TINY_PRESETS)
def test_loads_both_ways(hf_toks, kimi, family, mode):
    tok, ref = hf_toks[family, mode], kimi[family]
    if mode == "remote_code":  # the shipped file, imported by transformers from the checkpoint folder
        assert (type(tok).__name__, type(tok).__module__.split(".")[0]) == ("TikTokenTokenizer", "transformers_modules")
    else:
        assert type(tok).__name__ == "TokenizersBackend"  # transformers 5's PreTrainedTokenizerFast
    assert len(tok) == ref.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id
    )
    assert tok.convert_tokens_to_ids(list(ref.special_tokens)) == list(ref.special_tokens.values())


@pytest.mark.parametrize("mode", LOAD_MODES)
@pytest.mark.parametrize("family", TINY_PRESETS)
def test_plain_text_ids_equal_the_gateway(hf_toks, kimi, family, mode):
    """split_special_tokens=True: look-alikes of control tokens are ordinary text, as in the gateway's /tokenize."""
    tok, ref = hf_toks[family, mode], kimi[family]
    assert mismatches(tok, ref, STRINGS) == []
    for s in STRINGS:
        ids = tok.encode(s, split_special_tokens=True)
        assert not any(ref.is_special(i) for i in ids)
        assert tok.decode(ids) == s == ref.decode(ids)
        assert tok(s, split_special_tokens=True)["input_ids"] == ids


@pytest.mark.parametrize("mode", LOAD_MODES)
@pytest.mark.parametrize("family", TINY_PRESETS)
def test_default_encoding_reads_special_token_text(hf_toks, kimi, family, mode):
    """transformers' default (as the official tokenizer's): special-token text -> its id = allow_special=True."""
    tok, ref = hf_toks[family, mode], kimi[family]
    with_specials = 0
    for s in STRINGS:
        ids = tok.encode(s)
        assert ids == ref.encode(s, allow_special=True) == tok(s)["input_ids"]
        assert tok.decode(ids) == s
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        with_specials += any(ref.is_special(i) for i in ids)
    assert with_specials >= 20  # the two modes really differ on these strings
    reserved = ref.special_tokens["<|reserved_token_8100|>"]
    assert tok.decode([reserved, ord("a")], skip_special_tokens=True) == "a"  # reserved ids are special too


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_split_special_tokens_at_load(folders, kimi, modules_cache, mode):
    tok = _load(folders["kimi_k3"], mode, split_special_tokens=True)
    text = '<|open|>message role="user"<|sep|>hi [EOS]'
    assert tok.encode(text) == kimi["kimi_k3"].encode(text)
    assert tok.encode(text, split_special_tokens=False) == kimi["kimi_k3"].encode(text, allow_special=True)


def test_remote_code_tokenizer_saves_and_reloads(hf_toks, kimi, tmp_path):
    hf_toks["kimi_k3", "remote_code"].save_pretrained(tmp_path)
    assert (tmp_path / "tiktoken.model").read_bytes() == tb.format_tiktoken_ranks(
        load_tiktoken_ranks(tb.SMALL_TIKTOKEN_PATH)
    )
    assert KimiTokenizer.from_pretrained(tmp_path).special_tokens == kimi["kimi_k3"].special_tokens


def test_negative_control_one_merge_removed(folders, kimi, tmp_path):
    """The comparison catches a broken tokenizer.json: without its first merge some strings encode differently."""
    broken = tmp_path / "broken"
    shutil.copytree(folders["kimi_k3"], broken)
    tokenizer_json = json.loads((broken / "tokenizer.json").read_text(encoding="utf-8"))
    del tokenizer_json["model"]["merges"][0]
    (broken / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    bad = mismatches(_load(broken, "fast"), kimi["kimi_k3"], STRINGS)
    assert len(bad) >= 1
    assert mismatches(_load(folders["kimi_k3"], "fast"), kimi["kimi_k3"], bad) == []
