"""JSON log lines carry the request id and the trace id through every service: the gRPC access lines of prefill,
decode and cache, and the gateway's one line per request."""

from __future__ import annotations

import io
import json
import logging

from telemetry.logs import JsonFormatter, RequestContextFilter, log_request
from tests.integration.mesh_harness import Mesh
from tests.integration.observability.harness import MODEL, PROMPT, run, traced_request


def test_json_log_lines_carry_the_request_id_through_every_service(tiny_k3, spans):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter("kdamesh-test"))
    root_logger = logging.getLogger()
    old_level = root_logger.level
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.DEBUG)  # the cache service's access lines are DEBUG

    async def go():
        async with Mesh(tiny_k3, cache_data_plane=False) as mesh:  # payloads over BatchPut / BatchGet
            root, _, chunks = await traced_request(mesh.prefill_address, mesh.decode_address, "req-logs-1", PROMPT,
                                                   6)
            await mesh.drain()
            log_request(request_id="req-logs-1", tenant="acme", model=MODEL, endpoint="/v1/completions",
                        status=200, prompt_tokens=len(PROMPT), completion_tokens=6, cached_tokens=0,
                        ttft_s=0.01, duration_s=0.05)
            return root

    try:
        root = run(go())
    finally:
        root_logger.removeHandler(handler)
        root_logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one JSON object
    mine = [x for x in lines if x.get("request_id") == "req-logs-1"]
    access = [x for x in mine if "rpc" in x]
    assert {x["rpc"]["server"] for x in access} == {"prefill", "decode", "cache"}
    assert {x["rpc"]["method"] for x in access} >= {"Prefill", "Decode", "Lookup", "BatchPut", "BatchGet"}
    assert all(x["rpc"]["status"] == "OK" for x in access)
    assert {x["trace_id"] for x in access} == {root.trace_id}
    (request_line,) = [x for x in mine if "request" in x]
    assert request_line["request"]["tenant"] == "acme" and request_line["request"]["completion_tokens"] == 6
