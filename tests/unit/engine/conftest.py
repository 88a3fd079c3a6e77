"""Engine test fixtures: generated tiny checkpoints (one per session) and single-threaded torch.

Torch runs single-threaded in these tests: it fixes the reduction order, and on a busy two-core box two threads
make the tiny models' ops 10-100x slower.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.checkpoint import make_checkpoint

CHECKPOINT_SEED = 3


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_linear_dir(tmp_path_factory):
    return make_checkpoint("tiny-linear", tmp_path_factory.mktemp("tiny-linear"), seed=CHECKPOINT_SEED)


@pytest.fixture(scope="session")
def tiny_k3_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=CHECKPOINT_SEED)


def random_prompts(n: int, low: int, high: int, seed: int = 0, vocab: int = 7936) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(low, high))] for _ in range(n)]
