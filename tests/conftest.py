"""Shared test fixtures: deterministic seeds, small thread counts."""

import os

import pytest
import torch

torch.set_num_threads(1)  # tiny shapes: thread start-up costs more than it saves


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield
