"""The prefill and decode services as gRPC services (health, reflection, errors, deadlines, graceful stop, probe),
the P/D decider, the gateway's REST API over an in-process mesh, and the `kdamesh serve` / `up` wiring."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tokenizer import KimiTokenizer
from gateway.app import GatewayConfig, create_app
from gateway.mesh_client import MeshClient, MeshError, MeshRequest, PDDecider
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from protos import common_pb2, decode_pb2, prefill_pb2
from tests.integration.mesh_harness import (VOCAB, Mesh, assert_all_free, engine_args, greedy, run_bounded, settle_kv_events,
                                            tiny_k3_checkpoint)


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def run(coro, timeout_s: float = 50.0):
    return run_bounded(coro, timeout_s)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _generation(request_id: str, prompt: list[int], sampling, model: str = "") -> common_pb2.GenerationRequest:
    return common_pb2.GenerationRequest(request_id=request_id, model=model, prompt=common_pb2.TokenIds(ids=prompt),
                                        sampling=sampling)


# -- gRPC service behaviour --------------------------------------------------------------------------------------


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=5)
        return reply.status


async def _services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for reply in call:
            return {s.name for s in reply.list_services_response.service}
    return set()


def test_health_reflection_and_a_model_that_does_not_load(tiny_k3, tmp_path):
    async def main():
        broken, port = await serve_prefill(PrefillServiceConfig(
            engine=engine_args(tmp_path / "missing"), cache_address="127.0.0.1:1", address="127.0.0.1:0"))
        address = f"127.0.0.1:{port}"
        with pytest.raises(Exception):
            await broken.ready()
        for service in ("", "kdamesh.v1.PrefillService"):
            assert await _health(address, service) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(address) as channel:
            from protos import prefill_pb2_grpc

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
                    prefill_pb2.PrefillRequest(generation=common_pb2.GenerationRequest(
                        prompt=common_pb2.TokenIds(ids=[1, 2]))), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await broken.stop(0)

        async with Mesh(tiny_k3) as mesh:
            for address, name in ((mesh.prefill_address, "kdamesh.v1.PrefillService"),
                                  (mesh.decode_address, "kdamesh.v1.DecodeService")):
                assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
                assert await _health(address, name) == health_pb2.HealthCheckResponse.SERVING
                assert {name, "grpc.health.v1.Health"} <= await _services(address)
    run(main())


def test_errors_are_grpc_statuses_with_messages(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 128}) as mesh:
            async def prefill_error(prompt, sampling, model=""):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await mesh.prefill_stub.Prefill(prefill_pb2.PrefillRequest(generation=_generation(
                        "bad", prompt, sampling, model=model)), timeout=10)
                return info.value

            async def decode_error(request):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in mesh.decode_stub.Decode(request, timeout=10):
                        pass
                return info.value

            e = await prefill_error([VOCAB + 300], greedy(4))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in e.details()
            e = await prefill_error(_prompt(120, 1), greedy(20))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in e.details()
            e = await prefill_error([1, 2, 3], common_pb2.SamplingParams(max_tokens=4, temperature=-1))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.details()
            e = await prefill_error([1, 2, 3], common_pb2.SamplingParams(max_tokens=4, n=2))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in e.details()
            e = await prefill_error([1, 2, 3], greedy(4), model="another-model")
            assert e.code() == grpc.StatusCode.NOT_FOUND
            e = await decode_error(decode_pb2.DecodeRequest(generation=_generation("x", [1, 2, 3], greedy(4))))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "handoff or a local prompt" in e.details()
            e = await decode_error(decode_pb2.DecodeRequest(generation=_generation("x", [1, 2, 3], greedy(200)),
                                                            local=decode_pb2.LocalPrefill()))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in e.details()
            # The mesh client surfaces them as MeshError with the same code.
            with pytest.raises(MeshError) as info:
                await mesh.run([VOCAB + 300], greedy(3), "remote")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            # Bad requests leave the workers serving.
            ok = await mesh.run([1, 2, 3], greedy(3), "remote")
            assert len(ok.ids) == 3
    run(main())


def test_deadlines_abort_and_free_the_request(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            engine = mesh.decode_server.engine
            request = decode_pb2.DecodeRequest(generation=_generation("slow", _prompt(40, 2), greedy(5000)),
                                               local=decode_pb2.LocalPrefill())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in mesh.decode_stub.Decode(request, timeout=0.5):
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(MeshError) as info:
                await mesh.run(_prompt(40, 3), greedy(5000), "remote", timeout_s=0.5)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await assert_all_free(engine)
    run(main())


def test_graceful_stop_finishes_streams_in_flight(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            request = decode_pb2.DecodeRequest(generation=_generation("drain", _prompt(30, 4), greedy(60)),
                                               local=decode_pb2.LocalPrefill())
            call = mesh.decode_stub.Decode(request, timeout=30)
            tokens = []
            async for chunk in call:
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 2:
                    break
            stopping = asyncio.create_task(mesh.decode_server.stop(10.0))
            async for chunk in call:
                tokens.extend(chunk.token_ids)
            await stopping
            assert len(tokens) == 60
            mesh.decode_server = None
            assert await _health(mesh.prefill_address) == health_pb2.HealthCheckResponse.SERVING
    run(main())


def test_probe_and_the_pd_decider(tiny_k3):
    decider = PDDecider(min_uncached_tokens=40)
    assert decider.decide(64, 1, cached_tokens=48, prefill_inflight=0, have_prefill=True) == "local"
    assert decider.decide(64, 1, cached_tokens=16, prefill_inflight=0, have_prefill=True) == "remote"
    assert decider.decide(64, 2, cached_tokens=0, prefill_inflight=0, have_prefill=True) == "local"
    assert decider.decide(64, 1, cached_tokens=0, prefill_inflight=0, have_prefill=False) == "local"
    assert PDDecider(40, max_prefill_inflight=2).decide(64, 1, 0, prefill_inflight=2, have_prefill=True) == "local"
    assert PDDecider(0).decide(1, 1, 0, 0, True) == "remote"

    async def main():
        async with Mesh(tiny_k3) as mesh:
            long, short = _prompt(64, 5), _prompt(20, 6)
            probe = decode_pb2.ProbeRequest(prompt=common_pb2.TokenIds(ids=long))
            assert (await mesh.decode_stub.Probe(probe, timeout=5)).cached_tokens == 0
            await mesh.run(long, greedy(3), "local")
            reply = await mesh.decode_stub.Probe(probe, timeout=5)
            assert reply.cached_tokens == 48 and reply.running == 0  # the last full block leaves a token to compute
            other_salt = decode_pb2.ProbeRequest(prompt=common_pb2.TokenIds(ids=long), tenant_salt=b"tenant-b")
            assert (await mesh.decode_stub.Probe(other_salt, timeout=5)).cached_tokens == 0

            client = MeshClient([mesh.decode_address], [mesh.prefill_address], PDDecider(min_uncached_tokens=40))
            client.start_kv_events()  # the decision reads the decode worker's KV-event index (what Probe answers)
            await settle_kv_events(client, {mesh.decode_address: mesh.decode_server,
                                            mesh.prefill_address: mesh.prefill_server})
            try:
                routes = {}
                for name, prompt in (("cached", long), ("short", short), ("new", _prompt(64, 7))):
                    async for event in client.generate(MeshRequest(f"pd-{name}", tuple(prompt), greedy(3))):
                        if event.usage is not None:
                            routes[name] = event.route
                assert routes == {"cached": "local", "short": "local", "new": "remote"}
            finally:
                await client.close()
    run(main())


# -- the gateway's REST API ----------------------------------------------------------------------------------------


async def _gateway(mesh: Mesh, model_dir, pd_min: int = 0):
    config = GatewayConfig(model=str(model_dir), decode_addresses=(mesh.decode_address,),
                           prefill_addresses=(mesh.prefill_address,), pd_min_uncached_tokens=pd_min)
    mesh_client = config.make_mesh()
    await mesh_client.refresh_info()  # what the app's start-up does (an ASGI transport runs no lifespan)
    app = create_app(config, mesh=mesh_client, tokenizer=KimiTokenizer.from_pretrained(model_dir))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=30)
    return client, mesh_client


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_gateway_completions_over_the_mesh(tiny_k3):
    tokenizer = KimiTokenizer.from_pretrained(tiny_k3)
    prompt_text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."

    async def main():
        async with Mesh(tiny_k3) as mesh:
            http, mesh_client = await _gateway(mesh, tiny_k3)
            try:
                assert (await http.get("/health")).json()["status"] == "ok"
                models = (await http.get("/v1/models")).json()
                assert models["object"] == "list" and models["data"][0]["id"] == tiny_k3.name

                body = {"model": tiny_k3.name, "prompt": prompt_text, "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True}
                first = (await http.post("/v1/completions", json=body)).json()
                ids = tokenizer.encode(prompt_text)
                reference = await mesh.run(ids, greedy(12), "local")
                [choice] = first["choices"]
                assert choice["text"] == tokenizer.decode(reference.ids, skip_special_tokens=True)
                assert choice["finish_reason"] == "length" and first["object"] == "text_completion"
                assert first["usage"]["prompt_tokens"] == len(ids) and first["usage"]["completion_tokens"] == 12
                # Repeated prompt: the prefix cache serves part of it.
                second = (await http.post("/v1/completions", json=body)).json()
                assert second["choices"][0]["text"] == choice["text"]
                assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

                # Streaming: same text, usage trailer, [DONE].
                stream = await http.post("/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
                assert stream.headers["content-type"].startswith("text/event-stream")
                chunks = _sse(stream.text)
                assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
                assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12

                # Token-id prompts, several prompts, n > 1 (colocated), echo, logprobs.
                multi = (await http.post("/v1/completions", json={
                    "model": tiny_k3.name, "prompt": [ids, ids[:9]], "max_tokens": 5, "temperature": 0.8, "seed": 3,
                    "n": 2, "ignore_eos": True, "logprobs": 2, "echo": True})).json()
                assert [c["index"] for c in multi["choices"]] == [0, 1, 2, 3]
                assert multi["usage"]["completion_tokens"] == 20
                assert multi["choices"][0]["text"].startswith(tokenizer.decode(ids))
                lp = multi["choices"][0]["logprobs"]  # echo: the prompt's tokens first (the first has none)
                assert len(lp["tokens"]) == len(ids) + 5 and len(lp["top_logprobs"][len(ids)]) >= 2
                assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
                assert len(multi["choices"][2]["logprobs"]["tokens"]) == 9 + 5

                # A stop string is cut from the text, in streams too.
                text = choice["text"]
                stop = text[len(text) // 2: len(text) // 2 + 3]
                cut = (await http.post("/v1/completions", json={**body, "stop": [stop]})).json()["choices"][0]
                assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"
                streamed = _sse((await http.post("/v1/completions", json={**body, "stop": stop,
                                                                          "stream": True})).text)
                assert "".join(c["choices"][0]["text"] for c in streamed) == cut["text"]
            finally:
                await http.aclose()
                await mesh_client.close()
    run(main())


def test_gateway_errors_use_the_openai_envelope(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 256}) as mesh:
            http, mesh_client = await _gateway(mesh, tiny_k3)
            name = tiny_k3.name
            cases = [
                (b"{not json", 400, None),
                ({"prompt": "hi"}, 400, "model"),
                ({"model": "nope", "prompt": "hi"}, 404, "model"),
                ({"model": name}, 400, "prompt"),
                ({"model": name, "prompt": ""}, 400, "prompt"),
                ({"model": name, "prompt": [1, "a"]}, 400, "prompt"),
                ({"model": name, "prompt": [10 ** 9]}, 400, "prompt"),
                ({"model": name, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
                ({"model": name, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
                ({"model": name, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
                ({"model": name, "prompt": "hi", "temperature": -1}, 400, None),
                ({"model": name, "prompt": "hi", "n": 0}, 400, "n"),
                ({"model": name, "prompt": "hi", "stop": [""]}, 400, "stop"),
                ({"model": name, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
                ({"model": name, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
                ({"model": name, "prompt": "hi", "max_tokens": 1000}, 400, "prompt"),
                ([1, 2], 400, None),
            ]
            try:
                for body, status, param in cases:
                    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                    reply = await http.post("/v1/completions", headers={"content-type": "application/json"},
                                            **kwargs)
                    assert reply.status_code == status, (body, reply.text)
                    error = reply.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"]
                    if param is not None:
                        assert error["param"] == param, (body, error)
                too_long = await http.post("/v1/completions", json={"model": name, "prompt": "hi",
                                                                    "max_tokens": 1000})
                assert too_long.json()["error"]["code"] == "context_length_exceeded"
            finally:
                await http.aclose()
                await mesh_client.close()
    run(main())


# -- `kdamesh serve` / `kdamesh up` wiring ---------------------------------------------------------------------------


def test_role_flags_build_the_service_configs():
    from deploy.launcher import LaunchConfig, plan_services
    from deploy.serve import engine_args_from, role_parser

    ns = role_parser("prefill").parse_args(["--model", "/m", "--cache-address", "h:1", "--max-num-seqs", "4",
                                            "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching",
                                            "--max-forward-tokens", "512"])
    args = engine_args_from(ns)
    assert (args.model, args.max_num_seqs, args.kv_cache_memory, args.enable_prefix_caching) == \
           ("/m", 4, "64MiB", False)
    assert args.max_forward_tokens == 512
    ns = role_parser("decode").parse_args(["--model", "/m", "--kv-load-failure-policy", "fail"])
    assert ns.kv_load_failure_policy == "fail" and ns.cache_address is None
    ns = role_parser("gateway").parse_args(["--model", "/m", "--decode-addresses", "a:1, b:2", "--port", "9"])
    assert ns.decode_addresses == ("a:1", "b:2") and ns.http_port == 9 and ns.prefill_addresses == ()

    from engine.config import EngineArgs

    config = LaunchConfig(model="/m", grpc_port=7000, http_port=8100, engine=EngineArgs(model="", max_num_seqs=4))
    services = plan_services(config, "/m")
    assert [s.role for s in services] == ["cache", "prefill", "decode", "gateway"]
    by_role = {s.role: s for s in services}
    assert by_role["cache"].address == "127.0.0.1:7000" and by_role["decode"].address == "127.0.0.1:7002"
    assert "--prefill-addresses" in by_role["gateway"].argv and "--max-num-seqs" in by_role["prefill"].argv
    colocated = plan_services(LaunchConfig(model="/m", mode="colocated"), "/m")
    assert [s.role for s in colocated] == ["cache", "decode", "gateway"]
    assert "--prefill-addresses" not in colocated[-1].argv
