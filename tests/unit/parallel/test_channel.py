"""engine/parallel/channel.py: commands cross a rank group as tensor payloads, never as pickled tensors; a
`Sharded` value reaches each rank as its own part only."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine.parallel.channel import (CommandChannel, Sharded, TensorPickleError, TensorRef, _dumps, join_tensors,
                                     split_tensors)
from engine.parallel.launch import run_ranks


@dataclass(frozen=True)
class Step:
    ids: torch.Tensor
    lens: list[int]
    extra: dict = field(default_factory=dict)


class Opaque:  # not a dataclass, list, tuple or dict: the walker cannot see inside
    def __init__(self, t: torch.Tensor):
        self.t = t


def _command() -> tuple:
    return ("run_step", (Step(torch.arange(5), [1, 2], {"mask": torch.tensor([True, False]),
                                                         "fp8": torch.randn(3).to(torch.float8_e4m3fn),
                                                         "half": torch.randn(2, 3).bfloat16()}), 7))


def test_split_and_join_round_trip_without_pickling_a_tensor():
    command = _command()
    skeleton, tensors, sharded = split_tensors(command)
    assert len(tensors) == 4 and not sharded
    assert isinstance(skeleton[1][0].ids, TensorRef)
    _dumps(skeleton)  # pickles: no tensor left in it
    back = join_tensors(skeleton, tensors, [])
    assert torch.equal(back[1][0].ids, command[1][0].ids) and back[1][0].lens == [1, 2] and back[1][1] == 7


def test_negative_control_a_tensor_the_walker_misses_is_refused():
    with pytest.raises(TensorPickleError):
        _dumps(split_tensors(("cmd", Opaque(torch.ones(2))))[0])


def _exchange(comm, rank):
    channel = CommandChannel(comm)
    if rank == 0:
        parts = (torch.full((2, 3), 0.0), torch.full((2, 3), 1.0))
        torch.manual_seed(0)
        channel.send(("write", Sharded(parts), _command()[1]))
        channel.send(("big", list(range(5000)), torch.arange(10_000, dtype=torch.float32)))  # past the header
        return channel.send(("shutdown", ()))
    first = channel.receive()  # views into one payload: cloned so torch.save can carry them back
    skeleton, tensors, _ = split_tensors(first)
    big = channel.receive()
    return join_tensors(skeleton, [t.clone() for t in tensors], []), (big[0], big[1], big[2].clone()), \
        channel.receive()


def test_two_ranks_receive_payloads_and_only_their_part():
    _, (first, big, second) = run_ranks(_exchange, 2, timeout_s=120.0)
    name, part, (step, seven) = first
    assert name == "write" and torch.equal(part, torch.full((2, 3), 1.0))  # rank 1's part only
    torch.manual_seed(0)
    expected = _command()[1][0]
    assert torch.equal(step.ids, expected.ids) and step.lens == [1, 2] and seven == 7
    for key in ("mask", "half"):
        assert torch.equal(step.extra[key], expected.extra[key])
    assert torch.equal(step.extra["fp8"].view(torch.uint8), expected.extra["fp8"].view(torch.uint8))
    assert big[0] == "big" and big[1] == list(range(5000)) and torch.equal(big[2], torch.arange(10_000.0))
    assert second == ("shutdown", ())
