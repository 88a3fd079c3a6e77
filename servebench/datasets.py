"""Benchmark prompts: `random`, `prefix_repetition` and `custom` (a JSONL file), with `vllm bench serve`'s meaning.

- `random`: per request an input length from the integers [floor(L·(1−r)), ceil(L·(1+r))] and an output length from
  [max(1, floor(O·(1−r))), max(1, ceil(O·(1+r)))] (L = `--random-input-len`, O = `--random-output-len`,
  r = `--random-range-ratio` in [0, 1)), after a fixed prefix of `--random-prefix-len` tokens shared by all requests.
  Token ids are drawn uniformly from the tokenizer's ordinary (non-special) ids.
- `prefix_repetition`: `--prefix-repetition-num-prefixes` random prefixes of `-prefix-len` tokens, each followed by
  `num_prompts // num_prefixes` different random suffixes of `-suffix-len` tokens, `-output-len` output tokens each;
  shuffled unless `--disable-shuffle`.
- `custom`: a JSONL file with a `prompt` per line (optionally `output_tokens`), `--custom-output-len` output tokens
  (default 256); shuffled unless `--disable-shuffle`; repeated to `--num-prompts` unless `--no-oversample`. For a
  completions endpoint the prompt is put in the model's chat format (as a user turn) and sent as token ids, unless
  `--skip-chat-template`; for a chat endpoint it is sent as the user message.
Text prompts of exact token lengths: the ids are decoded to text and re-encoded; when the count differs the ids are
truncated or padded with more random ids and the round trip repeated (at most 10 times, as vLLM); when that does not
settle, the random part is drawn afresh (at most 10 draws), and only then is a remaining mismatch counted and
reported. With `token_ids=True` (`--prompt-token-ids`, completions only) the ids themselves are sent: exact lengths,
and prefixes that share token ids share cache blocks exactly.
All randomness comes from `numpy.random.default_rng(seed)` (and `random.Random(seed)` for shuffles): the same seed
gives the same prompts.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

MAX_RETRY = 10  # decode / re-encode rounds per draw (vLLM's)
MAX_DRAWS = 10  # fresh random draws before a length mismatch is accepted


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class SampleRequest:
    """One prompt to send: text, token ids, or chat messages."""

    prompt: str | list[int] | list[dict]
    prompt_len: int
    expected_output_len: int
    request_id: str = ""
    prompt_token_ids: list[int] | None = None  # the ids the prompt stands for, when known


def ordinary_ids(tokenizer: Any) -> np.ndarray:
    """Token ids that are not special tokens (what random prompts are drawn from)."""
    special = set(getattr(tokenizer, "special_token_ids", ()) or ())
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def text_of_length(tokenizer: Tokenizer, ids: list[int], target: int, allowed: np.ndarray,
                   rng: np.random.Generator) -> tuple[str, list[int], int]:
    """(text, its ids, mismatch): text that encodes to `target` tokens, starting from `ids` (vLLM's
    decode / re-encode / truncate-or-pad loop). `mismatch` is len(ids) - target after the last try (0 on success)."""
    seq = list(ids)
    for attempt in range(MAX_RETRY + 1):
        text = tokenizer.decode(seq)
        seq = tokenizer.encode(text)
        if len(seq) == target or attempt == MAX_RETRY:
            break
        if len(seq) < target:
            seq += allowed[rng.integers(0, len(allowed), size=target - len(seq))].tolist()
        else:
            seq = seq[:target]
    return text, seq, len(seq) - target


class _PromptMaker:
    """Random ids -> a prompt (text of the exact length, or the ids)."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator, token_ids: bool):
        self.tokenizer, self.rng, self.token_ids = tokenizer, rng, token_ids
        self.allowed = ordinary_ids(tokenizer)
        self.mismatch = 0

    def ids(self, n: int) -> list[int]:
        return self.allowed[self.rng.integers(0, len(self.allowed), size=n)].tolist() if n > 0 else []

    def exact(self, ids: list[int], keep: int = 0) -> tuple[str | list[int], list[int]]:
        """A prompt for `ids`: the ids themselves, or text of the same length (and the ids it encodes to). When the
        round trip does not reach the length, ids after the first `keep` are drawn afresh (up to MAX_DRAWS times)."""
        if self.token_ids:
            return list(ids), list(ids)
        for _ in range(MAX_DRAWS):
            text, seq, mismatch = text_of_length(self.tokenizer, ids, len(ids), self.allowed, self.rng)
            if mismatch == 0:
                return text, seq
            ids = list(ids[:keep]) + self.ids(len(ids) - keep)
        self.mismatch += mismatch
        return text, seq

    def warn(self) -> None:
        if self.mismatch:
            log.warning("across all generated prompts there were %d %s tokens than asked for after decoding and "
                        "re-encoding", abs(self.mismatch), "more" if self.mismatch > 0 else "fewer")


def length_range(mean: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """[floor(mean·(1−r)), ceil(mean·(1+r))], each at least `minimum`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low = max(math.floor(mean * (1 - range_ratio)), minimum)
    high = max(math.ceil(mean * (1 + range_ratio)), minimum)
    return low, high


def sample_random(tokenizer: Tokenizer, num_requests: int, *, input_len: int = 1024, output_len: int = 128,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0, token_ids: bool = False,
                  request_id_prefix: str = "") -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    maker = _PromptMaker(tokenizer, rng, token_ids)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio, minimum=1)
    if prefix_len + in_low < 1:
        raise ValueError("--random-input-len is too small: the shortest prompt (prefix + sampled) would be empty")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    prefix = maker.ids(prefix_len)
    requests = []
    for i in range(num_requests):
        prompt, ids = maker.exact(prefix + maker.ids(int(input_lens[i])), keep=prefix_len)
        requests.append(SampleRequest(prompt, len(ids), int(output_lens[i]), f"{request_id_prefix}{i}", ids))
    maker.warn()
    return requests


def sample_prefix_repetition(tokenizer: Tokenizer, num_requests: int, *, prefix_len: int = 256,
                             suffix_len: int = 256, num_prefixes: int = 10, output_len: int = 128, seed: int = 0,
                             token_ids: bool = False, shuffle: bool = True,
                             request_id_prefix: str = "") -> list[SampleRequest]:
    per_prefix = num_requests // num_prefixes if num_prefixes > 0 else 0
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({num_requests}) must be at least --prefix-repetition-num-prefixes "
                         f"({num_prefixes})")
    rng = np.random.default_rng(seed)
    maker = _PromptMaker(tokenizer, rng, token_ids)
    requests = []
    for _ in range(num_prefixes):
        _, prefix = maker.exact(maker.ids(prefix_len))
        for _ in range(per_prefix):
            _, suffix = maker.exact(maker.ids(suffix_len))
            ids = prefix + suffix
            prompt = ids if token_ids else tokenizer.decode(ids)
            requests.append(SampleRequest(prompt, len(ids), output_len, "", ids))
    maker.warn()
    if shuffle:
        random.Random(seed).shuffle(requests)
    for i, r in enumerate(requests):
        r.request_id = f"{request_id_prefix}{i}"
    return requests


def load_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{n}: every line must be a JSON object with a 'prompt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def sample_custom(path: str | Path, num_requests: int, *, tokenizer: Tokenizer | None = None,
                  output_len: int = 256, seed: int = 0, shuffle: bool = True, oversample: bool = True,
                  chat_renderer: Any = None, chat_endpoint: bool = False,
                  request_id_prefix: str = "") -> list[SampleRequest]:
    """Prompts from a JSONL file. `chat_renderer` (a `gateway.chat.ChatRenderer`) puts them in the chat format for a
    completions endpoint (sent as token ids); on a chat endpoint they go as user messages."""
    rows = load_jsonl(path)
    if shuffle:
        random.Random(seed).shuffle(rows)
    if num_requests <= 0:
        num_requests = len(rows)
    requests: list[SampleRequest] = []
    for row in rows[:num_requests]:
        text = row["prompt"]
        out_len = int(row.get("output_tokens") or output_len)
        ids: list[int] | None = None
        prompt: str | list[int] = text
        if chat_renderer is not None:
            ids = chat_renderer.render([{"role": "user", "content": text}]).token_ids
            if not chat_endpoint:
                prompt = ids
        elif tokenizer is not None:
            ids = tokenizer.encode(text)
        requests.append(SampleRequest(prompt, len(ids) if ids is not None else 0, out_len, "", ids))
    if oversample and len(requests) < num_requests:
        extra = random.Random(seed + 1).choices(requests, k=num_requests - len(requests))
        requests += [SampleRequest(r.prompt, r.prompt_len, r.expected_output_len, "", r.prompt_token_ids)
                     for r in extra]
    for i, r in enumerate(requests):
        r.request_id = f"{request_id_prefix}{i}"
    return requests


def get_samples(args: Any, tokenizer: Tokenizer | None, *, chat_endpoint: bool = False,
                chat_renderer: Any = None) -> list[SampleRequest]:
    """The prompts `args` (parsed `kdamesh bench serve` flags) ask for."""
    name = args.dataset_name
    prefix = getattr(args, "request_id_prefix", "") or ""
    if name in ("random", "prefix_repetition"):
        if args.dataset_path is not None:
            raise ValueError(f"--dataset-name {name} takes no --dataset-path (use --dataset-name custom for a file)")
        if tokenizer is None:
            raise ValueError(f"the {name} dataset needs a tokenizer: pass --tokenizer CHECKPOINT_DIR (or --model as "
                             "a local checkpoint folder)")
    if name == "random":
        return sample_random(tokenizer, args.num_prompts, input_len=args.random_input_len,
                             output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                             prefix_len=args.random_prefix_len, seed=args.seed, token_ids=args.prompt_token_ids,
                             request_id_prefix=prefix)
    if name == "prefix_repetition":
        return sample_prefix_repetition(
            tokenizer, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len, num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len, seed=args.seed, token_ids=args.prompt_token_ids,
            shuffle=not args.disable_shuffle, request_id_prefix=prefix)
    if name == "custom":
        if args.dataset_path is None:
            raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
        return sample_custom(args.dataset_path, args.num_prompts, tokenizer=tokenizer,
                             output_len=args.custom_output_len, seed=args.seed, shuffle=not args.disable_shuffle,
                             oversample=not args.no_oversample,
                             chat_renderer=None if args.skip_chat_template else chat_renderer,
                             chat_endpoint=chat_endpoint, request_id_prefix=prefix)
    raise ValueError(f"unknown --dataset-name {name!r}; choose from random, prefix_repetition, custom")
