"""Spec-decoding drafter fixtures: tiny K3 target (with its MTP layer), a matching DSpark drafter, one-sequence batches.
(Torch runs single-threaded here through tests/unit/engine/conftest.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model

SEED = 5


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny-k3")


@pytest.fixture(scope="session")
def k3(k3_dir):
    return load_model(k3_dir)


@pytest.fixture(scope="session")
def dspark_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny-k3-dspark")


def _checkpoint(tmp_path_factory, preset: str):
    return make_checkpoint(preset, tmp_path_factory.mktemp(preset), seed=SEED)


def one_sequence(model, tokens: list[int], block_size: int = 16) -> tuple[ForwardBatch, CacheTensors]:
    """A fresh cache and the prefill batch of one sequence (every row's logits)."""
    n = len(tokens)
    blocks = -(-n // block_size)
    cache = CacheTensors.allocate(model.config, num_blocks=blocks, block_size=block_size, num_slots=1,
                                  dtype=model.dtype)
    batch = ForwardBatch(input_ids=torch.tensor(tokens), cu_seqlens=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
                         block_tables=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
                         state_indices=torch.tensor([0]), logits_indices=torch.arange(n))
    return batch, cache


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 7900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tapped_sequences(model, dspark_dir, lengths: list[int], seed: int) -> list[tuple[list[int], dict]]:
    """Per request i: `lengths[i]` seeded token ids and their tapped target rows, by drafter kind: "mtp" (the final
    hidden state) and "dspark" (the drafter folder's target layers)."""
    from engine.spec.capture import forward_with_taps
    from engine.spec.drafter import FINAL_TAP
    from engine.spec.dspark import load_dspark

    dspark_taps = tuple(load_dspark(dspark_dir, model).config.target_layer_ids)
    out = []
    for i, n in enumerate(lengths):
        ids = tokens(n, seed=seed + i)
        taps = {}
        for name, tap in (("mtp", (FINAL_TAP,)), ("dspark", dspark_taps)):
            batch, cache = one_sequence(model, ids)
            taps[name] = forward_with_taps(model, batch, cache, tap)[1]
        out.append((ids, taps))
    return out
