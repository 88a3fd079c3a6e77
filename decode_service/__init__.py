"""kdamesh decode service: a prefill handoff (or a local prompt) -> continuous-batching decode -> a token stream.

Modules:
- `worker`: `DecodeWorker`, the logic (claim and verify the handoff, recompute fallback, stream batches, probe).
- `server`: the thin `grpc.aio` servicer, health and reflection; `serve(config)` with `DecodeServiceConfig`.
Run one with `kdamesh serve --role decode --model DIR --cache-address HOST:PORT`.
"""
