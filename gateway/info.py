"""The bodies of `GET /version` and `GET /tokenizer_info` (vLLM's endpoints of the same names).

Contract:
- `version_body()` is `{"version": V}`, V the installed kdamesh distribution's version (`importlib.metadata`),
  or "unknown" when kdamesh runs from a source tree that was never installed.
- `tokenizer_info_body(tokenizer, max_model_len)` describes the served tokenizer as vLLM does (its tokenizer
  config, flattened): `tokenizer_class`, `model_max_length` (the served context length), `vocab_size`, the role
  tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`: their text, or null), `eos_token_ids` (every id
  that ends a generation) and `added_tokens_decoder` (special id, as a string -> `{"content", "special": true}`).
  The vocabulary itself is not included (as vLLM's default). Nothing here reads files: it is all the loaded
  tokenizer's.
"""

from __future__ import annotations

from importlib import metadata

from engine.tokenizer import KimiTokenizer

TOKENIZER_CLASS = "TikTokenTokenizer"  # the class name Kimi's tokenizer_config.json gives its tokenizer


def version_body() -> dict:
    try:
        version = metadata.version("kdamesh")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"version": version}


def tokenizer_info_body(tokenizer: KimiTokenizer, max_model_len: int | None) -> dict:
    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.convert_ids_to_tokens(token_id)

    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "bos_token": text(tokenizer.bos_token_id),
        "eos_token": text(tokenizer.eos_token_id),
        "pad_token": text(tokenizer.pad_token_id),
        "unk_token": text(tokenizer.unk_token_id),
        "eos_token_ids": list(tokenizer.stop_token_ids),
        "added_tokens_decoder": {str(i): {"content": content, "special": True} for content, i in specials},
    }
