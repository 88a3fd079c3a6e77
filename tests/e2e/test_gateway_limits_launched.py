"""End to end: `kdamesh up --snapshot-budget ...` — the gateway's context length is the one its workers report
(protos/worker.proto), not the one recomputed from the flags without the snapshot budget (what the launcher's
`engine_max_model_len` computed), and a prompt one token over it is the gateway's own 400, never a worker's error.
(tests/integration/test_gateway_limits.py covers the speculative and tensor-parallel cases in process.)"""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import httpx

from engine.config import EngineArgs, plan_cache
from engine.model.config import load_model_config
from protos import worker_pb2, worker_pb2_grpc
from telemetry import mesh_auth
from tests.e2e.launched import MODEL, launch, stop

TOKEN = "launched-limits-test-token"


async def _worker_infos(addresses: list[str]) -> list[worker_pb2.WorkerInfo]:
    infos = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address, interceptors=mesh_auth.client_interceptors(TOKEN)) as channel:
            infos.append(await worker_pb2_grpc.WorkerInfoServiceStub(channel).Info(worker_pb2.WorkerInfoRequest(),
                                                                                   timeout=10))
    return infos


def test_launched_gateway_reports_and_enforces_the_workers_limit(tmp_path):
    launched = launch(tmp_path, "endpoints ", up_flags=["--snapshot-budget", "16MiB"],
                      env={**os.environ, mesh_auth.MESH_TOKEN_ENV: TOKEN})
    try:
        endpoints = json.loads(launched.line)
        workers = [address for name, address in endpoints.items() if name.startswith(("prefill", "decode"))]
        infos = asyncio.run(_worker_infos(workers))
        assert {info.role for info in infos} == {"prefill", "decode"}
        limit = min(info.max_model_len for info in infos)
        # what the launcher recomputed (the same flags without --snapshot-budget; float32 on CPU)
        recomputed = plan_cache(EngineArgs(model=str(launched.model), max_num_seqs=8, kv_cache_memory="32MiB"),
                                load_model_config(launched.model), 4).max_model_len
        assert limit < recomputed  # the snapshot budget takes memory from the KV pool

        base = f"http://127.0.0.1:{launched.port}"
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert card["max_model_len"] == limit != recomputed
        over = httpx.post(f"{base}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": [1] * limit, "max_tokens": 1})
        error = over.json()["error"]
        # the gateway's check names the completion tokens; a worker's refusal would say "asks for"
        assert over.status_code == 400 and error["code"] == "context_length_exceeded", over.text
        assert f"maximum context length is {limit} tokens" in error["message"]
        assert "+ 1 completion tokens" in error["message"] and "asks for" not in error["message"]
    finally:
        stop(launched.proc)
