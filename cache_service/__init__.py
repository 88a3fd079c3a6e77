"""The kdamesh cache service: a content-addressed store of KV blocks, KDA state snapshots and handoffs over gRPC.

Modules:
- `objects`: per-key `Status`, `Checksum`, and the byte encoding of an `ObjectKey`.
- `store`: the `Store` interface every backend implements, with its contract.
- `memory_store`: the embedded default (byte budget, watermark LRU eviction skipping leases, TTLs).
- `redis_store`: a real Redis server (`redis://host:port/db`), pipelined, chunked, checksummed.
- `server`: the `grpc.aio` servicer, health and reflection; `serve(config)` and `main(argv)`.
- `client`: `CacheClient`, the asyncio client the prefill and decode workers use.
- `metrics`: Prometheus series in a caller-owned registry.

It imports only `protos` (plus grpc, redis and prometheus_client): it stores bytes and knows no model.
Run one with `python -m cache_service --cache-backend memory|redis://host:port/db`.
"""
