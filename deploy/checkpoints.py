"""Where `kdamesh up` keeps what it generates (`kdamesh_home()`: $KDAMESH_HOME, default ~/.cache/kdamesh) and its
default checkpoint (`default_model_dir(preset)`: generated on first use, and again when an older generator made it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_PRESET = "small-k3"


def kdamesh_home() -> Path:
    return Path(os.environ.get("KDAMESH_HOME") or Path.home() / ".cache" / "kdamesh")


# Bumped whenever make_checkpoint writes a folder differently (session 4: tokenizer.json + tokenization_kimi.py, the
# K3 vision tower; 3: the K3 presets' MTP layer): a generated checkpoint with another stamp is made again instead of
# served stale.
GENERATOR_VERSION = "3"
GENERATOR_STAMP = ".kdamesh-generator"


def default_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    """The generated checkpoint of `preset` under $KDAMESH_HOME, created on first use (and again when it was made
    by an older generator: its `GENERATOR_STAMP` differs from `GENERATOR_VERSION`)."""
    folder = kdamesh_home() / "checkpoints" / preset
    stamp = folder / GENERATOR_STAMP
    if not (folder / "config.json").is_file() or not stamp.is_file() or stamp.read_text() != GENERATOR_VERSION:
        from engine.model.checkpoint import make_checkpoint

        print(f"kdamesh: generating the {preset} checkpoint in {folder} (first run, or a newer layout)…", flush=True)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(preset, tmp)
        (tmp / GENERATOR_STAMP).write_text(GENERATOR_VERSION)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # a half-written checkpoint is never mistaken for a whole one
    return folder
