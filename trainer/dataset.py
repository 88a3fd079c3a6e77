"""Token streams of the demo corpus and the seeded batches drawn from them.

Contract:
- `build_data(config, work_dir)` trains the tokenizer (once: kept in `work_dir`) and tokenizes the training and
  held-out stdlib files and the synthetic chat set into `TokenData` (cached as `work_dir/data.pt`, so a resumed run
  reads the same tokens). Code files are joined with a blank line; chat conversations are concatenated as rendered.
- `batch(data, config, step) -> [B, T + 1]` int64: row r is a chat window starting at a conversation start (with
  probability `chat_fraction`) or a code window at any offset. The draw is a function of (seed, step) only, so a run
  resumed from step s sees the batches an uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gateway.chat.k3 import K3Renderer
from trainer import corpus
from trainer.config import TrainConfig


@dataclass
class TokenData:
    chat: torch.Tensor  # [Nc] int64, conversations back to back
    chat_starts: torch.Tensor  # [C] offset of each conversation (only those with a full window after them)
    code: torch.Tensor  # [Nt] int64, training stdlib files
    heldout: torch.Tensor  # [Nh] int64, held-out stdlib files
    tiktoken_path: Path


def _ids(chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    starts, flat = [], []
    for ids in chunks:
        starts.append(len(flat))
        flat.extend(ids)
    return torch.tensor(flat, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)


def build_data(config: TrainConfig, work_dir: Path) -> TokenData:
    cache = work_dir / "data.pt"
    tiktoken_path = work_dir / corpus.TIKTOKEN_NAME
    if cache.is_file() and tiktoken_path.is_file():
        saved = torch.load(cache)
        return TokenData(saved["chat"], saved["chat_starts"], saved["code"], saved["heldout"], tiktoken_path)
    split = corpus.split_files(config.code_bytes)
    train_code, heldout_code = corpus.read_sources(split.train), corpus.read_sources(split.heldout)
    examples = corpus.chat_examples(config.chat_examples, config.seed)
    plain = [corpus.plain_chat_text(e) for e in examples[: config.tokenizer_chat_examples]]
    corpus.train_tokenizer(train_code + plain, work_dir)
    tokenizer = corpus.load_tokenizer(work_dir)
    renderer = K3Renderer(tokenizer)
    chat, chat_starts = _ids([corpus.render_chat(renderer, e) for e in examples])
    code, _ = _ids([tokenizer.encode(text + "\n\n") for text in train_code])
    heldout, _ = _ids([tokenizer.encode(text + "\n\n") for text in heldout_code])
    chat_starts = chat_starts[chat_starts + config.seq_len + 1 <= chat.numel()]
    torch.save({"chat": chat, "chat_starts": chat_starts, "code": code, "heldout": heldout}, cache)
    (work_dir / corpus.HELDOUT_FILE).write_text(
        "\n".join(p.relative_to(split.root).as_posix() for p in split.heldout) + "\n", encoding="utf-8")
    return TokenData(chat, chat_starts, code, heldout, tiktoken_path)


def batch(data: TokenData, config: TrainConfig, step: int) -> torch.Tensor:
    """[B, T + 1] int64 training rows for `step` (see the module docstring)."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    width = config.seq_len + 1
    rows = []
    for _ in range(config.batch_size):
        if torch.rand((), generator=gen) < config.chat_fraction:
            start = int(data.chat_starts[torch.randint(data.chat_starts.numel(), (), generator=gen)])
            rows.append(data.chat[start : start + width])
        else:
            start = int(torch.randint(data.code.numel() - width, (), generator=gen))
            rows.append(data.code[start : start + width])
    return torch.stack(rows)
