"""Disaggregated serving across tensor-parallel sizes, and a worker whose rank fails.

In-process meshes (tests/integration/mesh_harness.py) on the tiny-k3 checkpoint, one worker at TP=2 (two rank
processes on CPU gloo, engine/parallel/executor.py): TP=2 prefill -> TP=1 decode and TP=1 prefill -> TP=2 decode
equal colocated TP=1 token for token (handoffs carry all KDA heads whatever the TP size), with prefix reuse at the
TP=2 side; the zeroed-state handoff (negative control) still changes the output. A rank killed with SIGKILL or
hung (SIGSTOP) turns the worker's gRPC health NOT_SERVING and fails its requests with a terminal error within their
deadline; after stop, no rank process is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.mesh_client import MeshError
from tests.integration.mesh_harness import (Mesh, greedy, prompt_suite, run_bounded, tiny_k3_checkpoint,
                                            zero_kda_state)
from tests.integration.test_disaggregated import _decode, _prefill, _rewrite_handoff
from tests.unit.parallel.test_executor import _alive

PROMPTS = prompt_suite()[::3]  # lengths 1 .. 100, with shared prefixes
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny_k3) -> list[list[int]]:
    """Colocated TP=1 (the decode worker prefilling locally)."""
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            return [(await mesh.run(p, greedy(MAX_TOKENS), "local")).ids for p in PROMPTS]
    return run_bounded(main(), 120.0)


def _remote_equals_reference(tiny_k3, reference, **tp) -> None:
    async def main():
        async with Mesh(tiny_k3, **tp) as mesh:
            servers = {"prefill_tp": mesh.prefill_server, "decode_tp": mesh.decode_server}
            assert [len(s.engine.core.executor.rank_pids) for k, s in servers.items()] == \
                [tp.get(k, 1) - 1 for k in servers]  # the TP=2 worker really runs a second rank
            cached = 0
            for i, prompt in enumerate(PROMPTS):
                remote = await mesh.run(prompt, greedy(MAX_TOKENS), "remote")
                assert remote.route == "remote" and remote.ids == reference[i], f"prompt {i}"
                cached += remote.usage.cached_tokens
            assert cached > 0, "prefill never reused a cached prefix"
            assert mesh.decode_worker.counters.handoff_loaded == len(PROMPTS)
            assert mesh.decode_worker.counters.handoff_failures == 0
    run_bounded(main(), 240.0)


def test_tp2_prefill_to_tp1_decode_equals_colocated_tp1(tiny_k3, reference):
    _remote_equals_reference(tiny_k3, reference, prefill_tp=2)


def test_tp1_prefill_to_tp2_decode_equals_colocated_tp1(tiny_k3, reference):
    _remote_equals_reference(tiny_k3, reference, decode_tp=2)


def test_zeroed_state_from_a_tp2_prefill_changes_the_output(tiny_k3, reference):
    async def main():
        async with Mesh(tiny_k3, prefill_tp=2) as mesh:
            prompt, sampling = PROMPTS[-2], greedy(MAX_TOKENS)
            response = await _prefill(mesh, prompt, sampling, "zeroed")
            await _rewrite_handoff(mesh, response.handoff_key, zero_kda_state)
            zeroed, last = await _decode(mesh, prompt, sampling, response, "zeroed")
            assert last.used_handoff and zeroed[0] == reference[-2][0]
            assert zeroed != reference[-2]
    run_bounded(main(), 240.0)


async def _health(mesh: Mesh) -> int:
    stub = health_pb2_grpc.HealthStub(mesh._channel(mesh.decode_address))
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_failed_rank_makes_the_worker_not_serving(tiny_k3, fault):
    deadline_s = 15.0

    async def main():
        mesh = Mesh(tiny_k3, with_prefill=False, decode_tp=2, engine={"collective_timeout_s": 4.0})
        async with mesh:
            pids = mesh.decode_server.engine.core.executor.rank_pids
            assert (await mesh.run(PROMPTS[2], greedy(3), "local")).ids
            assert await _health(mesh) == health_pb2.HealthCheckResponse.SERVING
            os.kill(pids[0], fault)
            t0 = time.monotonic()
            with pytest.raises(MeshError):
                await mesh.run(PROMPTS[3], greedy(3), "local", timeout_s=deadline_s)
            assert time.monotonic() - t0 < deadline_s + 1.0
            for _ in range(40):
                if await _health(mesh) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.25)
            assert await _health(mesh) == health_pb2.HealthCheckResponse.NOT_SERVING
        return pids

    pids = run_bounded(main(), 120.0)
    assert not any(_alive(pid) for pid in pids)
