"""Scratch buffers (kernels/workspace.py): reused per name and thread, grown on demand, never shared by threads."""

from __future__ import annotations

import threading

import torch

from kernels.workspace import gathered, scratch


def test_same_name_reuses_memory_and_grows_on_demand():
    a = scratch("test.a", (4, 8), torch.float32, torch.device("cpu"))
    b = scratch("test.a", (2, 8), torch.float32, torch.device("cpu"))
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()
    other = scratch("test.b", (4, 8), torch.float32, torch.device("cpu"))
    assert other.data_ptr() != a.data_ptr()
    bigger = scratch("test.a", (64, 8), torch.float32, torch.device("cpu"))
    assert bigger.shape == (64, 8) and bigger.is_contiguous()
    assert scratch("test.a", (3, 8), torch.float64, torch.device("cpu")).dtype == torch.float64


def test_threads_get_their_own_buffers():
    mine = scratch("test.thread", (16,), torch.float32, torch.device("cpu")).data_ptr()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(scratch("test.thread", (16,), torch.float32,
                                                                 torch.device("cpu")).data_ptr()))
    worker.start()
    worker.join(timeout=10)
    assert seen and seen[0] != mine


def test_gathered_uses_scratch_without_autograd_and_allocates_with_it():
    x = torch.randn(6, 3)
    index = torch.tensor([5, 0, 0, 2])
    with torch.no_grad():
        first = gathered(x, index, "test.gather")
        assert torch.equal(first, x[index])
        assert gathered(x, index, "test.gather").data_ptr() == first.data_ptr()
    with torch.inference_mode():  # inference tensors get their own buffer ...
        assert torch.equal(gathered(x, index, "test.gather"), x[index])
    with torch.no_grad():  # ... so the normal one is still writable here
        assert torch.equal(gathered(x + 1, index, "test.gather"), (x + 1)[index])
    leaf = torch.randn(6, 3, requires_grad=True)
    rows = gathered(leaf, index, "test.gather")  # autograd on: a fresh, differentiable tensor
    rows.sum().backward()
    assert torch.equal(leaf.grad[:, 0], torch.tensor([2.0, 0, 1, 0, 0, 1]))
