"""Each gRPC service's Prometheus `/metrics` (side ports) has its series and moves with the traffic: requests,
time to first token, time per output token, prefix lookups and hits, pool usage, transfers, a stream in flight;
a cancelled stream is counted as CANCELLED and its spans end quietly."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import generate_latest

from protos import decode_pb2_grpc
from telemetry.context import request_id_scope
from telemetry.rpc import client_interceptors
from tests.integration.observability.harness import (PROMPT, local_request, metered_mesh, read_rest, run,
                                                     samples_of, scrape, start_decode, traced_request, value)


def test_every_grpc_service_serves_metrics_that_move(tiny_k3, spans):
    async def go():
        async with metered_mesh(tiny_k3) as m:
            ports = {role: m[role].metrics_port for role in ("cache", "prefill", "decode")}
            before = {role: await scrape(port) for role, port in ports.items()}
            for i in range(2):  # the second prefill hits the first one's blocks
                await traced_request(m["prefill_address"], m["decode_address"], f"req-metrics-{i}", PROMPT, 8)
            async with grpc.aio.insecure_channel(m["decode_address"]) as channel:  # a stream in flight
                call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("req-metrics-live", 200),
                                                                          timeout=30)
                rest = [await call.read()]
                during = await scrape(ports["decode"])
                rest += await read_rest(call)
            await m["prefill"].worker.drain()
            await m["decode"].worker.drain()
            after = {role: await scrape(port) for role, port in ports.items()}
            return before, during, after, rest

    before, during, after, rest = run(go())
    assert rest[-1].usage.completion_tokens == 200
    _prefill_metrics_moved(before["prefill"], after["prefill"])
    _decode_metrics_moved(before["decode"], during, after["decode"])
    _cache_metrics_moved(before["cache"], after["cache"])


def _prefill_metrics_moved(p0: dict, p1: dict) -> None:
    for name in ("kdamesh_prefill_model_loaded", "kdamesh_prefill_running_requests", "kdamesh_prefill_queue_depth",
                 "kdamesh_prefill_kv_block_usage_ratio", "kdamesh_prefill_state_slot_usage_ratio",
                 "kdamesh_prefill_state_snapshots", "kdamesh_prefill_preemptions_total"):
        assert (name, frozenset()) in p1, name
    assert value(p1, "kdamesh_prefill_model_loaded") == 1
    assert value(p1, "kdamesh_prefill_requests_total", method="Prefill", status="OK") - \
        value(p0, "kdamesh_prefill_requests_total", method="Prefill", status="OK") == 2
    assert value(p1, "kdamesh_prefill_time_to_first_token_seconds_count", path="prefill") == 2
    assert value(p1, "kdamesh_prefill_prompt_tokens_total", path="prefill") == 2 * len(PROMPT)
    assert value(p1, "kdamesh_prefill_prefix_lookup_tokens_total") - \
        value(p0, "kdamesh_prefill_prefix_lookup_tokens_total") == 2 * len(PROMPT)
    assert value(p1, "kdamesh_prefill_prefix_hit_tokens_total") > value(p0, "kdamesh_prefill_prefix_hit_tokens_total")
    assert value(p1, "kdamesh_prefill_kv_blocks", state="total") > 0
    assert value(p1, "kdamesh_prefill_kv_blocks", state="cached") > value(p0, "kdamesh_prefill_kv_blocks",
                                                                           state="cached")
    assert value(p1, "kdamesh_prefill_transfer_bytes_total", op="publish") > 0
    assert value(p1, "kdamesh_prefill_transfer_seconds_total", op="publish") > 0
    assert value(p1, "kdamesh_prefill_published_blocks_total") == 2


def _decode_metrics_moved(d0: dict, during: dict, d1: dict) -> None:
    assert value(d1, "kdamesh_decode_requests_total", method="Decode", status="OK") - \
        value(d0, "kdamesh_decode_requests_total", method="Decode", status="OK") == 3
    assert value(d1, "kdamesh_decode_time_to_first_token_seconds_count", path="handoff") == 2
    assert value(d1, "kdamesh_decode_time_per_output_token_seconds_count", path="handoff") == 2
    assert value(d1, "kdamesh_decode_time_per_output_token_seconds_count", path="local") == 1
    assert value(d1, "kdamesh_decode_generation_tokens_total", path="handoff") == 16
    assert value(d1, "kdamesh_decode_transfer_bytes_total", op="handoff_load") > 0
    assert value(d1, "kdamesh_decode_handoffs_total", outcome="loaded") == 2
    assert value(d1, "kdamesh_decode_prefix_lookup_tokens_total") > \
        value(d0, "kdamesh_decode_prefix_lookup_tokens_total")
    assert value(during, "kdamesh_decode_running_requests") >= 1
    assert value(during, "kdamesh_decode_requests_in_flight", method="Decode") == 1
    assert value(during, "kdamesh_decode_kv_block_usage_ratio") > 0
    assert value(d1, "kdamesh_decode_running_requests") == 0 and value(d1, "kdamesh_decode_queue_depth") == 0
    assert value(d1, "kdamesh_decode_requests_in_flight", method="Decode") == 0


def _cache_metrics_moved(c0: dict, c1: dict) -> None:
    for method in ("BatchPut", "BatchGet", "Lookup"):
        assert value(c1, "kdamesh_cache_requests_total", method=method, status="OK") > \
            value(c0, "kdamesh_cache_requests_total", method=method, status="OK"), method
    assert value(c1, "kdamesh_cache_objects") > value(c0, "kdamesh_cache_objects")
    assert value(c1, "kdamesh_cache_stored_bytes") > 0
    assert value(c1, "kdamesh_cache_transfer_bytes_total", direction="put") > 0
    assert value(c1, "kdamesh_cache_hits_total") > value(c0, "kdamesh_cache_hits_total")
    for name in ("kdamesh_cache_evictions_total", "kdamesh_cache_corrupt_reads_total"):
        assert (name, frozenset()) in c1, name


def test_a_cancelled_stream_is_counted_and_its_spans_end_quietly(tiny_k3, spans, caplog):
    async def go():
        server, port = await start_decode(tiny_k3)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors()) as channel:
                with request_id_scope("req-cancel"):
                    call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(local_request("req-cancel", 300),
                                                                              timeout=30)
                    await call.read()
                    await call.read()
                    call.cancel()
            deadline = time.monotonic() + 10
            while True:
                got = samples_of(generate_latest(server.metrics.registry).decode())
                if value(got, "kdamesh_decode_requests_in_flight", method="Decode") == 0 and \
                        value(got, "kdamesh_decode_running_requests") == 0:
                    return got
                assert time.monotonic() < deadline, "the cancelled stream is still counted or running"
                await asyncio.sleep(0.05)
        finally:
            await server.stop(1.0)

    with caplog.at_level(logging.WARNING):
        got = run(go())
    assert value(got, "kdamesh_decode_requests_total", method="Decode", status="CANCELLED") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    decode = [s for s in spans.get_finished_spans() if s.name == "decode"
              and s.attributes.get("kdamesh.request_id") == "req-cancel"]
    assert len(decode) == 1 and decode[0].attributes["error.type"] == "cancelled"
