"""Reference parity: our `kimi_linear` logits equal transformers' `KimiLinearForCausalLM` on the same folder.

transformers uses its pure-torch KDA only when `fla` is not importable; the test blocks that import.
Tolerance: max |ours − ref| ≤ 1e-4 · max |ref| in fp32, for the full prompt and for prefill + 32 decode steps.
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import LoadConfig, load_model
from tests.model_driver import SequenceDriver, rel_err

REL_TOL = 1e-4
DECODE_STEPS = 32


@pytest.fixture(autouse=True)
def _block_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)


def _reference(model_dir):
    from transformers import KimiLinearForCausalLM

    ref = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return ref.eval()


@pytest.mark.parametrize("preset,prompt_len", [("tiny-linear", 100), ("linear-48b-pattern", 70)])
def test_logits_match_transformers(tmp_path, preset, prompt_len):
    model_dir = make_checkpoint(preset, tmp_path / preset, seed=3)
    ours = load_model(model_dir, LoadConfig(dtype="float32"))
    ref = _reference(model_dir)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ours.config.vocab_size - 256, (prompt_len + DECODE_STEPS,), generator=gen)
    prompt, continuation = tokens[:prompt_len], tokens[prompt_len:]

    with torch.no_grad():
        ref_all = ref(tokens[None], use_cache=False).logits[0].float()  # [P+S, V]

    driver = SequenceDriver(ours, max_seqs=1, max_len=prompt_len + DECODE_STEPS + 1)
    ours_prompt = driver.prefill(0, prompt.tolist())  # [P, V]
    assert rel_err(ours_prompt, ref_all[:prompt_len]) <= REL_TOL

    for i, token in enumerate(continuation.tolist()):
        step_logits = driver.decode(0, token)
        assert rel_err(step_logits, ref_all[prompt_len + i]) <= REL_TOL, f"decode step {i}"


def test_reference_incremental_decode_matches_ours(tmp_path):
    """transformers' own cached decode path agrees with our decode steps (greedy, 32 tokens)."""
    model_dir = make_checkpoint("tiny-linear", tmp_path / "m", seed=5)
    ours = load_model(model_dir, LoadConfig(dtype="float32"))
    ref = _reference(model_dir)
    prompt = list(range(10, 60))
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    ref_tokens = out[0, len(prompt):].tolist()

    driver = SequenceDriver(ours, max_seqs=1, max_len=len(prompt) + DECODE_STEPS + 1)
    assert driver.greedy(0, prompt, DECODE_STEPS) == ref_tokens
