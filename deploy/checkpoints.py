"""Where `kdamesh up` keeps what it generates (`kdamesh_home()`: $KDAMESH_HOME, default ~/.cache/kdamesh) and which
checkpoint it serves by default.

Contract:
- `SHIPPED_MODELS` are trained checkpoint folders committed in the repository (`demo-k3`: deploy/models/demo-k3,
  trained by `kdamesh train-demo`, docs/demo-model.md). `DEFAULT_PRESET` is `demo-k3`: `make serve` / `kdamesh up`
  serve it with no generation step.
- `resolve_model(name)`: a shipped model's name -> its folder; anything else (a folder path) unchanged.
- `default_model_dir(preset)`: a shipped model's folder as it is; a random preset (engine/model/presets.py) is
  generated under $KDAMESH_HOME on first use, and again when an older generator made it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
SHIPPED_MODELS = {"demo-k3": MODELS_DIR / "demo-k3"}
DEFAULT_PRESET = "demo-k3"


def kdamesh_home() -> Path:
    return Path(os.environ.get("KDAMESH_HOME") or Path.home() / ".cache" / "kdamesh")


# Bumped whenever make_checkpoint writes a folder differently (4: K3 presets ship chat_template.jinja; session 4: tokenizer.json + tokenization_kimi.py, the
# K3 vision tower; 3: the K3 presets' MTP layer): a generated checkpoint with another stamp is made again instead of
# served stale.
GENERATOR_VERSION = "4"
GENERATOR_STAMP = ".kdamesh-generator"


def resolve_model(name: str) -> str:
    """A shipped model's name -> its folder; a path is returned as given."""
    return str(SHIPPED_MODELS[name]) if name in SHIPPED_MODELS else name


def default_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    """The shipped folder of `preset`, or its generated checkpoint under $KDAMESH_HOME, created on first use (and
    again when it was made by an older generator: its `GENERATOR_STAMP` differs from `GENERATOR_VERSION`)."""
    if preset in SHIPPED_MODELS:
        folder = SHIPPED_MODELS[preset]
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"the shipped {preset} checkpoint is missing from {folder} (a partial checkout?)")
        return folder
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
