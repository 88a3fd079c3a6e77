"""The demo model's corpus: standard-library sources split by file, the rendered synthetic chat set, the tokenizer.

Contract:
- `stdlib_files(limit_bytes)` lists the running interpreter's stdlib `.py` files (`sysconfig` "stdlib", without its
  `test`/`tests`/`idlelib` folders and `site-packages`), sorted by relative path; `split_files` puts every
  `HELDOUT_EVERY`-th of them into the held-out set (fixed by the sorted order, so the same interpreter gives the
  same split). `limit_bytes` caps the training files taken, in that order (the held-out set is not capped).
- `chat_texts(tokenizer_free=True)` / `render_chat(...)`: the synthetic chat set (`trainer.chat_data`, seeded),
  rendered by the gateway's K3 renderer with `add_generation_prompt=False` — exactly the text and ids the mesh
  renders for the same conversation.
- `train_tokenizer(texts, out_dir)` trains the byte-level BPE (`engine.tokenizer_build.train_bpe_ranks`, 7,936
  base tokens + the 256 K3 specials = 8,192) and writes the tokenizer files of the presets' layout there.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from engine.formats.markers import K3_STRUCTURAL_MARKERS
from engine.tokenizer import KimiTokenizer
from engine.tokenizer_build import SMALL_NUM_BASE_TOKENS, format_tiktoken_ranks, train_bpe_ranks, write_tokenizer
from gateway.chat.k3 import K3Renderer, render_pieces
from trainer.chat_data import ChatExample, make_example

HELDOUT_EVERY = 20
EXCLUDED_DIRS = ("test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo", "lib2to3")
HELDOUT_FILE = "heldout_files.txt"
TIKTOKEN_NAME = "demo.tiktoken"


@dataclass(frozen=True)
class StdlibSplit:
    root: Path
    train: list[Path]
    heldout: list[Path]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & set(EXCLUDED_DIRS)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(limit_bytes: int, root: Path | None = None) -> StdlibSplit:
    root = root or stdlib_root()
    files = stdlib_files(root)
    heldout = files[HELDOUT_EVERY - 1 :: HELDOUT_EVERY]
    held = set(heldout)
    train, total = [], 0
    for path in files:
        if path in held:
            continue
        size = path.stat().st_size
        if total + size > limit_bytes:
            break
        train.append(path)
        total += size
    return StdlibSplit(root, train, heldout)


def read_sources(paths: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def write_heldout_list(split: StdlibSplit, out_dir: Path) -> None:
    lines = [p.relative_to(split.root).as_posix() for p in split.heldout]
    (out_dir / HELDOUT_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


def chat_examples(count: int, seed: int) -> list[ChatExample]:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(count)]


def plain_chat_text(example: ChatExample) -> str:
    """The rendered conversation with the structural special tokens replaced by newlines (tokenizer training)."""
    pieces = render_pieces(example.messages, example.tools, add_generation_prompt=False,
                           chat_template_kwargs=example.template_kwargs)
    return "".join("\n" if p.special and p.text in K3_STRUCTURAL_MARKERS else p.text for p in pieces)


def render_chat(renderer: K3Renderer, example: ChatExample) -> list[int]:
    return renderer.render(example.messages, example.tools, add_generation_prompt=False,
                           chat_template_kwargs=example.template_kwargs).token_ids


def train_tokenizer(texts: list[str], work_dir: Path) -> Path:
    """Trains the BPE on `texts`; writes its ranks to `work_dir/TIKTOKEN_NAME` and the tokenizer files of the
    presets' layout into `work_dir/tokenizer`. Returns the ranks file (what `write_checkpoint` takes)."""
    (work_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
    ranks = train_bpe_ranks("\n".join(texts), SMALL_NUM_BASE_TOKENS)
    tiktoken_path = work_dir / TIKTOKEN_NAME
    tiktoken_path.write_bytes(format_tiktoken_ranks(ranks))
    write_tokenizer(work_dir / "tokenizer", "kimi_k3", tiktoken_path)
    return tiktoken_path


def load_tokenizer(work_dir: Path) -> KimiTokenizer:
    return KimiTokenizer.from_pretrained(work_dir / "tokenizer")
