"""`kdamesh train-demo OUT_DIR`: trains the demo K3 model and writes it as a K3 checkpoint folder.

Contract:
- `train(config)` builds the corpus and tokenizer (`trainer.dataset`), the `demo_k3_config` model as the engine's
  own `KimiForCausalLM` (seeded init), and trains it with AdamW on next-token cross-entropy through
  `trainer.forward.train_forward` (warm-up, then cosine decay to `min_lr_ratio` over the step or time budget). Router
  biases follow the aux-loss-free rule of `noaux_tc` (raised for under-loaded experts, lowered for over-loaded ones).
- The run ends after `config.steps` steps or `time_budget_s` seconds of training, whichever comes first.
- Resumable: the state (weights, optimizer, step, elapsed time) is saved atomically to `OUT_DIR/.train/state.pt`
  at most every `save_every_s` and at the end; a run on the same OUT_DIR continues from it (the batches are a
  function of the step, the schedule continues from the saved elapsed time). A state from a different configuration
  is refused.
- Then the drafters are distilled from the written target (`trainer.distill`: the MTP layer joins the target's
  safetensors, the DSpark drafter goes to OUT_DIR/dspark); not resumable within, it reruns whole.
- `redistill(folder, drafters, command)` (`kdamesh distill-demo FOLDER`): distils the drafters of an already trained
  folder again (the target unchanged, bit for bit) and records them in its `training_run.json` (`drafters`,
  `distill_config`, `distill_command`); with `DistillConfig.generated` no corpus is needed.
- Output: OUT_DIR holds the checkpoint (`engine.model.checkpoint.write_checkpoint`: config.json, bf16 safetensors,
  tokenizer, generation_config.json), `heldout_files.txt`, `training_log.txt` (one line per logged step) and
  `training_run.json` (command, Python and torch versions, steps, tokens seen, wall time). A progress bar goes to
  stderr.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.checkpoint import count_parameters, write_checkpoint
from engine.model.config import ModelConfig
from engine.model.init import init_random_weights
from engine.model.loader import build_empty_model
from engine.model.model import KimiForCausalLM
from engine.model.presets import demo_k3_config
from trainer import corpus, dataset
from trainer.config import DistillConfig, TrainConfig
from trainer.distill import distill
from trainer.forward import train_forward

LOG_FILE = "training_log.txt"
RUN_FILE = "training_run.json"
WORK_DIR = ".train"


def build_model(raw: dict, seed: int) -> KimiForCausalLM:
    model = build_empty_model(ModelConfig.from_dict(raw), torch.float32, "cpu")
    init_random_weights(model, seed=seed)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith("e_score_correction_bias"))
    return model


def make_optimizer(model: KimiForCausalLM, config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))


def learning_rate(config: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr_ratio` over the run's progress: the larger
    of the step share and the share of `time_budget_s` spent."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, max(step / config.steps, elapsed / config.time_budget_s))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model: KimiForCausalLM, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """rows [B, T+1] -> (mean next-token cross-entropy, expert loads per MoE layer)."""
    out = train_forward(model, rows[:, :-1])
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), rows[:, 1:].reshape(-1)), out.expert_loads


@torch.no_grad()
def balance_routers(model: KimiForCausalLM, loads: list[torch.Tensor], rate: float) -> None:
    gates = [layer.block_sparse_moe.gate for layer in model.model.layers if layer.spec.ffn == "moe"]
    for gate, load in zip(gates, loads):
        load = load.float()
        gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


class Progress:
    """A one-line progress bar on stderr: the share of the step or time budget done, whichever is larger."""

    def __init__(self, config: TrainConfig, start: int, elapsed: float):
        self.config, self.start, self.elapsed0 = config, start, elapsed

    def update(self, step: int, loss: float, elapsed: float) -> None:
        done = min(1.0, max(step / self.config.steps, elapsed / self.config.time_budget_s))
        rate = (step - self.start) / max(elapsed - self.elapsed0, 1e-9)
        bar = "#" * int(30 * done)
        sys.stderr.write(f"\r[{bar:<30}] step {step} loss {loss:.3f} {rate * 60:.1f} steps/min "
                         f"{elapsed / 60:.1f}/{self.config.time_budget_s / 60:.0f} min ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _state_path(out: Path) -> Path:
    return out / WORK_DIR / "state.pt"


def save_state(out: Path, model, optimizer, step: int, elapsed: float, config: TrainConfig) -> None:
    path = _state_path(out)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "config": dataclasses.asdict(config) | {"out_dir": None}}, tmp)
    tmp.replace(path)  # a half-written state is never mistaken for a whole one


def load_state(out: Path, model, optimizer, config: TrainConfig) -> tuple[int, float]:
    """(next step, elapsed seconds) of a saved run on `out`, (0, 0.0) when there is none."""
    path = _state_path(out)
    if not path.is_file():
        return 0, 0.0
    state = torch.load(path, weights_only=False)
    expected = dataclasses.asdict(config) | {"out_dir": None}
    if state["config"] != expected:
        changed = sorted(k for k in expected if state["config"].get(k) != expected[k])
        raise ValueError(f"{path} was saved by a run with other settings ({', '.join(changed)}); "
                         f"use another OUT_DIR or delete {path.parent}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["elapsed"]


def _log(out: Path, line: str, fresh: bool) -> None:
    with open(out / LOG_FILE, "w" if fresh else "a", encoding="utf-8") as log:
        log.write(line + "\n")


def _train_steps(model, optimizer, data, config: TrainConfig, out: Path, start: int,
                 elapsed: float) -> tuple[int, float]:
    """Steps from `start` until `config.steps` or the time budget; -> (steps done in all, elapsed seconds)."""
    progress, t0, last_save = Progress(config, start, elapsed), time.monotonic() - elapsed, time.monotonic()
    tokens_per_step = config.batch_size * config.seq_len
    if start == 0:
        _log(out, "step tokens loss lr elapsed_s", fresh=True)
    step = start
    while step < config.steps and time.monotonic() - t0 < config.time_budget_s:
        lr = learning_rate(config, step, time.monotonic() - t0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, loads = lm_loss(model, dataset.batch(data, config, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        balance_routers(model, loads, config.bias_update_rate)
        step += 1
        progress.update(step, loss.item(), time.monotonic() - t0)
        if step % config.log_every == 1 or config.log_every == 1:
            _log(out, f"{step} {step * tokens_per_step} {loss.item():.4f} {lr:.2e} {time.monotonic() - t0:.1f}",
                 fresh=False)
        if time.monotonic() - last_save > config.save_every_s:
            save_state(out, model, optimizer, step, time.monotonic() - t0, config)
            last_save = time.monotonic()
    save_state(out, model, optimizer, step, time.monotonic() - t0, config)
    progress.close()
    return step, time.monotonic() - t0


def train(config: TrainConfig, command: list[str] | None = None, drafters: DistillConfig | None = DistillConfig()
          ) -> Path:
    """Runs (or resumes) the training described by `config`, then distils the drafters (`drafters`; None: none);
    returns OUT_DIR (see the module docstring)."""
    torch.set_num_threads(config.threads)
    out = Path(config.out_dir)
    (out / WORK_DIR).mkdir(parents=True, exist_ok=True)
    data = dataset.build_data(config, out / WORK_DIR)
    raw = demo_k3_config(tiny=config.tiny)
    torch.manual_seed(config.seed)
    model = build_model(raw, config.seed)
    optimizer = make_optimizer(model, config)
    start, elapsed = load_state(out, model, optimizer, config)
    steps = start
    if start < config.steps and elapsed < config.time_budget_s:
        steps, elapsed = _train_steps(model, optimizer, data, config, out, start, elapsed)
    write_checkpoint(model, raw, out, torch.bfloat16, seed=config.seed, tiktoken_path=data.tiktoken_path)
    shutil.copyfile(out / WORK_DIR / corpus.HELDOUT_FILE, out / corpus.HELDOUT_FILE)
    summary = (distill(out, drafters, config.tiny, out / WORK_DIR / "data.pt", code_bytes=config.code_bytes)
               if drafters else None)
    run = {"command": command or sys.argv, "python": platform.python_version(), "torch": torch.__version__,
           "config": dataclasses.asdict(config), "parameters": count_parameters(model),
           "steps": steps,
           "tokens_seen": steps * config.batch_size * config.seq_len, "train_seconds": round(elapsed, 1),
           "threads": config.threads, "drafters": summary,
           "distill_config": dataclasses.asdict(drafters) if drafters else None}
    (out / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    return out


def redistill(folder: Path, drafters: DistillConfig, command: list[str] | None = None) -> Path:
    """Distils the drafters of the trained `folder` again (see the module docstring); -> folder."""
    folder = Path(folder)
    run = json.loads((folder / RUN_FILE).read_text())
    config = run["config"]
    data_path = folder / WORK_DIR / "data.pt"
    summary = distill(folder, drafters, config["tiny"], data_path if data_path.is_file() else None,
                      code_bytes=config["code_bytes"])
    run |= {"drafters": summary, "distill_config": dataclasses.asdict(drafters),
            "distill_command": " ".join(command or sys.argv)}
    (folder / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    return folder
