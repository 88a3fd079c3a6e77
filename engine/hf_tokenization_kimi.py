"""Kimi tokenizer for `transformers`: the `tokenization_kimi.py` that generated checkpoints ship.

Contract
--------
* `engine.tokenizer_build` writes this file into every generated checkpoint as `tokenization_kimi.py`, named by
  `tokenizer_config.json`'s `auto_map`, with the `from engine.tokenizer import ...` below replaced by the source of
  those definitions: the shipped file imports only the standard library, `tiktoken` and `transformers`. In the tree
  it imports `engine.tokenizer` and needs `transformers` (a dev dependency); nothing in kdamesh imports it.
* `AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` loads `TikTokenTokenizer`, a slow
  `PreTrainedTokenizer` over tiktoken. It reads the folder exactly as `engine.tokenizer.KimiTokenizer` does:
  `tiktoken.model` ranks are the base ids, the 256 ids after them are special (named from `added_tokens_decoder`, the
  rest `<|reserved_token_{id}|>`), text is pre-split with Kimi's regex and cut into 400k-character chunks and 25k runs.
* Encoding follows transformers' convention: by default special-token text becomes its special id (=
  `KimiTokenizer.encode(text, allow_special=True)`, what the gateway's `/tokenize` and `/v1/completions` do with a
  prompt, as vLLM does); with `split_special_tokens=True` it is ordinary text (= `KimiTokenizer.encode(text)`, as
  chat content always is and a prompt with `split_special_tokens: true`). Nothing is added around
  the ids (no BOS/EOS).
* Decoding joins the tokens' bytes and decodes UTF-8 with U+FFFD for invalid sequences; `skip_special_tokens` drops
  all 256 special ids (as `KimiTokenizer.decode`).
* Limitation: a base token spelled exactly like a special token's content would be read as the special one by
  transformers' added-token lookup; the vocabularies kdamesh writes have none (tests/unit/engine/test_hf_tokenizer.py).
"""

from __future__ import annotations

import base64  # noqa: F401  (used by load_tiktoken_ranks in the shipped file)
import os
import re  # noqa: F401  (used by _RUN_RE in the shipped file)
import shutil
from collections.abc import Iterator  # noqa: F401  (used by encode_chunks in the shipped file)
from pathlib import Path

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

from engine.tokenizer import (  # inlined into the shipped file
    NUM_RESERVED_SPECIAL_TOKENS,
    PAT_STR,
    TIKTOKEN_FILE,
    TIKTOKEN_MAX_ENCODE_CHARS,  # noqa: F401  (inlined into the shipped file)
    MAX_CONSECUTIVE_RUN_CHARS,  # noqa: F401  (inlined into the shipped file)
    _RUN_RE,  # noqa: F401  (inlined into the shipped file)
    byte_level_alphabet,
    load_tiktoken_ranks,
    split_long_runs,  # noqa: F401  (inlined into the shipped file)
    encode_chunks,
)

VOCAB_FILES_NAMES = {"vocab_file": TIKTOKEN_FILE}


def _special_token(content: str) -> AddedToken:
    return AddedToken(content, lstrip=False, rstrip=False, single_word=False, normalized=False, special=True)


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi's tiktoken BPE + 256 special ids as a transformers slow tokenizer (see the module contract)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str | AddedToken = "[BOS]",
        eos_token: str | AddedToken = "[EOS]",
        unk_token: str | AddedToken = "[UNK]",
        pad_token: str | AddedToken = "[PAD]",
        added_tokens_decoder: dict[int, AddedToken] | None = None,
        **tokenizer_config,
    ) -> None:
        """`tokenizer_config`: the other `tokenizer_config.json` entries, which transformers hands to every
        tokenizer's `__init__` and its base class reads (model_max_length, clean_up_tokenization_spaces, ...)."""
        self.vocab_file = vocab_file
        ranks = load_tiktoken_ranks(vocab_file)
        num_base = len(ranks)
        named = {int(i): str(token) for i, token in (added_tokens_decoder or {}).items()}
        special_ids = range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
        self._specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in special_ids}  # content -> id
        self._special_ids = frozenset(self._specials.values())
        self._encoding = tiktoken.Encoding(
            name=Path(vocab_file).name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self._specials
        )
        alphabet = byte_level_alphabet()
        self._byte_of = {ch: b for b, ch in alphabet.items()}
        self._id_bytes = [b""] * (num_base + NUM_RESERVED_SPECIAL_TOKENS)  # [vocab] the bytes each id stands for
        self._id_to_piece = [""] * len(self._id_bytes)  # [vocab] HF token strings (byte-level for base ids)
        for token, rank in ranks.items():
            self._id_bytes[rank], self._id_to_piece[rank] = token, "".join(alphabet[b] for b in token)
        for content, token_id in self._specials.items():
            self._id_bytes[token_id], self._id_to_piece[token_id] = content.encode("utf-8"), content
        self._piece_to_id = {piece: i for i, piece in enumerate(self._id_to_piece)}
        decoder = {i: _special_token(content) for content, i in self._specials.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=decoder, **tokenizer_config)

    @property
    def vocab_size(self) -> int:
        """Base + special ids (ids are 0..vocab_size-1)."""
        return len(self._id_to_piece)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._piece_to_id)

    def _tokenize(self, text: str, **unused) -> list[str]:
        """Text without special tokens -> byte-level token strings (`unused`: transformers' per-call options)."""
        ids = [i for chunk in encode_chunks(text) for i in self._encoding.encode_ordinary(chunk)]
        return [self._id_to_piece[i] for i in ids]

    def _convert_token_to_id(self, token: str) -> int:
        return self._piece_to_id.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_piece[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(
            token.encode("utf-8") if token in self._specials else bytes(self._byte_of[ch] for ch in token)
            for token in tokens
        )
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        return token_ids_0 + (token_ids_1 or [])

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                **unused) -> str:
        """Ids -> text from the tokens' bytes (`unused`: transformers' decode options this tokenizer lacks)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        kept = (i for i in ids if not (skip_special_tokens and i in self._special_ids))
        return b"".join(self._id_bytes[i] for i in kept).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + TIKTOKEN_FILE)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
