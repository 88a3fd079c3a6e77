"""The gateway's context length is the workers' own (protos/worker.proto `WorkerInfoService.Info`), never recomputed.

Three engine options change the cache plan, so the context length the workers enforce: `--snapshot-budget`,
`--speculative-config` and `--tensor-parallel-size 2`. For each, the context length recomputed from the other flags
(what deploy/launcher.py's `engine_max_model_len` computed and handed the gateway) differs from the workers'; the
gateway must report and admit by the workers' value: /v1/models, /tokenize and gRPC ListModels equal the smallest
worker limit, a prompt one token over it is the gateway's 400 (the mesh is never called), and a prompt exactly at it
is served. Negative control: the same checks against a gateway that believes the recomputed value fail.

While no worker has answered, the gateway reports `max_model_len: null` and answers generation requests 503 with
`Retry-After` (never a 500, never an unchecked admission).
"""

from __future__ import annotations

import grpc
import pytest

from engine.config import plan_cache
from engine.model.config import load_model_config
from gateway.protocol.errors import RETRY_AFTER_S
from protos import gateway_pb2, gateway_pb2_grpc
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh, engine_args

MODEL = "tiny-k3"
tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)
# a small KV pool, so the cache plan (not the model's position limit) bounds the context length
POOL = {"kv_cache_memory": 1 << 20, "max_num_seqs": 4}
NGRAM_K4 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# case -> (engine options of every worker, Mesh options)
CASES = {
    "snapshot_budget": ({"snapshot_budget": 1 << 19}, {}),
    "speculative_config": ({"speculative_config": NGRAM_K4}, {}),
    # one TP > 1 worker per process: a colocated mesh of one decode worker on 2 ranks
    "tensor_parallel_size_2": ({}, {"decode_tp": 2, "with_prefill": False}),
}


def recomputed_limit(model_dir) -> int:
    """The context length of the pool's flags without the case's option: what the launcher recomputed."""
    return plan_cache(engine_args(model_dir, **POOL), load_model_config(model_dir), 4).max_model_len  # fp32


def worker_limit(mesh: Mesh) -> int:
    servers = [s for s in (mesh.prefill_server, mesh.decode_server) if s is not None]
    return min(s.engine.core.plan.max_model_len for s in servers)


async def limit_failures(gw, limit: int) -> list[str]:
    """What the gateway gets wrong about the context length `limit` (empty: nothing)."""
    failures = []
    card = (await gw.http.get("/v1/models")).json()["data"][0]
    if card["max_model_len"] != limit:
        failures.append(f"/v1/models says {card['max_model_len']}")
    tokenized = (await gw.http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})).json()
    if tokenized["max_model_len"] != limit:
        failures.append(f"/tokenize says {tokenized['max_model_len']}")
    async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
        models = await gateway_pb2_grpc.GenerationStub(channel).ListModels(gateway_pb2.ListModelsRequest())
    if models.models[0].max_model_len != limit:
        failures.append(f"gRPC ListModels says {models.models[0].max_model_len}")
    calls = []
    generate = gw.core.mesh.generate
    gw.core.mesh.generate = lambda request: calls.append(request) or generate(request)
    try:
        over = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * limit, "max_tokens": 1})
        if over.status_code != 400 or over.json()["error"]["code"] != "context_length_exceeded" or calls:
            failures.append(f"one token over: {over.status_code}, mesh called {len(calls)} times")
        at = await gw.http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * (limit - 1),
                                                          "max_tokens": 1})
        if at.status_code != 200:
            failures.append(f"at the limit: {at.status_code} {at.text[:200]}")
    finally:
        gw.core.mesh.generate = generate
    return failures


@pytest.mark.parametrize("case", list(CASES))
def test_gateway_limits_are_the_workers(tiny_k3, case):
    engine, mesh_options = CASES[case]

    async def main():
        async with Mesh(tiny_k3, engine={**POOL, **engine}, **mesh_options) as mesh, \
                running_gateway(mesh, tiny_k3, parsers=False) as gw:
            limit, recomputed = worker_limit(mesh), recomputed_limit(tiny_k3)
            assert limit != recomputed, "the case must change the cache plan"
            assert await limit_failures(gw, limit) == []
            # negative control: a gateway that believes the recomputed value gets it wrong
            gw.core.mesh.max_model_len = lambda: recomputed
            assert await limit_failures(gw, limit) != []
    run(main(), timeout_s=240)


def test_the_configured_max_model_len_only_lowers_the_limit(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine=POOL) as mesh:
            limit = worker_limit(mesh)
            for bound, expected in ((limit - 100, limit - 100), (limit + 100, limit)):
                async with running_gateway(mesh, tiny_k3, parsers=False, max_model_len=bound) as gw:
                    card = (await gw.http.get("/v1/models")).json()["data"][0]
                    assert card["max_model_len"] == expected
    run(main())


def test_before_any_worker_answers_the_limit_is_unknown_not_guessed(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine=POOL) as mesh, running_gateway(mesh, tiny_k3, parsers=False) as gw:
            assert gw.core.max_model_len == worker_limit(mesh)  # control: known once the workers answered
            gw.core.mesh.info.clear()  # as before the first answer
            card = (await gw.http.get("/v1/models")).json()["data"][0]
            assert card["max_model_len"] is None
            assert (await gw.http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})).json()[
                "max_model_len"] is None
            for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})):
                reply = await gw.http.post(path, json=body)
                assert reply.status_code == 503 and reply.headers["retry-after"] == RETRY_AFTER_S, reply.text
                assert reply.json()["error"]["code"] == "context_length_unknown"
            await gw.core.mesh.refresh_info()  # the next health round asks again
            assert gw.core.max_model_len == worker_limit(mesh)
    run(main())
