"""The shipped demo-k3 (deploy/models/demo-k3) is a real K3 checkpoint: it loads through the normal loader and its
logits equal the official Kimi K3 modeling code's on it (the parity harness of the generated presets), prefill and
decode; its drafters load in their formats; the folder stays within the size budget and says how it was made."""

from __future__ import annotations

import json
import platform

import pytest
import torch
from safetensors import safe_open

from deploy.checkpoints import DEFAULT_PRESET, SHIPPED_MODELS, default_model_dir
from engine.model.loader import LoadConfig, load_model
from engine.spec.dspark import load_dspark
from engine.spec.mtp_model import load_mtp_layers
from engine.tokenizer import KimiTokenizer
from gateway.chat.k3 import K3Renderer
from tests.model_driver import SequenceDriver, rel_err, torch_threads
from tests.reference.k3_reference import load_reference_k3, reference_logits

FOLDER = SHIPPED_MODELS["demo-k3"]
REL_TOL = 1e-4
MAX_BYTES = 60 * 2**20


@pytest.fixture(scope="module")
def models():
    with torch_threads(1):
        yield load_model(FOLDER, LoadConfig(dtype="float32")), load_reference_k3(FOLDER)


def _prompt() -> list[int]:
    renderer = K3Renderer(KimiTokenizer.from_pretrained(FOLDER))
    return renderer.render([{"role": "user", "content": "What is 12 + 30?"}]).token_ids


def test_the_default_model_is_the_shipped_folder():
    assert DEFAULT_PRESET == "demo-k3" and default_model_dir() == FOLDER


def test_logits_match_the_official_k3_code(models):
    ours, ref = models
    assert ours.config.family == "kimi_k3" and {s.mixer for s in ours.config.layers} == {"kda", "mla"}
    prompt = _prompt()
    decoded = [int(t) for t in torch.randint(0, 7936, (8,), generator=torch.Generator().manual_seed(0))]
    with torch_threads(1):
        ref_all = reference_logits(ref, prompt + decoded)  # [P + 8, V]
        driver = SequenceDriver(ours, max_seqs=1, max_len=len(prompt) + 16)
        assert rel_err(driver.prefill(0, prompt), ref_all[: len(prompt)]) <= REL_TOL
        for i, token in enumerate(decoded):
            assert rel_err(driver.decode(0, token), ref_all[len(prompt) + i]) <= REL_TOL


def test_the_drafters_load(models):
    ours, _ = models
    assert len(load_mtp_layers(ours, FOLDER)) == 1
    assert load_dspark(FOLDER / "dspark", ours).config.block_size == 4


def test_the_folder_is_bf16_small_and_documented():
    files = [p for p in FOLDER.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("language_model.lm_head.weight").get_dtype() == "BF16"
    run = json.loads((FOLDER / "training_run.json").read_text())
    assert run["command"][:2] == ["kdamesh", "train-demo"] and run["python"].count(".") == 2
    assert run["python"].startswith(platform.python_version_tuple()[0])
    assert (FOLDER / "training_log.txt").read_text().startswith("step tokens loss lr elapsed_s")
    assert (FOLDER / "heldout_files.txt").read_text().split()
