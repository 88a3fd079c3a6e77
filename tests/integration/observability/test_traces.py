"""One trace per request from a gateway-side root span (continuing the REST caller's `traceparent`) through
prefill, cache and decode: every span's parent inside the trace, the GenAI attributes on the root, bytes, blocks,
hit tokens and backend below it; an unusable handoff is an `error.type` on its span."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from protos import common_pb2
from tests.integration.mesh_harness import Mesh
from tests.integration.observability.harness import MODEL, PROMPT, ancestors, run, trace_of, traced_request

PARENT_TRACE, PARENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_one_request_is_one_trace_across_prefill_cache_and_decode(tiny_k3, spans):
    headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}  # from the REST client

    async def go():
        async with Mesh(tiny_k3, cache_data_plane=False) as mesh:  # payloads over BatchPut / BatchGet
            result = await traced_request(mesh.prefill_address, mesh.decode_address, "req-trace-1", PROMPT, 8,
                                          headers)
            await mesh.drain()  # background snapshot publication and handoff claim
            return result

    root, pre, chunks = run(go())
    assert root.trace_id == PARENT_TRACE
    assert sum(len(c.token_ids) for c in chunks) == 8
    got = trace_of(spans, PARENT_TRACE)
    by_id = {s.context.span_id: s for s in got}
    names = {s.name for s in got}
    assert {"text_completion tiny-k3", "kdamesh.v1.PrefillService/Prefill", "prefill", "prefix.lookup",
            "handoff.publish", "kdamesh.v1.CacheService/Lookup", "cache.lookup", "kdamesh.v1.CacheService/BatchPut",
            "cache.put", "kdamesh.v1.DecodeService/Decode", "decode", "handoff.claim",
            "kdamesh.v1.CacheService/BatchGet", "cache.get", "kdamesh.v1.CacheService/Remove"} <= names, sorted(names)
    assert {s.instrumentation_scope.name for s in got} >= {"kdamesh.gateway", "kdamesh.rpc", "kdamesh.prefill",
                                                          "kdamesh.cache", "kdamesh.decode"}

    # parent links: one root (parented on the REST caller's span), every other parent inside the trace
    (root_span,) = [s for s in got if s.name == "text_completion tiny-k3"]
    assert root_span.kind == SpanKind.SERVER and root_span.parent.is_remote
    assert format(root_span.parent.span_id, "016x") == PARENT_SPAN
    orphans = [s.name for s in got if s is not root_span and (s.parent is None or s.parent.span_id not in by_id)]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    one = {s.name: s for s in got}
    puts = [ancestors(s, by_id) for s in got if s.name == "cache.put"]  # the handoff's, and the snapshots'
    assert ["kdamesh.v1.CacheService/BatchPut", "handoff.publish", "prefill", "kdamesh.v1.PrefillService/Prefill",
            "text_completion tiny-k3"] in puts, puts
    gets = [s for s in got if s.name == "cache.get"]  # the client spreads a batch over up to two streams
    for get in gets:
        assert ancestors(get, by_id) == ["kdamesh.v1.CacheService/BatchGet", "handoff.claim", "decode",
                                         "kdamesh.v1.DecodeService/Decode", "text_completion tiny-k3"]
    assert ancestors(one["cache.lookup"], by_id) == ["kdamesh.v1.CacheService/Lookup", "prefix.lookup", "prefill",
                                                     "kdamesh.v1.PrefillService/Prefill", "text_completion tiny-k3"]
    servers = {s.name: s for s in got if s.kind == SpanKind.SERVER and s is not root_span}
    assert all(s.parent.is_remote for s in servers.values())  # each continued from its caller's traceparent
    assert servers["kdamesh.v1.DecodeService/Decode"].attributes["rpc.grpc.status_code"] == 0

    # GenAI attributes on the root; bytes, blocks, hit tokens and backend below it
    a = root_span.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    put = [s for s in got if s.name == "cache.put" and s.attributes["kdamesh.bytes"] > 0]
    assert put and all(s.attributes["kdamesh.cache.backend"] == "memory" for s in put)
    publish = one["handoff.publish"].attributes
    assert publish["kdamesh.blocks"] == 2 and publish["kdamesh.bytes"] >= publish["kdamesh.handoff.bytes"] > 0
    assert "kdamesh.hit_tokens" in one["prefix.lookup"].attributes
    assert one["prefill"].attributes["kdamesh.hit_tokens"] == pre.cached_tokens
    claim = one["handoff.claim"].attributes
    assert claim["kdamesh.blocks"] == 2 and claim["kdamesh.bytes"] > 0 and "error.type" not in claim
    assert one["decode"].attributes["kdamesh.decode.path"] == "handoff"
    assert one["decode"].attributes["gen_ai.usage.output_tokens"] == 8
    assert sum(get.attributes["kdamesh.bytes"] for get in gets) == claim["kdamesh.bytes"]


def test_an_unusable_handoff_is_an_error_type_on_its_span(tiny_k3, spans):
    async def go():
        async with Mesh(tiny_k3) as mesh:
            bogus = common_pb2.ObjectKey(model_fingerprint=mesh.decode_worker.fingerprint,
                                         kind=common_pb2.OBJECT_KIND_HANDOFF, content_hash=b"\x07" * 32)
            return await traced_request(mesh.prefill_address, mesh.decode_address, "req-trace-2", PROMPT, 4,
                                        handoff_key=bogus)

    root, _, chunks = run(go())
    assert sum(len(c.token_ids) for c in chunks) == 4 and not chunks[-1].used_handoff
    one = {s.name: s for s in trace_of(spans, root.trace_id)}
    assert one["handoff.claim"].attributes["error.type"] == "missing"
    assert one["decode"].attributes["kdamesh.decode.path"] == "recompute"
    assert "error.type" not in one["decode"].attributes  # recomputed: the request itself succeeded
