"""The first token of a handoff goes out before its blocks are read (issue 30, "handoffs that scale"): the decode
worker streams token N+1 as soon as the handoff's head is read and checked, then reads the blocks.

Claims, each with its negative control:
- the first token reaches the client while the prompt's last block is still held back (a gate serves it only once
  the client holds the first chunk); then the block is served and the output equals colocated, from the handoff's
  KV. Control: the old order (every block read before the first token can go out) cannot get past the gate: the
  block is never served, the wait runs out (`late_part`) and the prompt is recomputed;
- a block that turns out corrupt, late or missing after the first token was sent: the request continues from the
  checked head, computed from its tokens by the engine (`Scheduler.num_import_recomputes`: a fresh prefill would
  not count there), with the first token sent once and the output equal to colocated — greedy and seeded
  sampling; one failure and one recompute counted, `used_handoff` false;
- a client that leaves after the first token while the blocks are still awaited: the handoff's block parts are
  claimed all the same (control: without `HandoffFetcher.release` they stay in the cache service).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cache_service.client import GetResult
from cache_service.objects import Status
from protos import common_pb2, decode_pb2, prefill_pb2
from tests.integration.mesh_harness import Mesh, greedy, run_bounded, tiny_k3_checkpoint
from tests.integration.test_streamed_handoff import STREAMING, TOKENS, Tap, corrupt, long_prompt, reset_decode_cache
from worker.handoff_parts import block_part_keys, read_manifest

SEEDED = common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True,
                                   skip_special_tokens=True)


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


class FirstChunkGate:
    """Holds one full block of the prompt back (MISSING, as a block not published yet) until the test's client has
    the first chunk; then serves it through `fault` (a changed result, or the result as it is)."""

    def __init__(self, tap: Tap, block: int, fault=lambda result: result):
        self.tap, self.block, self.fault = tap, block, fault
        self.first_received = False
        self.served = 0  # times the block was answered after the first chunk
        self.imported_at_first: bool | None = None  # whether the decode engine held the block then
        tap.edit = self.edit

    def edit(self, keys, got) -> None:
        for i in self.tap.blocks(keys, self.block):
            if self.first_received:
                got[i] = self.fault(got[i])
                self.served += 1
            else:
                got[i] = GetResult(keys[i], Status.MISSING, None, "held back until the first chunk")

    def on_first(self) -> None:
        self.first_received = True
        self.imported_at_first = self.tap.imported(self.block)


def untap(mesh: Mesh, tap: Tap) -> None:
    """The decode worker's cache client as before `Tap(...)`."""
    mesh.decode_worker.cache.get_objects = tap.real


def never_served(result: GetResult) -> GetResult:
    return GetResult(result.key, Status.MISSING, None, "never published")


async def colocated(mesh: Mesh, prompt: list[int], sampling) -> list[int]:
    ids = (await mesh.run(prompt, sampling, "local")).ids
    await reset_decode_cache(mesh)
    return ids


async def prefill(mesh: Mesh, prompt: list[int], sampling) -> tuple[common_pb2.GenerationRequest,
                                                                    prefill_pb2.PrefillResponse]:
    generation = common_pb2.GenerationRequest(request_id=f"first-{random.getrandbits(48):x}", sampling=sampling,
                                              prompt=common_pb2.TokenIds(ids=prompt))
    response = await mesh.prefill_stub.Prefill(prefill_pb2.PrefillRequest(generation=generation), timeout=20)
    assert not response.finish_reason
    return generation, response


def decode_call(mesh: Mesh, generation: common_pb2.GenerationRequest, response: prefill_pb2.PrefillResponse):
    source = decode_pb2.HandoffSource(handoff_key=response.handoff_key, first_token_id=response.first_token_id,
                                      cached_tokens=response.cached_tokens)
    return mesh.decode_stub.Decode(decode_pb2.DecodeRequest(generation=generation, handoff=source), timeout=30)


async def remote(mesh: Mesh, prompt: list[int], sampling, on_first) -> tuple[list[decode_pb2.DecodeChunk], int]:
    """Prefill, then the decode stream over the stubs; `on_first()` runs when the first chunk arrives -> (the
    chunks, the prefill's first token)."""
    generation, response = await prefill(mesh, prompt, sampling)
    chunks = []
    async for chunk in decode_call(mesh, generation, response):
        if not chunks:
            on_first()
        chunks.append(chunk)
    return chunks, response.first_token_id


class WaitForAll:
    """The order before this change, as a control: the fetcher's `open` reads every block too, so the first token
    can only go out once all of them are loaded."""

    def __init__(self, fetcher):
        self.fetcher, self.open, self.finish = fetcher, fetcher.open, fetcher.finish
        fetcher.open, fetcher.finish = self.open_and_finish, self.finished

    async def open_and_finish(self, *args):
        opened = await self.open(*args)
        opened.loaded = await self.finish(opened)
        return opened

    @staticmethod
    async def finished(opened):
        return opened.loaded

    def undo(self) -> None:
        self.fetcher.open, self.fetcher.finish = self.open, self.finish


def tokens(chunks: list[decode_pb2.DecodeChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def test_the_first_token_arrives_while_the_last_block_is_held_back(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, **STREAMING) as mesh:
            worker = mesh.decode_worker
            counters, fetcher = worker.counters, worker.fetcher
            for old_order in (False, True):
                prompt = long_prompt(200, 50 + old_order)  # 12 full blocks in 6 groups, and a tail
                reference = await colocated(mesh, prompt, greedy(TOKENS))
                tap = Tap(mesh, prompt)
                gate = FirstChunkGate(tap, len(tap.hashes) - 1)
                fetcher.part_wait_s = 0.5 if old_order else 10.0  # the control's wait runs out fast
                control = WaitForAll(fetcher) if old_order else None
                loaded, recomputed = counters.handoff_loaded, counters.recomputed
                late = counters.failure_reasons.get("late_part", 0)
                chunks, first = await remote(mesh, prompt, greedy(TOKENS), gate.on_first)
                untap(mesh, tap)
                assert tokens(chunks) == reference and chunks[0].token_ids == [first]
                if old_order:
                    control.undo()
                    assert gate.served == 0 and counters.failure_reasons.get("late_part") == late + 1
                    assert counters.recomputed == recomputed + 1 and not chunks[-1].used_handoff
                else:
                    assert gate.imported_at_first is False and gate.served >= 1
                    assert counters.handoff_loaded == loaded + 1 and counters.recomputed == recomputed
                    assert counters.failure_reasons.get("late_part", 0) == late and chunks[-1].used_handoff
                await reset_decode_cache(mesh)
    run_bounded(main(), 120)


@pytest.mark.parametrize("fault", ["corrupt", "late_part", "missing_block"])
def test_a_block_failing_after_the_first_token_continues_from_the_head(tiny_k3, fault):
    """corrupt, late_part: a streamed handoff's middle block, held back until the client has the first chunk, then
    served corrupt or never; missing_block: a whole handoff's middle block is not in the cache service (read with
    the head, refused after it)."""
    async def main():
        async with Mesh(tiny_k3, **({} if fault == "missing_block" else STREAMING)) as mesh:
            worker, engine = mesh.decode_worker, mesh.decode_server.engine
            counters = worker.counters
            worker.fetcher.part_wait_s = 2.0
            for i, sampling in enumerate((greedy(TOKENS), SEEDED)):
                prompt = long_prompt(200, 60 + i)
                reference = await colocated(mesh, prompt, sampling)
                tap = Tap(mesh, prompt)
                middle = len(tap.hashes) // 2
                gate = FirstChunkGate(tap, middle, corrupt if fault == "corrupt" else never_served)
                failures, recomputed = counters.handoff_failures, counters.recomputed
                loaded, reasons = counters.handoff_loaded, dict(counters.failure_reasons)
                import_recomputes = engine.core.scheduler.num_import_recomputes
                at_first = {}

                def on_first():
                    gate.on_first()
                    at_first["failures"] = counters.handoff_failures
                chunks, first = await remote(mesh, prompt, sampling, on_first)
                untap(mesh, tap)
                ids = tokens(chunks)
                assert ids == reference and len(ids) == TOKENS and chunks[0].token_ids == [first], sampling
                assert chunks[-1].usage.completion_tokens == TOKENS and not chunks[-1].used_handoff
                assert counters.handoff_failures == failures + 1 and counters.recomputed == recomputed + 1
                assert counters.failure_reasons.get(fault) == reasons.get(fault, 0) + 1
                assert counters.handoff_loaded == loaded
                assert engine.core.scheduler.num_import_recomputes == import_recomputes + 1  # from the head
                if fault != "missing_block":  # (a whole handoff's blocks came with the head: refused at once)
                    assert at_first["failures"] == failures  # the first token went out before the block failed
                if fault == "corrupt":
                    assert gate.served >= 1
                await reset_decode_cache(mesh)
    run_bounded(main(), 120)


def test_a_client_leaving_after_the_first_token_still_claims_the_block_parts(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, handoff_full_kv=True, **STREAMING) as mesh:  # the blocks are the handoff's parts
            fetcher = mesh.decode_worker.fetcher
            fetcher.part_wait_s = 10.0  # the blocks held back are waited for until the client leaves
            real_release = fetcher.release
            for without_release in (False, True):
                prompt = long_prompt(200, 70 + without_release)
                generation, response = await prefill(mesh, prompt, greedy(TOKENS))
                await mesh.drain()  # every block part published
                [stored] = await mesh.cache.get_objects([response.handoff_key])
                manifest = read_manifest(stored.data)
                parts = block_part_keys(response.handoff_key, len(manifest.head), range(manifest.blocks))
                asks = {"n": 0}

                def hold_blocks(keys, got):  # after the manifest and the head pieces, nothing more is served
                    asks["n"] += 1
                    if asks["n"] > 2:
                        got[:] = [GetResult(k, Status.MISSING, None, "held back") for k in keys]
                tap = Tap(mesh, prompt)
                tap.edit = hold_blocks
                if without_release:
                    fetcher.release = lambda opened: None
                call = decode_call(mesh, generation, response)
                async for chunk in call:
                    assert chunk.token_ids == [response.first_token_id]
                    break
                call.cancel()  # the client leaves while the blocks are awaited
                left = await wait_until_claimed(mesh, parts, 1.0 if without_release else 10.0)
                assert (left > 0) == without_release, left
                fetcher.release = real_release
                untap(mesh, tap)
    run_bounded(main(), 120)


async def wait_until_claimed(mesh: Mesh, keys: list[common_pb2.ObjectKey], timeout_s: float) -> int:
    """-> how many of `keys` the cache service still holds once none does, or when `timeout_s` passed."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while True:
        await mesh.drain()
        left = sum(r.status == Status.FOUND for r in await mesh.cache.get_objects(keys))
        if left == 0 or loop.time() > give_up:
            return left
        await asyncio.sleep(0.05)
