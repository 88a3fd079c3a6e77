"""`kdamesh train-demo` end to end on the tiny configuration: the loss falls, the folder is a K3 checkpoint the engine
loads and generates from, the run records how it was made, and an interrupted run resumed from its saved state ends
with the weights of an uninterrupted one. `kdamesh distill-demo` distils its drafters again from the target's own
greedy continuations, leaving the target as it was."""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.llm import LLM
from engine.model.loader import LoadConfig, load_model
from engine.spec.dspark import load_dspark
from engine.spec.mtp_model import load_mtp_layers
from engine.model.config import load_model_config
from engine.sampling import SamplingParams
from engine.tokenizer import KimiTokenizer
from gateway.chat.k3 import K3Renderer
from tests.model_driver import torch_threads
from trainer import corpus, dataset
from trainer.config import DistillConfig, TrainConfig
from deploy.cli import build_parser
from trainer.distill import DSPARK_DIR, _anchors, _piece_starts, windows
from trainer.generated import CODE_HEAD_TOKENS, chat_prompts, code_prompts, generated_streams
from trainer.train import LOG_FILE, RUN_FILE, WORK_DIR, train

STEPS = 12


def _config(out: Path) -> TrainConfig:
    return TrainConfig(out_dir=str(out), tiny=True, steps=STEPS, time_budget_s=1e9, batch_size=4, seq_len=64,
                       chat_examples=200, tokenizer_chat_examples=200, code_bytes=500_000, warmup_steps=2, lr=3e-3,
                       log_every=1, save_every_s=0.0, threads=1)


DRAFTERS = DistillConfig(steps=3, batch_size=2, seq_len=64, anchors=4, code_fraction=0.5, generated_chat=0,
                         generated_code=0, threads=1)  # the corpus windows (the generated data: GENERATED below)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    with torch_threads(1):
        yield train(_config(tmp_path_factory.mktemp("demo") / "run"), command=["kdamesh", "train-demo", "test"],
                    drafters=DRAFTERS)


def test_loss_falls_and_the_run_is_recorded(trained):
    lines = (trained / LOG_FILE).read_text().splitlines()
    losses = [float(line.split()[2]) for line in lines[1:]]
    assert lines[0] == "step tokens loss lr elapsed_s" and len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    run = json.loads((trained / RUN_FILE).read_text())
    assert run["python"] == platform.python_version() and run["command"] == ["kdamesh", "train-demo", "test"]
    assert run["steps"] == STEPS and run["tokens_seen"] == STEPS * 4 * 64
    heldout = (trained / corpus.HELDOUT_FILE).read_text().split()
    assert heldout and all(name.endswith(".py") for name in heldout)


def test_the_folder_is_a_k3_checkpoint_that_generates(trained):
    config = load_model_config(trained)
    assert config.family == "kimi_k3" and config.vocab_size == 8192
    assert {s.mixer for s in config.layers} == {"kda", "mla"} and config.attn_res_block_size
    assert config.moe.latent_size and config.moe.num_shared_experts == 1 and config.activation.kind == "situ"
    weights = load_file(str(trained / "model.safetensors"))
    assert weights["language_model.lm_head.weight"].dtype == torch.bfloat16
    tokenizer = KimiTokenizer.from_pretrained(trained)
    prompt = K3Renderer(tokenizer).render([{"role": "user", "content": "What is 2 + 3?"}])
    with torch_threads(1):
        out = LLM(str(trained), dtype="float32").generate({"prompt_token_ids": prompt.token_ids},
                                                           SamplingParams(max_tokens=5, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) >= 1


def test_an_interrupted_run_resumes_to_the_same_weights(trained, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    shutil.copytree(trained / WORK_DIR, out / WORK_DIR, ignore=shutil.ignore_patterns("state.pt"))  # same corpus
    real_batch = dataset.batch

    def interrupted(data, config, step):
        if step == STEPS // 2:
            raise KeyboardInterrupt
        return real_batch(data, config, step)

    monkeypatch.setattr(dataset, "batch", interrupted)
    with torch_threads(1), pytest.raises(KeyboardInterrupt):
        train(_config(out), drafters=None)
    monkeypatch.setattr(dataset, "batch", real_batch)
    with torch_threads(1):
        train(_config(out), drafters=None)
    ours, ref = load_file(str(out / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    mtp = {k for k in ref if ".layers.4." in k}  # the fixture's run also distilled the MTP layer (layer 4 of 4)
    assert mtp and ours.keys() == ref.keys() - mtp and all(torch.equal(ours[k], ref[k]) for k in ours)
    assert json.loads((out / RUN_FILE).read_text())["steps"] == STEPS


def test_a_state_from_other_settings_is_refused(trained, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(trained / WORK_DIR, out / WORK_DIR)
    with pytest.raises(ValueError, match="other settings \\(lr\\)"):
        train(TrainConfig(**{**_config(out).__dict__, "lr": 1e-3}), drafters=None)


def test_the_distilled_drafters_load_in_their_formats(trained):
    target = load_model(trained, LoadConfig(dtype="float32"))
    assert len(load_mtp_layers(target, trained)) == 1
    dspark = load_dspark(trained / DSPARK_DIR, target)
    assert tuple(dspark.config.target_layer_ids) == (0, 2, 3)
    drafters = json.loads((trained / RUN_FILE).read_text())["drafters"]
    assert drafters["mtp"]["steps"] == DRAFTERS.steps and drafters["dspark"]["steps"] == DRAFTERS.steps
    assert 0.0 <= drafters["mtp"]["top1_agreement_heldout"] <= 1.0


GENERATED = DistillConfig(steps=2, batch_size=2, seq_len=64, anchors=4, code_fraction=0.5, generated_chat=4,
                          generated_code=2, generated_tokens=8, generated_batch=3, threads=1)


@pytest.fixture(scope="module")
def generated(trained):
    with torch_threads(1):
        return generated_streams(trained, GENERATED, _config(trained).code_bytes)


def _pieces(data: dict, kind: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) of each piece of `kind`, split where the generated mask says."""
    ids, mask = data[kind].tolist(), data[f"{kind}_generated"].tolist()
    pieces, at = [], 0
    while at < len(ids):
        end = at
        while end < len(ids) and not mask[end]:
            end += 1
        stop = end
        while stop < len(ids) and mask[stop]:
            stop += 1
        pieces.append((ids[at:end], ids[end:stop]))
        at = stop
    return pieces


def _greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    with torch_threads(1):
        outs = LLM(str(folder), dtype="float32").generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_generated_streams_are_the_targets_own_greedy_continuations(trained, generated):
    tokenizer = KimiTokenizer.from_pretrained(trained)
    chat = chat_prompts(tokenizer, GENERATED.generated_chat, GENERATED.seed)
    code = code_prompts(tokenizer, GENERATED.generated_code, _config(trained).code_bytes)
    assert len(code) == 2 and all(len(p) == CODE_HEAD_TOKENS for p in code)
    for kind, prompts in (("chat", chat), ("code", code)):
        expected = list(zip(prompts, _greedy(trained, prompts)))
        assert _pieces(generated, kind) == expected
        corrupted = dict(generated, **{kind: generated[kind].clone()})  # negative control: one token changed
        corrupted[kind][int(generated[f"{kind}_generated"].nonzero()[0])] += 1
        assert _pieces(corrupted, kind) != expected
    held = set(corpus.split_files(_config(trained).code_bytes).heldout)
    assert held and not any(tokenizer.encode(p.read_text())[:CODE_HEAD_TOKENS] in code for p in held)


def test_generated_data_trains_where_serving_drafts(generated):
    ids, mask = windows(generated, GENERATED, step=0)
    assert ids.shape == mask.shape == (2, 64) and mask.any()
    anchors = _anchors(GENERATED, 4, 0, mask)  # [B, A]
    for row, row_anchors in zip(mask, anchors):
        if row.any():
            assert row[row_anchors + 1].all()
    everywhere = _anchors(GENERATED, 4, 0, torch.ones_like(mask))  # negative control: no mask, any position
    assert not all(row[a + 1].all() for row, a in zip(mask, everywhere))
    assert set(_piece_starts(generated, "chat", True).tolist()).isdisjoint(
        _piece_starts(generated, "chat", False).tolist())


def test_a_generated_kind_the_mix_draws_from_must_be_asked_for():
    with pytest.raises(ValueError, match="generated_code=0"):
        DistillConfig(generated_chat=4, generated_code=0, code_fraction=0.5)
    assert DistillConfig(generated_chat=4, generated_code=0, code_fraction=0.0).generated
    assert not DistillConfig(generated_chat=0, generated_code=0).generated


def test_redistilling_keeps_the_target_and_records_the_run(trained, tmp_path, monkeypatch):
    folder = tmp_path / "again"
    shutil.copytree(trained, folder, ignore=shutil.ignore_patterns(WORK_DIR))
    before = load_file(str(folder / "model.safetensors"))
    dspark_before = load_file(str(folder / DSPARK_DIR / "model.safetensors"))
    argv = ["distill-demo", str(folder), "--steps", "2", "--batch-size", "2", "--seq-len", "64", "--anchors", "4",
            "--generated-chat", "4", "--generated-code", "2", "--generated-tokens", "8", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", ["kdamesh", *argv])
    args = build_parser().parse_args(argv)
    with torch_threads(1):
        assert args.func(args) == 0
    after = load_file(str(folder / "model.safetensors"))
    mtp = {k for k in before if ".layers.4." in k}
    assert mtp and after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before.keys() - mtp)
    assert not all(torch.equal(after[k], before[k]) for k in mtp)
    dspark_after = load_file(str(folder / DSPARK_DIR / "model.safetensors"))
    assert not all(torch.equal(dspark_after[k], dspark_before[k]) for k in dspark_before)
    run = json.loads((folder / RUN_FILE).read_text())
    assert run["distill_config"]["generated_chat"] == 4 and "distill-demo" in run["distill_command"]
    assert run["drafters"]["dspark"]["steps"] == 2 and 0 <= run["drafters"]["dspark"]["leading_drafts_heldout"] <= 3
    target = load_model(folder, LoadConfig(dtype="float32"))
    assert len(load_mtp_layers(target, folder)) == 1 and load_dspark(folder / DSPARK_DIR, target)
