"""Typed errors of the engine, so services can map them to status codes without parsing messages.

- `InvalidRequestError` (a `ValueError`): the request itself is bad — invalid sampling parameters, an empty prompt,
  a prompt (plus `max_tokens`) longer than `max_model_len`, or a request that needs more KV blocks than the pool
  has. Services answer 400 / INVALID_ARGUMENT. The engine is unaffected and keeps serving other requests.
- `EngineConfigError` (a `ValueError`): engine arguments that cannot work (e.g. a memory budget too small for
  `max_num_seqs` running states). Raised at construction.
- `EngineDeadError` (a `RuntimeError`): the step loop failed; every pending stream gets it.
- `RequestTimeoutError` (a `TimeoutError`): an `AsyncEngine` wait passed its deadline.
- Transfer errors live in `engine.transfer` (`TransferError` and subclasses).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineConfigError(ValueError):
    """Engine arguments that cannot work; the message names the argument."""


class EngineDeadError(RuntimeError):
    """The engine's step loop stopped after an error; no request can make progress."""


class RequestTimeoutError(TimeoutError):
    """A wait on the engine passed its deadline (the request is aborted)."""
