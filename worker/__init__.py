"""What the prefill and decode services share, so that neither imports the other (they meet through the cache
service): the code between their gRPC servicers and the engine.

Modules:
- `worker.server`: the lifecycle of a worker service — a gRPC server (telemetry/grpc_server.py) whose model loads
  in the background, health SERVING once loaded, graceful stop, the engine gauges and worker counters as metrics.
- `worker.servicer`: admission of a call (loading, draining, model name), its deadline, and the gRPC status
  of an engine error.
- `worker.codec`: the wire contract (`protos`) <-> the engine's request types: one `GenerationRequest` -> the
  `GenerationJob` both workers run (sampling, structured output, media items -> image inputs), logprobs, finish
  reasons.
- `worker.info`: `WorkerInfoService` — the engine's context length, block size, speculation and parallel layout,
  which the gateway reads instead of recomputing them.
- `worker.kv_events`: the KV event stream of the engine's prefix cache.
- `worker.tenancy`: the one mapping of a tenant salt to the engine's cache salt, and a prompt's block hashes.
- `worker.transfers`: timed `BatchGet` / `BatchPut` calls for the transfer counters.
- `worker.prefix`: a prompt's prefix in the cache service — lookup, load into the engine (the prefix hit rule), and
  the remote junction (where the service holds the blocks but no snapshot) — for prefill and a colocated decode.
- `worker.offload`: the KDA snapshots the engine lets go (evicted, a handoff's turn end) stored in the cache service
  with their blocks, in the background.

Imports (downward only): engine, protos, the cache service's client side, telemetry.
"""
