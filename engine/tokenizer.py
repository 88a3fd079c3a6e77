"""Kimi tokenizer: text <-> token ids for `kimi_linear` and `kimi_k3` checkpoints, plus streaming detokenisation.

Contract
--------
* Imports without torch (the gateway uses it). Depends on `tiktoken`; `tokenizers` only when a folder ships a
  `tokenizer.json` instead of a `tiktoken.model`.
* `KimiTokenizer.from_pretrained(dir)` reads Moonshot's released format unchanged:
  - `tiktoken.model`: one `base64(token bytes) rank` per line; ranks 0..N-1 are the N base tokens;
  - `tokenizer_config.json`: `added_tokens_decoder` names special ids; `bos_token`/`eos_token`/`pad_token`/
    `unk_token` (a string or an AddedToken-style dict);
  - the 256 ids N..N+255 are all special: named from `added_tokens_decoder`, the rest `<|reserved_token_{id}|>`
    (exactly as the official `tokenization_kimi.TikTokenTokenizer` does);
  - text is pre-split with Kimi's regex (`PAT_STR`), and like the official tokenizer every input is cut into
    400k-character chunks and runs of >25k whitespace / non-whitespace characters are cut (tiktoken misbehaves on
    longer runs), so ids match the official tokenizer exactly;
  - `generation_config.json` `eos_token_id` (int or list), when present, gives `stop_token_ids`.
  Without `tiktoken.model` a byte-level BPE `tokenizer.json` (HF `tokenizers` format) is read instead; its added
  tokens marked `special` are the special tokens.
* `encode(text, allow_special=False)` never produces a special id: special-token text typed by a user is encoded as
  ordinary bytes. Only the chat renderer's structural markers should be encoded with `allow_special=True`, which maps
  every special-token string (reserved names included) to its id.
* `decode(ids)` concatenates token bytes and decodes UTF-8 with U+FFFD for invalid sequences (tiktoken's behaviour);
  `decode(encode(s)) == s` for every str `s` without lone surrogates.
* `IncrementalDetokenizer` turns a stream of ids into text deltas that never split a UTF-8 character; the joined
  deltas (after `finish()`) equal `decode(all_ids)` whenever the full byte string is valid UTF-8.
The tokenizer is immutable after construction and safe to share between threads.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import tiktoken

# Kimi's pre-tokenizer, verbatim from the official tokenization_kimi.py (its long lines kept as published):
# Han runs, cased words with English contractions, 1-3 digit groups, punctuation runs, newlines, whitespace.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tiktoken panics above this (official tokenizer's limit)
MAX_CONSECUTIVE_RUN_CHARS = 25_000  # https://github.com/openai/tiktoken/issues/195

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_JSON_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_RUN_RE = re.compile(r"\s+|\S+")  # Python's \s is exactly str.isspace()


# ----------------------------------------------------------------------------------------------------------------
# Files and helpers


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies (HF `bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a `tiktoken.model` file: `base64(token bytes) rank` per line -> {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"{path}:{line_no}: malformed tiktoken line {line[:60]!r}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be unique and cover 0..{len(ranks) - 1}")
    return ranks


def split_long_runs(text: str, max_run: int = MAX_CONSECUTIVE_RUN_CHARS) -> list[str]:
    """Cut `text` so no piece holds more than `max_run` consecutive whitespace or non-whitespace characters.

    Same cut points as the official `_split_whitespaces_or_nonwhitespaces`: a run starting at `s` is cut at
    `s + k * max_run`. Always returns at least one piece (possibly the empty string).
    """
    if len(text) <= max_run:
        return [text]
    cuts = [0]
    for run in _RUN_RE.finditer(text):
        cuts.extend(range(run.start() + max_run, run.end(), max_run))
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def encode_chunks(text: str) -> Iterator[str]:
    """The pieces the official tokenizer hands to tiktoken: 400k-char chunks, then long runs cut."""
    for start in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from split_long_runs(text[start : start + TIKTOKEN_MAX_ENCODE_CHARS])


def _token_content(value: object) -> str | None:
    """A special-token entry of tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids_from_config(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []


# ----------------------------------------------------------------------------------------------------------------
# Backends: each turns one chunk of text into ids and describes its vocabulary as bytes.


@dataclass(frozen=True)
class _Vocab:
    """Everything the tokenizer needs besides an encoder function."""

    id_bytes: tuple[bytes, ...]  # [vocab_size] token bytes (special tokens: their UTF-8 content)
    base_ids: dict[bytes, int]  # base token bytes -> id
    special_tokens: dict[str, int]  # special content -> id
    num_base_tokens: int


def _tiktoken_backend(ranks: dict[bytes, int], added: dict[int, str], name: str):
    """tiktoken Encoding over `ranks` with the 256 reserved specials, named from `added` (id -> content)."""
    num_base = len(ranks)
    special_tokens = {
        added.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
    }
    if len(special_tokens) != NUM_RESERVED_SPECIAL_TOKENS:
        raise ValueError("duplicate special-token names in added_tokens_decoder")
    encoding = tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special_tokens)
    id_bytes = [b""] * (num_base + NUM_RESERVED_SPECIAL_TOKENS)
    for token, rank in ranks.items():
        id_bytes[rank] = token
    for content, token_id in special_tokens.items():
        id_bytes[token_id] = content.encode("utf-8")
    vocab = _Vocab(tuple(id_bytes), dict(ranks), special_tokens, num_base)

    def encode_chunk(chunk: str, allow_special: bool) -> list[int]:
        if allow_special:
            return encoding.encode(chunk, allowed_special="all")
        return encoding.encode_ordinary(chunk)

    return vocab, encode_chunk


def _is_byte_level(tokenizer_json: dict) -> bool:
    def has_byte_level(node: object) -> bool:
        if not isinstance(node, dict):
            return False
        return node.get("type") == "ByteLevel" or any(has_byte_level(d) for d in node.get("decoders") or [])

    return has_byte_level(tokenizer_json.get("decoder"))


def _hf_tokenizers_backend(path: Path):
    """A byte-level BPE `tokenizer.json`; added tokens marked special are the special tokens."""
    from tokenizers import Tokenizer  # only needed for this format

    text = path.read_text(encoding="utf-8")
    raw = json.loads(text)
    if not _is_byte_level(raw):
        raise ValueError(f"{path}: only byte-level tokenizer.json files are supported (decoder must be ByteLevel)")
    with_special = Tokenizer.from_str(text)
    plain = Tokenizer.from_str(text)
    plain.encode_special_tokens = True  # special-token text is split like ordinary text
    byte_of = {ch: b for b, ch in byte_level_alphabet().items()}
    vocab_size = with_special.get_vocab_size(with_added_tokens=True)
    special_tokens = {t["content"]: int(t["id"]) for t in raw.get("added_tokens", []) if t.get("special")}
    specials_by_id = {i: c for c, i in special_tokens.items()}
    id_bytes, base_ids = [b""] * vocab_size, {}
    for piece, token_id in with_special.get_vocab(with_added_tokens=True).items():
        if token_id in specials_by_id:
            id_bytes[token_id] = specials_by_id[token_id].encode("utf-8")
        elif all(ch in byte_of for ch in piece):
            id_bytes[token_id] = bytes(byte_of[ch] for ch in piece)
            base_ids[id_bytes[token_id]] = token_id
        else:  # a non-special added token stored as plain text
            id_bytes[token_id] = piece.encode("utf-8")
            base_ids[id_bytes[token_id]] = token_id
    num_base = with_special.get_vocab_size(with_added_tokens=False)
    vocab = _Vocab(tuple(id_bytes), base_ids, special_tokens, num_base)

    def encode_chunk(chunk: str, allow_special: bool) -> list[int]:
        engine = with_special if allow_special else plain
        return engine.encode(chunk, add_special_tokens=False).ids

    return vocab, encode_chunk


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer


class KimiTokenizer:
    """Encode/decode for Kimi checkpoints (tiktoken BPE + 256 reserved special ids). Immutable, thread-safe."""

    def __init__(
        self,
        vocab: _Vocab,
        encode_chunk: Callable[[str, bool], list[int]],
        role_tokens: dict[str, str | None],
        stop_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        """Prefer `from_pretrained`. `role_tokens` maps bos/eos/pad/unk to special-token content (or None)."""
        self._vocab = vocab
        self._encode_chunk = encode_chunk
        self._special_ids = frozenset(vocab.special_tokens.values())
        self._byte_level = byte_level_alphabet()
        self._byte_of = {ch: b for b, ch in self._byte_level.items()}
        self._role_ids = {role: self._role_id(role, content) for role, content in role_tokens.items()}
        eos = self._role_ids.get("eos")
        self.stop_token_ids: tuple[int, ...] = stop_token_ids or ((eos,) if eos is not None else ())

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "KimiTokenizer":
        """Load a checkpoint folder: `tiktoken.model` (+ `tokenizer_config.json`) or else `tokenizer.json`."""
        folder = Path(path)
        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        if (folder / TIKTOKEN_FILE).is_file():
            added = {int(i): _token_content(v) for i, v in config.get("added_tokens_decoder", {}).items()}
            added = {i: c for i, c in added.items() if c is not None}
            ranks = load_tiktoken_ranks(folder / TIKTOKEN_FILE)
            vocab, encode_chunk = _tiktoken_backend(ranks, added, name=str(folder / TIKTOKEN_FILE))
        elif (folder / TOKENIZER_JSON_FILE).is_file():
            vocab, encode_chunk = _hf_tokenizers_backend(folder / TOKENIZER_JSON_FILE)
        else:
            raise FileNotFoundError(f"{folder}: neither {TIKTOKEN_FILE} nor {TOKENIZER_JSON_FILE} found")
        roles = {role: _token_content(config.get(f"{role}_token")) for role in ("bos", "eos", "pad", "unk")}
        stop_ids = _ids_from_config(_read_json(folder / GENERATION_CONFIG_FILE).get("eos_token_id"))
        return cls(vocab, encode_chunk, roles, tuple(stop_ids) or None)

    def _role_id(self, role: str, content: str | None) -> int | None:
        if content is None:
            return None
        if content not in self._vocab.special_tokens:
            raise ValueError(f"{role}_token {content!r} is not a special token of this vocabulary")
        return self._vocab.special_tokens[content]

    # -- properties ----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids (base + special); ids are 0..vocab_size-1."""
        return len(self._vocab.id_bytes)

    @property
    def num_base_tokens(self) -> int:
        return self._vocab.num_base_tokens

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special-token content -> id (a copy), reserved names included."""
        return dict(self._vocab.special_tokens)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._role_ids["bos"]

    @property
    def eos_token_id(self) -> int | None:
        return self._role_ids["eos"]

    @property
    def pad_token_id(self) -> int | None:
        return self._role_ids["pad"]

    @property
    def unk_token_id(self) -> int | None:
        return self._role_ids["unk"]

    # -- encode / decode -----------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids. With `allow_special=False` special-token strings are ordinary text (never special ids)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = []
        for chunk in encode_chunks(text):
            ids.extend(self._encode_chunk(chunk, allow_special))
        return ids

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a special token: its UTF-8 content)."""
        if not 0 <= token_id < len(self._vocab.id_bytes):
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._vocab.id_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        return b"".join(
            self.id_to_bytes(i) for i in ids if not (skip_special_tokens and i in self._special_ids)
        )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """HF-style token strings: byte-level characters for base tokens, the content for special tokens."""
        if isinstance(ids, int):
            return self._token_string(ids)
        return [self._token_string(i) for i in ids]

    def _token_string(self, token_id: int) -> str:
        raw = self.id_to_bytes(token_id)
        if token_id in self._special_ids:
            return raw.decode("utf-8")
        return "".join(self._byte_level[b] for b in raw)

    def token_to_id(self, token: str) -> int | None:
        """A special token's content or a base token's byte-level string -> id; None when unknown."""
        if token in self._vocab.special_tokens:
            return self._vocab.special_tokens[token]
        if not all(ch in self._byte_of for ch in token):
            return None
        return self._vocab.base_ids.get(bytes(self._byte_of[ch] for ch in token))


# ----------------------------------------------------------------------------------------------------------------
# Streaming detokenisation


class IncrementalDetokenizer:
    """Ids in, text deltas out, never splitting a UTF-8 character.

    Incomplete trailing bytes are held back until a later token completes them; bytes that can never become valid
    are emitted as U+FFFD right away. `finish()` flushes what is held back (as U+FFFD). With `skip_special_tokens`
    special ids contribute nothing. Not thread-safe: one instance per stream.
    """

    def __init__(self, tokenizer: KimiTokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_tokens = 0  # ids pushed so far
        self.finished = False

    def push(self, ids: int | Iterable[int]) -> str:
        """Feed one id or several; returns the newly complete text (possibly empty)."""
        if self.finished:
            raise RuntimeError("push() after finish()")
        batch = [ids] if isinstance(ids, int) else list(ids)
        self.num_tokens += len(batch)
        data = self._tokenizer.decode_bytes(batch, skip_special_tokens=self._skip_special)
        return self._decoder.decode(data, final=False)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they do not yet form a complete character."""
        return self._decoder.getstate()[0]

    def finish(self) -> str:
        """Flush held-back bytes (as U+FFFD); the stream is closed afterwards."""
        if self.finished:
            return ""
        self.finished = True
        return self._decoder.decode(b"", final=True)
