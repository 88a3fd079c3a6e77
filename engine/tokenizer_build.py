"""Tokenizer files for generated checkpoints, and the special-token tables of both model families.

Contract
--------
* Torch-free, like `engine.tokenizer`.
* The small vocabulary of generated checkpoints is the shipped asset `engine/assets/kimi_small.tiktoken`
  (7,936 base tokens; + 256 specials = 8,192 = the vocab size of generated checkpoints). Loading never retrains.
  It was produced by `train_bpe_ranks` from `engine/assets/corpus.txt` (byte-level BPE trained with `tokenizers`,
  pre-split with Kimi's regex, converted to tiktoken ranks: the 256 single bytes at ranks 0..255 in byte order,
  then one rank per merge in training order). Regenerate with `python -m engine.tokenizer_build --rebuild`;
  `--check` verifies that retraining reproduces the asset byte for byte.
* `write_tokenizer(out_dir, family)` writes a tokenizer in Moonshot's released format (`tiktoken.model`,
  `tokenizer_config.json`, `special_tokens_map.json`) plus what `transformers` needs: `tokenizer.json` (the same
  ranks as a byte-level BPE with Kimi's pre-split regex and the 256 specials as added tokens with `special: true`)
  and our own `tokenization_kimi.py` (generated from `engine/hf_tokenization_kimi.py`). The folder loads with
  `engine.tokenizer.KimiTokenizer`, the official `tokenization_kimi.TikTokenTokenizer`, and
  `transformers.AutoTokenizer.from_pretrained(dir)`: by default the fast tokenizer from `tokenizer.json`
  (`tokenizer_class: PreTrainedTokenizerFast`), with `trust_remote_code=True` the shipped `TikTokenTokenizer`
  (`auto_map`). Both give `KimiTokenizer`'s ids: special-token text is a special id by default (transformers'
  convention, = `encode(text, allow_special=True)`) and ordinary text with `split_special_tokens=True` (=
  `encode(text)`, the gateway's `/tokenize`); the fast one does not cut runs over 25,000 characters as tiktoken
  needs, so ids may differ on such runs. `write_tokenizer_json` writes the vocabulary as `tokenizer.json` only.
  Both also write the family's chat template as `chat_template.jinja` (`CHAT_TEMPLATES`: kdamesh's Jinja templates in
  `engine/assets`; the K3 one renders what the gateway's Python renderer does), so `apply_chat_template` works.
* Every written file is a function of the asset, the family and our source: the same bytes on every run.
* Special tokens sit at the same offsets from `num_base_tokens` as in the released models (`K2_SPECIAL_TOKENS` for
  `kimi_linear`, `K3_SPECIAL_TOKENS` for `kimi_k3`; offset -> content). Offsets not listed are
  `<|reserved_token_{id}|>`.

Provenance of the tables (base = 163,584 in the released models)
----------------------------------------------------------------
* K2 / Kimi Linear: offsets 0-4, 6, 7, 9-15, 17, 254, 255 are the released Kimi-K2-Instruct / Kimi-Linear table
  (ids 163584-163601, 163838, 163839), seen identically in several public copies of `tokenizer_config.json`.
  `<think>`/`</think>` at +22/+23 (163606/163607) come from Kimi-K2-Thinking; we did not find a copy of
  Kimi-Linear-48B-A3B-Instruct's own file confirming that it lists them (if it does not, they are reserved slots
  there, so adding them changes no other id). K2's media tokens (+18..+21) are left reserved: Kimi Linear is text-only.
* K3: `<|end_of_msg|>` = +2 (163586) and `<|media_pad|>` = +21 (163605 = `media_placeholder_token_id`) are fixed by
  the official code; `<|open|>` +3, `<|close|>` +4, `<|sep|>` +5, `[start_header_id]` +6, `[end_header_id]` +7,
  `[EOT]` +9, `<|media_begin|>`..`<|media_end|>` +18..+20, `<osagent_mode>` +65 follow public third-party copies of
  the K3 table (not Moonshot's file itself). The bracketed header names are as found there.
* bos/eos/pad/unk are `[BOS]`/`[EOS]`/`[PAD]`/`[UNK]` in both (the official tokenizer's defaults); the stop tokens a
  generated checkpoint's `generation_config.json` should list are `stop_token_ids(family, n)`.
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import (
    NUM_RESERVED_SPECIAL_TOKENS,
    PAT_STR,
    TIKTOKEN_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_JSON_FILE,
    byte_level_alphabet,
    load_tiktoken_ranks,
)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
SMALL_TIKTOKEN_PATH = ASSETS_DIR / "kimi_small.tiktoken"
SMALL_NUM_BASE_TOKENS = 7936  # + 256 specials = 8192, the vocab size of generated checkpoints
FAMILIES = ("kimi_linear", "kimi_k3")
DEFAULT_MODEL_MAX_LENGTH = 1_048_576
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZATION_MODULE_FILE = "tokenization_kimi.py"  # what auto_map names; generated from HF_TOKENIZER_TEMPLATE
HF_TOKENIZER_TEMPLATE = Path(__file__).resolve().parent / "hf_tokenization_kimi.py"
ENGINE_TOKENIZER_SOURCE = Path(__file__).resolve().parent / "tokenizer.py"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES = {"kimi_linear": ASSETS_DIR / "kimi_k2_chat_template.jinja",
                  "kimi_k3": ASSETS_DIR / "kimi_k3_chat_template.jinja"}

# offset from num_base_tokens -> content
K2_SPECIAL_TOKENS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
K3_SPECIAL_TOKENS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}


@dataclass(frozen=True)
class FamilyTokens:
    """What a family's tokenizer files say about special tokens."""

    offsets: dict[int, str]  # offset from num_base_tokens -> content
    bos: str
    eos: str
    pad: str
    unk: str
    stop: tuple[str, ...]  # generation_config.json eos_token_id of a generated checkpoint


def family_tokens(family: str) -> FamilyTokens:
    if family == "kimi_linear":
        return FamilyTokens(K2_SPECIAL_TOKENS, "[BOS]", "[EOS]", "[PAD]", "[UNK]", ("<|im_end|>", "[EOS]"))
    if family == "kimi_k3":
        return FamilyTokens(K3_SPECIAL_TOKENS, "[BOS]", "[EOS]", "[PAD]", "[UNK]", ("<|end_of_msg|>", "[EOS]"))
    raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def special_token_ids(family: str, num_base_tokens: int) -> dict[str, int]:
    """Named special tokens of `family` -> id, for a vocabulary with `num_base_tokens` base tokens."""
    return {name: num_base_tokens + offset for offset, name in family_tokens(family).offsets.items()}


def stop_token_ids(family: str, num_base_tokens: int) -> list[int]:
    """The ids generation stops at (what a generated checkpoint's generation_config.json lists)."""
    ids = special_token_ids(family, num_base_tokens)
    return [ids[name] for name in family_tokens(family).stop]


# ----------------------------------------------------------------------------------------------------------------
# Training and the tiktoken file format


def _byte_level_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _merge_pairs(tokenizer_json: dict) -> list[tuple[str, str]]:
    """Merges of a BPE tokenizer.json: `["a", "b"]` pairs (new format) or `"a b"` strings (old format)."""
    merges = tokenizer_json["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def train_bpe_ranks(corpus: str, num_base_tokens: int = SMALL_NUM_BASE_TOKENS) -> dict[bytes, int]:
    """Train a byte-level BPE on `corpus` -> tiktoken ranks {token bytes: rank} with exactly `num_base_tokens` ranks."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=num_base_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    byte_of = {ch: b for b, ch in byte_level_alphabet().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in _merge_pairs(json.loads(tokenizer.to_str())):
        token = bytes(byte_of[ch] for ch in left + right)
        if token not in ranks:
            ranks[token] = len(ranks)
        if len(ranks) == num_base_tokens:
            return ranks
    raise ValueError(f"corpus too small: BPE training produced {len(ranks)} < {num_base_tokens} tokens")


def format_tiktoken_ranks(ranks: dict[bytes, int]) -> bytes:
    """The `tiktoken.model` file content: `base64(token) rank` per line, in rank order."""
    in_rank_order = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in in_rank_order]
    return b"\n".join(lines) + b"\n"


def build_small_tiktoken(corpus_path: Path = CORPUS_PATH) -> bytes:
    """Retrain the small vocabulary from the corpus and return the tiktoken file content."""
    return format_tiktoken_ranks(train_bpe_ranks(corpus_path.read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------------------------------
# Writing tokenizer folders


def _added_token(content: str, with_special: bool = True) -> dict:
    entry = {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    if with_special:
        entry["special"] = True
    return entry


def _additional_special_tokens(tokens: FamilyTokens) -> list[str]:
    roles = {tokens.bos, tokens.eos, tokens.pad, tokens.unk}
    return [name for _, name in sorted(tokens.offsets.items()) if name not in roles]


def tokenizer_config(family: str, num_base_tokens: int, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> dict:
    """`tokenizer_config.json` in Moonshot's released format (named specials only in `added_tokens_decoder`), except
    `tokenizer_class`: transformers' fast tokenizer over `tokenizer.json`, so `AutoTokenizer` needs no remote code;
    `auto_map` names the shipped `tokenization_kimi.TikTokenTokenizer` for `trust_remote_code=True`."""
    tokens = family_tokens(family)
    module = TOKENIZATION_MODULE_FILE.removesuffix(".py")
    return {
        "added_tokens_decoder": {
            str(num_base_tokens + offset): _added_token(name) for offset, name in sorted(tokens.offsets.items())
        },
        "additional_special_tokens": _additional_special_tokens(tokens),
        "auto_map": {"AutoTokenizer": [f"{module}.TikTokenTokenizer", None]},
        "bos_token": tokens.bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": tokens.eos,
        "model_max_length": model_max_length,
        "pad_token": tokens.pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": tokens.unk,
    }


def special_tokens_map(family: str) -> dict:
    tokens = family_tokens(family)
    return {
        "additional_special_tokens": _additional_special_tokens(tokens),
        "bos_token": _added_token(tokens.bos, with_special=False),
        "eos_token": _added_token(tokens.eos, with_special=False),
        "pad_token": _added_token(tokens.pad, with_special=False),
        "unk_token": _added_token(tokens.unk, with_special=False),
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(
    out_dir: str | Path,
    family: str,
    tiktoken_path: str | Path = SMALL_TIKTOKEN_PATH,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> Path:
    """Write `tiktoken.model`, `tokenizer.json`, `tokenization_kimi.py`, `tokenizer_config.json`,
    `special_tokens_map.json` and `chat_template.jinja` into `out_dir` (created)."""
    family_tokens(family)  # validate before touching the disk
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = load_tiktoken_ranks(tiktoken_path)
    (out / TIKTOKEN_FILE).write_bytes(format_tiktoken_ranks(ranks))
    (out / TOKENIZATION_MODULE_FILE).write_text(tokenization_module_source(), encoding="utf-8")
    _write_hf_files(out, ranks, family, tokenizer_config(family, len(ranks), model_max_length))
    return out


def _write_hf_files(out: Path, ranks: dict[bytes, int], family: str, config: dict) -> None:
    (out / TOKENIZER_JSON_FILE).write_text(ranks_to_tokenizer_json(ranks, family), encoding="utf-8")
    _write_json(out / TOKENIZER_CONFIG_FILE, config)
    _write_json(out / SPECIAL_TOKENS_MAP_FILE, special_tokens_map(family))
    (out / CHAT_TEMPLATE_FILE).write_bytes(CHAT_TEMPLATES[family].read_bytes())


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def _statement_lines(lines: list[str], node: ast.stmt) -> str:
    """A top-level statement's full lines, with its trailing comment and the comment lines right above it."""
    start = node.lineno - 1
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return "".join(lines[start : node.end_lineno])


def tokenization_module_source() -> str:
    """The shipped `tokenization_kimi.py`: `HF_TOKENIZER_TEMPLATE` with its `from engine.tokenizer import ...`
    replaced by the source of those definitions, in their `engine/tokenizer.py` order (no kdamesh import remains)."""
    template = HF_TOKENIZER_TEMPLATE.read_text(encoding="utf-8")
    node = next(n for n in ast.parse(template).body if isinstance(n, ast.ImportFrom) and n.module == "engine.tokenizer")
    wanted = {alias.name for alias in node.names}
    source = ENGINE_TOKENIZER_SOURCE.read_text(encoding="utf-8")
    found = [d for d in ast.parse(source).body if _defined_names(d) & wanted]
    missing = wanted - set().union(*(_defined_names(d) for d in found))
    if missing:
        raise ValueError(f"{ENGINE_TOKENIZER_SOURCE} defines no top-level {sorted(missing)}")
    source_lines, pieces = source.splitlines(keepends=True), []
    for previous, definition in zip([None, *found], found):
        functions = isinstance(definition, ast.FunctionDef) or isinstance(previous, ast.FunctionDef)
        pieces.append(("\n\n" if functions and previous else "") + _statement_lines(source_lines, definition))
    lines = template.splitlines(keepends=True)
    header = (f"# Generated by engine/tokenizer_build.py from engine/{HF_TOKENIZER_TEMPLATE.name} and"
              " engine/tokenizer.py (kdamesh); edit those, not this file.\n")
    inlined = "# From engine/tokenizer.py:\n" + "".join(pieces) + "\n\n"
    return header + "".join(lines[: node.lineno - 1]) + inlined + "".join(lines[node.end_lineno :]).lstrip("\n")


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken ranks: every split of a token into two tokens, ordered by the token's rank."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(splits, key=lambda lr: (ranks[lr[0]], ranks[lr[1]])))
    return merges


def ranks_to_tokenizer_json(ranks: dict[bytes, int], family: str) -> str:
    """An HF `tokenizer.json` (byte-level BPE, Kimi's pre-split regex) with the same ranks and the family's specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    alphabet = byte_level_alphabet()

    def to_str(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in _merges_from_ranks(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    named = family_tokens(family).offsets
    num_base = len(ranks)
    special_ids = range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
    specials = [named.get(i - num_base, f"<|reserved_token_{i}|>") for i in special_ids]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tokenizer.to_str()


def write_tokenizer_json(out_dir: str | Path, family: str, tiktoken_path: str | Path = SMALL_TIKTOKEN_PATH) -> Path:
    """Write the vocabulary as `tokenizer.json` + a matching `tokenizer_config.json` only (no `tiktoken.model`, no
    `auto_map`): the folder `KimiTokenizer` reads through its `tokenizers` backend."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = load_tiktoken_ranks(tiktoken_path)
    config = tokenizer_config(family, len(ranks))
    config.pop("auto_map")
    _write_hf_files(out, ranks, family, config)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--rebuild", action="store_true", help=f"retrain and overwrite {SMALL_TIKTOKEN_PATH.name}")
    action.add_argument("--check", action="store_true", help="retrain and compare with the shipped asset")
    args = parser.parse_args(argv)
    content = build_small_tiktoken()
    if args.rebuild:
        SMALL_TIKTOKEN_PATH.write_bytes(content)
        print(f"wrote {SMALL_TIKTOKEN_PATH} ({SMALL_NUM_BASE_TOKENS} base tokens)")
        return 0
    same = SMALL_TIKTOKEN_PATH.is_file() and SMALL_TIKTOKEN_PATH.read_bytes() == content
    print("asset matches the corpus" if same else "asset differs from a rebuild")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
