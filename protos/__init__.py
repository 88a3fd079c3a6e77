"""kdamesh's contracts: the `.proto` files of package `kdamesh.v1` and the Python generated next to them.

- `common.proto`: token ids, sampling parameters, the generation request both workers get, usage, finish reasons,
  media items, cache object keys.
- `cache.proto`: `CacheService` (BatchPut / BatchGet in chunks, Lookup, Lease / Release, Remove, Stats).
- `prefill.proto`: `PrefillService.Prefill` (prompt -> first token + handoff key).
- `decode.proto`: `DecodeService.Decode` (handoff or local prompt -> stream of token batches).
- `worker.proto`: `WorkerInfoService.Info` (a worker's context length, block size, speculation, parallel layout).
- `gateway.proto`: `Generation`, the public API the SDK calls (Generate, Chat, ListModels, Tokenize, Detokenize).

The generated modules (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) are committed and reproducible with one command,
`python -m protos.build` (or `make protos`); `tests/unit/cache/test_protos_fresh.py` fails when they are stale.
They import each other as `from protos import common_pb2`, so import them the same way:

    from protos import cache_pb2, cache_pb2_grpc, common_pb2
"""
