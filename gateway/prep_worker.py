"""A preparation process of the gateway's large lane (gateway/prep_procs.py starts it as `python -m
gateway.prep_worker`): it prepares requests with its own tokenizer, chat renderer and planner, off the gateway
process's GIL.

Contract:
- It imports only torch-free pieces (tokenizer, renderer, planner, protocol, the image processor's numpy/Pillow
  side) and lowers its own CPU priority by `NICENESS`, so the gateway's event loop wins the CPU from it.
- Frames on stdin/stdout: an 8-byte big-endian length, then a pickle. The first frame in is the gateway's
  `GatewayConfig`; it answers `READY` once its objects are built. Each later frame is `(fn, args, max_model_len)`:
  `args` name the gateway's own objects (its tokenizer, renderer, planner) by the persistent ids of `OBJECTS`,
  which resolve to this process's; the planner reads `max_model_len` (the gateway's at submission). It answers
  `("ok", result)` or `("error", exception)` (an exception that does not pickle becomes a `RuntimeError` naming
  it). EOF on stdin ends it; the gateway kills it to cancel work.
- Anything printed goes to stderr: stdout carries only frames.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

OBJECTS = ("tokenizer", "renderer", "planner")  # the persistent ids of the gateway's objects in a job
READY = "ready"
NICENESS = 5
_HEADER = struct.Struct(">Q")


def write_frame(out: BinaryIO, payload: bytes) -> None:
    out.write(_HEADER.pack(len(payload)))
    out.write(payload)
    out.flush()


def read_frame(inp: BinaryIO) -> bytes | None:
    """The next frame's payload; None at EOF."""
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = inp.read(size)
    return payload if len(payload) == size else None


class _JobUnpickler(pickle.Unpickler):
    def __init__(self, data, objects: dict[str, Any]):
        import io
        super().__init__(io.BytesIO(data))
        self.objects = objects

    def persistent_load(self, pid):
        return self.objects[pid]


def _build(config) -> tuple[dict[str, Any], dict]:
    """This process's tokenizer, renderer and planner (the planner reads `limit["value"]`)."""
    from engine.tokenizer import KimiTokenizer
    from gateway.plan import planner_for

    limit = {"value": None}
    tokenizer = KimiTokenizer.from_pretrained(config.model)
    planner = planner_for(config, tokenizer, lambda: limit["value"])
    return {"tokenizer": tokenizer, "renderer": planner.renderer, "planner": planner}, limit


def _answer(fn, args) -> bytes:
    try:
        return pickle.dumps(("ok", fn(*args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the gateway, which re-raises it
        try:
            return pickle.dumps(("error", exc), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            return pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr
    inp = sys.stdin.buffer
    os.nice(NICENESS)
    first = read_frame(inp)
    if first is None:
        return
    objects, limit = _build(pickle.loads(first))
    write_frame(out, pickle.dumps(READY))
    while (payload := read_frame(inp)) is not None:
        fn, args, limit["value"] = _JobUnpickler(payload, objects).load()
        write_frame(out, _answer(fn, args))


if __name__ == "__main__":
    main()
