"""The kdamesh cache service: a content-addressed store of KV blocks, KDA state snapshots and handoffs over gRPC.

Modules:
- `objects`: per-key `Status`, `Checksum`, and the byte encoding of an `ObjectKey`.
- `store`: the `Store` interface every backend implements, with its contract and value types.
- `memory_store`: the embedded default (byte budget, watermark LRU eviction skipping leases, TTLs), its payloads in
  the heap or in a shared-memory arena local clients copy in and out of (Reserve / Commit / Locate); `holds` (its
  leases, locate pins and reservations), `arena_space` (its extents in the arena) and `memory_entries` (its index
  entries) serve it.
- `kv_stream`: the KV event stream's publisher (protos/kv_events.proto), shared with the workers, and the memory
  store as its source (what the store holds, as KV blocks and snapshots are stored and dropped).
- `shm_arena`: the arena file under /dev/shm (header with a per-instance token) and its first-fit extent allocator.
- `redis_store`: a real Redis server (`redis://host:port/db`), pipelined, chunked, checksummed, counters in Redis;
  `redis_layout`: its key names and manifest format.
- `config`: `CacheServiceConfig`; `store_factory`: the store it names and the data plane that store offers.
- `servicer`: the gRPC servicer (one metrics/span wrapper for every RPC), with `put_assembler` (BatchPut framing)
  and `batch_writer` (BatchPut's batched store writes).
- `server`: `serve(config)` and the running `CacheServer` (health, reflection, /metrics); `cli`: `main(argv)`.
- `client`: `CacheClient`, the asyncio client the prefill and decode workers use (`client_types`: its value types).
- `data_plane`: the client's direct data planes (the service's Redis, or its arena), found with the DataPlane RPC.
- `malloc_tuning`: `tune_malloc()`, which keeps MiB-sized buffers in the malloc heap (call it in process entry points).
- `metrics`: Prometheus series in a caller-owned registry.

It imports only `protos` and `telemetry` (plus grpc, redis, xxhash and prometheus_client): it stores bytes and knows
no model.
Run one with `python -m cache_service --cache-backend memory|redis://host:port/db`.
"""
