"""A decode stream whose last chunk arrived is let end by itself (the worker records OK), a running one is cancelled
at once (the worker aborts the request)."""

import asyncio

import grpc

from gateway import mesh_client


class _FakeCall:
    def __init__(self, ends_after_s: float | None):
        self.events: list[str] = []
        self._ends_after_s = ends_after_s

    async def code(self):
        if self._ends_after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self._ends_after_s)
        self.events.append("ended")
        return grpc.StatusCode.OK

    def cancel(self):
        self.events.append("cancel")


def test_a_finished_stream_ends_before_the_cancel():
    call = _FakeCall(ends_after_s=0.05)
    asyncio.run(mesh_client._end_call(call, finished=True))
    assert call.events == ["ended", "cancel"]  # the cancel came after the natural end: a no-op


def test_a_running_stream_is_cancelled_without_waiting():
    call = _FakeCall(ends_after_s=0.05)
    asyncio.run(mesh_client._end_call(call, finished=False))
    assert call.events == ["cancel"]


def test_a_finished_stream_that_hangs_is_cancelled_after_the_bound(monkeypatch):
    monkeypatch.setattr(mesh_client, "END_OF_STREAM_S", 0.05)
    call = _FakeCall(ends_after_s=None)
    asyncio.run(asyncio.wait_for(mesh_client._end_call(call, finished=True), 2))
    assert call.events == ["cancel"]
