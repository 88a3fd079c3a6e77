"""Shared fixtures of the vision tests: one tiny-k3 folder (with its vision tower), our encoder and the official
model on it, loaded once per session; torch single-threaded while this package runs (fixed reduction order, and
faster on a busy box)."""

from __future__ import annotations

import pytest

from engine.model.checkpoint import make_checkpoint
from engine.vision.loader import load_vision
from tests.model_driver import torch_threads

CHECKPOINT_SEED = 3


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3-vision"), seed=CHECKPOINT_SEED)


@pytest.fixture(scope="session")
def encoder(tiny_dir):
    return load_vision(tiny_dir)


@pytest.fixture(scope="session")
def reference(tiny_dir):
    from tests.reference.k3_reference import load_reference_k3

    return load_reference_k3(tiny_dir)


@pytest.fixture(scope="package", autouse=True)
def _single_thread():
    """Every vision test runs with one torch thread."""
    with torch_threads(1):
        yield
