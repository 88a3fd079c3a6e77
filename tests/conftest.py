"""Shared test fixtures: deterministic seeds, small thread counts."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield
