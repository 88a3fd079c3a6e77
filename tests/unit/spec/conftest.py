"""Spec-decoding drafter fixtures: tiny K3 target (with its MTP layer), a matching DSpark drafter, one-sequence batches."""

from __future__ import annotations

import pytest
import torch

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model

SEED = 5


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=SEED)


@pytest.fixture(scope="session")
def k3(k3_dir):
    return load_model(k3_dir)


@pytest.fixture(scope="session")
def dspark_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3-dspark", tmp_path_factory.mktemp("tiny-k3-dspark"), seed=SEED)


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
