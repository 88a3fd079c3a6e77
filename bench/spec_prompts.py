"""Prompts of the speculative-decoding benchmark's text workloads, made with the model folder's own tokenizer.

- `code_prompts(folder, n)`: code completion — the first `CODE_PROMPT_TOKENS` tokens of the standard-library files
  the demo model held out of training (`heldout_files.txt` in its folder, paths relative to the running
  interpreter's stdlib), cycled to `n` prompts.
- `chat_prompts(folder, n)`: free text — `n` synthetic chat conversations of a seed the training never used
  (`trainer.generated.chat_prompts`: the demo model's own task generator, rendered by the gateway's K3 renderer
  up to the assistant's turn).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

CODE_PROMPT_TOKENS = 128
UNSEEN_CHAT_SEED = 987_654  # the demo model trained on seed 0 (trainer/config.py)


def _tokenizer(folder: str):
    from engine.tokenizer import KimiTokenizer

    return KimiTokenizer.from_pretrained(Path(folder))


def code_prompts(folder: str, n: int) -> list[list[int]]:
    listed = Path(folder) / "heldout_files.txt"
    if not listed.is_file():
        raise SystemExit(f"--workload code needs a model folder with heldout_files.txt (the demo model): {folder}")
    root = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = _tokenizer(folder)
    files = [root / line.strip() for line in listed.read_text().splitlines() if line.strip()]
    heads = [tokenizer.encode(f.read_text(encoding="utf-8"))[:CODE_PROMPT_TOKENS] for f in files if f.is_file()]
    return [heads[i % len(heads)] for i in range(n)]


def chat_prompts(folder: str, n: int) -> list[list[int]]:
    from trainer.generated import chat_prompts as seeded_chat_prompts

    return seeded_chat_prompts(_tokenizer(folder), n, UNSEEN_CHAT_SEED)
