"""`GuardSkipping` (engine/guard_skipping.py): settled variants skip Dynamo's full guard check, specialised ones
never do, and a settled call Dynamo cannot serve is run again with its guards.

The compiled functions are tiny (backend `eager`: Dynamo's tracing and guards without a code generator).
- a width-generic graph (its width marked dynamic) settles after a clean call and a clean probe; later calls at
  other widths skip the full check and compute the right thing;
- a graph specialised on the width (dynamic=False) is caught by the probe and keeps its guards: calls at new widths
  recompile and stay right;
- negative control: the skip stance alone, on the specialised graph at a new width, cannot run it (Dynamo raises);
  `GuardSkipping` given the same settled variant recovers by rerunning with guards.
"""

from __future__ import annotations

import types

import pytest
import torch

from engine.guard_skipping import GuardSkipping


def _body(x):
    return x.sum(dim=1) * 2 + x.shape[1]


def make(dynamic_width: bool):
    body = types.FunctionType(_body.__code__.replace(), globals())  # Dynamo's cache is per code object: one each
    compiled = torch.compile(body, backend="eager", dynamic=False)

    def run(width: int):
        x = torch.arange(3 * width, dtype=torch.float32).view(3, width)
        if dynamic_width:
            torch._dynamo.maybe_mark_dynamic(x, 1)
        return compiled(x), body(x)

    return run


def test_width_generic_graph_settles_and_skips():
    run = make(dynamic_width=True)
    guards = GuardSkipping(lambda variant, width: run(width + 1) and width + 1)
    for width in (4, 5, 7, 9, 12):
        got, want = guards.call("v", width, lambda _: run(width))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "v" in guards.settled and not guards.specialised
    assert guards.skipped_calls >= 3


def test_specialised_graph_keeps_its_guards():
    run = make(dynamic_width=False)
    guards = GuardSkipping(lambda variant, width: run(width + 1) and width + 1)
    for width in (4, 4, 6, 8):
        got, want = guards.call("v", width, lambda _: run(width))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "v" in guards.specialised and "v" not in guards.settled and guards.skipped_calls == 0


def test_skip_stance_alone_fails_where_guard_skipping_recovers():
    run = make(dynamic_width=False)
    run(4)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True), pytest.raises(RuntimeError,
                                                                               match="skip_guard_eval_unsafe"):
        run(5)  # the negative control: a graph specialised on width 4 cannot serve width 5 unchecked
    guards = GuardSkipping(lambda variant, width: None)
    guards.settled.add("v")  # wrongly settled
    got, want = guards.call("v", 6, lambda _: run(6))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "v" not in guards.settled


def test_a_settled_variant_runs_dynamos_bytecode_directly():
    body = types.FunctionType(_body.__code__.replace(), globals())
    compiled = torch.compile(body, backend="eager", dynamic=False)
    calls = []

    def bind(code):  # Dynamo's bytecode for `body` as a function; counts its calls
        direct = types.FunctionType(code, globals())

        def counted(x):
            calls.append(x.shape[1])
            return direct(x)
        return counted

    guards = GuardSkipping(lambda variant, width: run(width + 1, None) and width + 1, body.__code__, bind)

    def run(width, direct):
        x = torch.arange(3 * width, dtype=torch.float32).view(3, width)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        return (direct or compiled)(x), body(x)

    for width in (4, 5, 7, 9, 12):
        got, want = guards.call("v", width, lambda direct: run(width, direct))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "v" in guards.direct and guards.direct_calls == 3 and calls == [7, 9, 12]
    unwatched = GuardSkipping(lambda variant, width: run(width + 1, None) and width + 1)  # negative control: no code
    for width in (4, 5, 7):
        unwatched.call("v", width, lambda direct: run(width, direct))
    assert "v" in unwatched.settled and not unwatched.direct and unwatched.direct_calls == 0


def test_a_call_dynamo_ran_eagerly_is_never_called_directly():
    """Past Dynamo's recompile limit a call runs eagerly and makes no bytecode: the variant must not settle onto
    the bytecode of a graph specialised on another width."""
    body = types.FunctionType(_body.__code__.replace(), globals())
    compiled = torch.compile(body, backend="eager", dynamic=False)  # specialised on the width: one graph each
    guards = GuardSkipping(lambda variant, width: run(width + 1, None) and width + 1, body.__code__,
                           lambda code: types.FunctionType(code, globals()))

    def run(width, direct):
        x = torch.arange(3 * width, dtype=torch.float32).view(3, width)
        return (direct or compiled)(x), body(x)

    with torch._dynamo.config.patch(recompile_limit=2):
        for width in (4, 5, 6, 6, 7, 8):
            got, want = guards.call("v", width, lambda direct: run(width, direct))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "v" in guards.specialised and not guards.direct and guards.direct_calls == 0
    # negative control: the last bytecode Dynamo made (width 5's graph) called directly at width 8 is wrong
    stale = types.FunctionType(guards.new_codes[-1], globals())
    x = torch.arange(24, dtype=torch.float32).view(3, 8)
    assert not torch.equal(stale(x), body(x))
