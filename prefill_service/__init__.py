"""kdamesh prefill service: prompt -> first token + KV blocks, state snapshots and a handoff in the cache service.

Modules:
- `worker`: `PrefillWorker`, the logic (remote prefix load, compute, publish, handoff), testable without gRPC.
- `server`: the thin `grpc.aio` servicer, health and reflection; `serve(config)` with `PrefillServiceConfig`.
Run one with `kdamesh serve --role prefill --model DIR --cache-address HOST:PORT`.
"""
