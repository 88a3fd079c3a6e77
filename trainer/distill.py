"""Distils the two drafters of the demo model from the trained target: K3's MTP layer and a DSpark drafter.

Contract:
- `distill(out_dir, config, tiny, data_path)` reads the trained target from OUT_DIR (the engine's loader, fp32
  compute over the shipped bf16 weights, so the drafters learn the target that is served) and its data: with
  `DistillConfig.generated`, the target's own greedy continuations of training prompts (trainer/generated.py), else
  the corpus token streams (`OUT_DIR/.train/data.pt`). It trains each drafter for `DistillConfig` steps or seconds:
  teacher forward (`trainer.forward.train_forward` with the drafter's taps) on chat and code windows
  (`DistillConfig.code_fraction`), loss the KL divergence from the target's next-token distribution at the position
  the draft predicts (MTP row t -> the target at t + 1; DSpark block at anchor p, draft i -> the target at p + i),
  on generated data only where serving drafts: MTP rows whose input token the target generated, DSpark anchors whose
  next token it generated.
- The MTP layer (`engine.spec.mtp_model.MTPLayer`, the target's embedding frozen) is written into the target's own
  safetensors under `language_model.model.layers.{num_hidden_layers}.*` with `num_nextn_predict_layers: 1` in
  config.json (the released layout; the target loader sets it aside). The DSpark drafter
  (`engine.spec.dspark_model.DSparkModel`, the target's embedding and LM head frozen) is written as its own
  `k3_dspark` folder `OUT_DIR/dspark` (config from `engine.model.presets.demo_k3_dspark_config`).
- Returns a summary per drafter (steps, seconds, last loss; on held-out windows — of held-out pieces with generated
  data — the top-1 agreement with the target and the mean count of a block's leading drafts it agrees on) that
  `trainer.train` records in training_run.json; losses go to `distill_log.txt`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.model.config import ModelConfig
from engine.model.init import sample_tensor
from engine.model.loader import LoadConfig, load_model, official_tensors
from engine.model.presets import demo_k3_dspark_config
from engine.spec.drafter import FINAL_TAP
from engine.spec.dspark_model import DSparkConfig, DSparkModel
from engine.spec.mtp_model import build_mtp_layers
from trainer.config import DistillConfig, TrainConfig
from trainer.forward import train_forward
from trainer.generated import generated_streams

DISTILL_LOG = "distill_log.txt"
DSPARK_DIR = "dspark"


@dataclass
class Teacher:
    ids: torch.Tensor  # [B, T]
    logits: torch.Tensor  # [B, T, V] fp32
    taps: dict[int, torch.Tensor]  # tap id -> [B, T, D]
    generated: torch.Tensor  # [B, T] bool: tokens the target generated (all True on corpus windows)


HELDOUT_SHARE = 20  # generated data: the last 1/20 of each kind's pieces are held out for the agreement


def _piece_starts(data: dict, kind: str, heldout: bool) -> torch.Tensor | None:
    """Offsets windows of `kind` may start at (None: anywhere); generated pieces split into training / held out."""
    starts = data.get(f"{kind}_starts")
    if starts is None or f"{kind}_generated" not in data or starts.numel() < 2:
        return starts
    cut = starts.numel() - max(1, starts.numel() // HELDOUT_SHARE)
    return starts[cut:] if heldout else starts[:cut]


def windows(data: dict, config: DistillConfig, step: int, heldout: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], generated [B, T] bool) for `step` (seeded by it): each row a chat window from a piece start or,
    with probability `config.code_fraction`, a code window (from a piece start where the data has pieces, at a
    random offset otherwise). `generated` marks the target's own tokens (all True where the data has no mask)."""
    gen = torch.Generator().manual_seed(config.seed * 7_000_003 + step)
    rows, masks = [], []
    for _ in range(config.batch_size):
        kind = "code" if float(torch.rand((), generator=gen)) < config.code_fraction else "chat"
        stream, starts = data[kind], _piece_starts(data, kind, heldout)
        if starts is None:
            at = int(torch.randint(stream.numel() - config.seq_len, (), generator=gen))
        else:
            at = int(starts[torch.randint(starts.numel(), (), generator=gen)])
        rows.append(stream[at: at + config.seq_len])
        mask = data.get(f"{kind}_generated")
        masks.append(mask[at: at + config.seq_len] if mask is not None else torch.ones(config.seq_len, dtype=bool))
    return torch.stack(rows), torch.stack(masks)


@torch.no_grad()
def teacher(target, window: tuple[torch.Tensor, torch.Tensor], taps: tuple[int, ...]) -> Teacher:
    ids, generated = window
    out = train_forward(target, ids, taps)
    return Teacher(ids, out.logits, out.taps, generated)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student); both [..., V]."""
    student = F.log_softmax(student_logits.reshape(-1, student_logits.shape[-1]).float(), dim=-1)
    target = F.log_softmax(teacher_logits.reshape(-1, teacher_logits.shape[-1]).float(), dim=-1)
    return F.kl_div(student, target, log_target=True, reduction="batchmean")


def mtp_outputs(layer, t: Teacher, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(student [R, 1, V], teacher [R, 1, V]) over the rows that train: MTP row r (the target's hidden at r, token
    r + 1) predicts token r + 2, which the target predicts at r + 1; a row trains where token r + 1 is the target's
    own, as every token an MTP step reads in serving is (`anchors` unused)."""
    student = torch.stack([layer.forward_train(t.taps[FINAL_TAP][b], t.ids[b]) for b in range(t.ids.shape[0])])
    rows = t.generated[:, 1:]  # [B, T-1]
    rows = rows if rows.any() else torch.ones_like(rows)  # windows of prompts only: every row, as on the corpus
    return student[rows][:, None], t.logits[:, 1:][rows][:, None]


def dspark_outputs(model: DSparkModel, t: Teacher, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(student [B, A, N, V], teacher [B, A, N, V]): draft i of the block at anchor p (row b's `anchors[b]`)
    predicts token p + 1 + i, which the target predicts at p + i."""
    layers = model.config.target_layer_ids
    n = model.config.block_size
    students, teachers = [], []
    for b in range(t.ids.shape[0]):
        hidden = torch.cat([t.taps[i][b] for i in layers], dim=-1)  # [T, n_taps * D]
        students.append(model.forward_train(hidden, t.ids[b], anchors[b]))
        teachers.append(t.logits[b][anchors[b][:, None] + torch.arange(n)])  # [A, N, V]
    return torch.stack(students), torch.stack(teachers)


def _anchors(config: DistillConfig, block: int, step: int, generated: torch.Tensor) -> torch.Tensor:
    """[B, A] block anchors p in [1, T - block) per row, drawn among those whose next token the target generated
    (where drafting starts in serving); a row with none draws among all."""
    gen = torch.Generator().manual_seed(config.seed * 9_000_011 + step)
    positions = torch.arange(1, config.seq_len - block)  # [P]
    rows = []
    for mask in generated:
        allowed = positions[mask[positions + 1]]
        allowed = allowed if allowed.numel() else positions
        rows.append(allowed[torch.randint(allowed.numel(), (config.anchors,), generator=gen)])
    return torch.stack(rows)


def _fit(name: str, module: torch.nn.Module, outputs, target, data: dict, config: DistillConfig, taps, block: int,
         log) -> dict:
    """Trains `module` on `outputs(module, teacher, anchors)` pairs; -> summary (see the module docstring)."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0, step, loss = time.monotonic(), 0, torch.tensor(float("nan"))
    while step < config.steps and time.monotonic() - t0 < config.time_budget_s:
        progress = max(step / config.steps, (time.monotonic() - t0) / config.time_budget_s)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / 10) * (1.0 - 0.9 * min(1.0, progress))
        t = teacher(target, windows(data, config, step), taps)
        loss = kl_to_teacher(*outputs(module, t, _anchors(config, block, step, t.generated)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        log(f"{name} {step} {loss.item():.4f} {time.monotonic() - t0:.1f}")
    return {"steps": step, "seconds": round(time.monotonic() - t0, 1), "last_kl": round(loss.item(), 4)
            } | _agreement(module, outputs, target, data, config, taps, block)


@torch.no_grad()
def _agreement(module, outputs, target, data: dict, config: DistillConfig, taps, block: int) -> dict:
    """On windows of steps the training never drew (of held-out pieces, with generated data): the share of draft
    positions whose argmax equals the target's, and the mean count of a block's leading drafts that do (what
    greedy verification accepts of it)."""
    hits = total = leading = blocks = 0
    for step in range(10**6, 10**6 + 4):
        t = teacher(target, windows(data, config, step, heldout=True), taps)
        student, expected = outputs(module, t, _anchors(config, block, step, t.generated))
        match = student.argmax(-1) == expected.argmax(-1)  # [..., N]
        hits, total = hits + int(match.sum()), total + match.numel()
        leading += int(match.int().cumprod(-1).sum())
        blocks += match[..., 0].numel()
    return {"top1_agreement_heldout": round(hits / total, 4), "leading_drafts_heldout": round(leading / blocks, 4)}


def _mtp_layer(target, raw: dict, seed: int):
    raw = json.loads(json.dumps(raw))
    raw["text_config"]["num_nextn_predict_layers"] = 1
    config = ModelConfig.from_dict(raw)
    layer = build_mtp_layers(config, target.model.embed_tokens, torch.float32, "cpu")[0]
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(sample_tensor(f"mtp:{layer.config.weight_prefix}{name}", tuple(param.shape), seed))
    return layer.train().requires_grad_(True), raw


def _dspark(target, tiny: bool, seed: int) -> tuple[DSparkModel, dict]:
    raw = demo_k3_dspark_config(tiny)
    model = DSparkModel(DSparkConfig.from_dict(raw), target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(sample_tensor(f"dspark:{name}", tuple(param.shape), seed))
    return model.train().requires_grad_(True), raw


def write_mtp(out: Path, layer, raw: dict) -> None:
    """Adds the MTP layer's tensors (bf16) to the target's safetensors and declares it in config.json."""
    path = out / "model.safetensors"
    tensors = load_file(str(path)) | dict(official_tensors(layer, torch.bfloat16, False))
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def write_dspark(out: Path, model: DSparkModel, raw: dict) -> None:
    folder = out / DSPARK_DIR
    folder.mkdir(exist_ok=True)
    raw = raw | {"torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def distillation_data(out: Path, config: DistillConfig, data_path: Path | None, code_bytes: int) -> dict:
    """The target's own continuations (`config.generated`, trainer/generated.py) or the corpus at `data_path`."""
    if config.generated:
        return generated_streams(out, config, code_bytes)
    if data_path is None:
        raise ValueError("distilling from the corpus needs its token streams (the run's .train/data.pt)")
    return torch.load(data_path)


def distill(out: Path, config: DistillConfig, tiny: bool, data_path: Path | None,
            code_bytes: int = TrainConfig.code_bytes, data: dict | None = None) -> dict:
    """Both drafters of the target in `out` (see the module docstring), on `config.threads` torch threads; ->
    summary per drafter. `data`: already built distillation data (`distillation_data`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _distill(out, config, tiny, data_path, code_bytes, data)
    finally:
        torch.set_num_threads(threads)


def _distill(out: Path, config: DistillConfig, tiny: bool, data_path: Path | None, code_bytes: int,
             data: dict | None) -> dict:
    data = data if data is not None else distillation_data(out, config, data_path, code_bytes)
    target = load_model(out, LoadConfig(dtype="float32")).requires_grad_(False)
    raw = json.loads((out / "config.json").read_text())
    log_file = open(out / DISTILL_LOG, "w", encoding="utf-8")

    def log(line: str) -> None:
        log_file.write(line + "\n")
        log_file.flush()

    try:
        log("drafter step kl elapsed_s")
        layer, raw_mtp = _mtp_layer(target, raw, config.seed)
        summary = {"mtp": _fit("mtp", layer, mtp_outputs, target, data, config, (FINAL_TAP,), 1, log)}
        dspark, raw_dspark = _dspark(target, tiny, config.seed)
        taps = tuple(raw_dspark["target_layer_ids"])
        summary["dspark"] = _fit("dspark", dspark, dspark_outputs, target, data, config, taps,
                                 raw_dspark["block_size"], log)
    finally:
        log_file.close()
    write_mtp(out, layer, raw_mtp)
    write_dspark(out, dspark, raw_dspark)
    return summary
