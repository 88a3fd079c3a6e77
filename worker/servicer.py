"""What the prefill and decode servicers share: admission of a call, its deadline and the status of an error.

Contract:
- `WorkerServicer.admit(request, context)` binds the call's request id for log lines (unless the caller's
  `x-request-id` already is), then fails the call UNAVAILABLE while stopping (`stopping_message`) or before the
  model is loaded, NOT_FOUND when `request.model` names another model; it returns the worker otherwise (media in
  the prompt is the engine's to check). `checked_worker(model, context)` makes the first three checks alone.
- `fail(context, exc)` ends the call with the status `error_statuses` gives `exc`'s class (first match):
  INVALID_ARGUMENT for `InvalidRequestError`, DEADLINE_EXCEEDED for `RequestTimeoutError`, UNAVAILABLE for
  `EngineDeadError`, plus what a role adds; `handled_errors` is the tuple to catch for it.
- `await decode_job(request, context)`: the request's `generation` decoded (`worker.codec.generation_from_proto`,
  with the call's deadline) on a thread at the lowest CPU priority — a structured-output spec is checked there (xgrammar's schema converter
  may take seconds for a large schema), never on the event loop that answers health.
- `call_deadline(context)` is the call's gRPC deadline as a `time.monotonic()` instant (None: no deadline), the
  form engine requests take.
"""

from __future__ import annotations

import asyncio
import time
from typing import NoReturn

import grpc

from engine.background import background_executor
from engine.errors import EngineDeadError, InvalidRequestError, RequestTimeoutError
from telemetry.context import bind_request_id, current_request_id
from telemetry.metrics import WorkerMetrics
from worker.codec import GenerationJob, generation_from_proto

ENGINE_ERROR_STATUSES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT), (RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE))


_DECODE_POOL = background_executor(2, "kdamesh-decode-job")


async def decode_job(request, context) -> GenerationJob:
    return await asyncio.get_running_loop().run_in_executor(_DECODE_POOL, generation_from_proto, request.generation,
                                                            call_deadline(context))


def call_deadline(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class WorkerServicer:
    """The base of a role's servicer: `worker` is set once the model is loaded, `stopping` once draining begins."""

    role = ""  # "prefill" | "decode"
    stopping_message = "the worker is stopping and takes no new requests"
    error_statuses = ENGINE_ERROR_STATUSES

    def __init__(self, config, metrics: WorkerMetrics):
        self.config = config  # a role's service config: `model_name` is the model it serves
        self.metrics = metrics
        self.worker = None
        self.stopping = False

    @property
    def handled_errors(self) -> tuple[type[Exception], ...]:
        return tuple(kind for kind, _ in self.error_statuses)

    async def checked_worker(self, model: str, context):
        worker = self.worker
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.stopping_message)
        if worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} worker is loading its model")
        if model and model != self.config.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here (this worker "
                                                           f"serves {self.config.model_name!r})")
        return worker

    async def admit(self, request, context):
        if current_request_id() is None:
            bind_request_id(request.request_id)  # this call's task only
        return await self.checked_worker(request.model, context)

    async def fail(self, context, exc: Exception) -> NoReturn:
        for kind, code in self.error_statuses:
            if isinstance(exc, kind):
                await context.abort(code, str(exc))
        raise exc
