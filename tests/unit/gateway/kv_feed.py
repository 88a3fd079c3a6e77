"""KV event messages for unit tests of the gateway's index and router (protos/kv_events.proto), and prompts."""

from __future__ import annotations

from gateway.prefix_index import HashSpace, PromptKey
from protos import kv_events_pb2

BS = 16
FINGERPRINT = bytes(range(32))
SPACE = HashSpace(FINGERPRINT, BS)
STORED, REMOVED = kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED, kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED
SNAP_STORED, SNAP_REMOVED = kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED, kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED


def prompt(n_blocks: int, seed: int = 0, salt: str | None = "tenant", extra: int = 5) -> PromptKey:
    """`n_blocks` full blocks plus `extra` tokens of a partial block (never hashed)."""
    return PromptKey([seed * 100_000 + i for i in range(n_blocks * BS + extra)], salt)


def load(running: int = 0, waiting: int = 0, kv_usage: float = 0.0) -> kv_events_pb2.WorkerLoad:
    return kv_events_pb2.WorkerLoad(running=running, waiting=waiting, kv_usage=kv_usage)


def snapshot(blocks=(), snapshots=(), *, epoch: int = 7, sequence: int = 0, kda: bool = True,
             fingerprint: bytes = FINGERPRINT, worker_load=None) -> kv_events_pb2.KVEventMessage:
    body = kv_events_pb2.KVCacheSnapshot(block_hashes=list(blocks), snapshot_hashes=list(snapshots), block_size=BS,
                                         fingerprint=fingerprint, snapshots_required=kda)
    return kv_events_pb2.KVEventMessage(epoch=epoch, sequence=sequence, snapshot=body, load=worker_load or load())


def batch(events=(), *, epoch: int = 7, sequence: int = 0, worker_load=None) -> kv_events_pb2.KVEventMessage:
    body = kv_events_pb2.KVEventBatch(events=[kv_events_pb2.KVEvent(kind=k, block_hash=h) for k, h in events])
    return kv_events_pb2.KVEventMessage(epoch=epoch, sequence=sequence, events=body, load=worker_load or load())


def holding(key: PromptKey, n_blocks: int, snapshot_at=None, **kw) -> kv_events_pb2.KVEventMessage:
    """A snapshot message of a worker holding the first `n_blocks` blocks of `key`, with a KDA snapshot at each
    block count in `snapshot_at` (default: at `n_blocks`)."""
    hashes = key.hashes(SPACE)
    marks = [n_blocks] if snapshot_at is None else list(snapshot_at)
    return snapshot(hashes[:n_blocks], [hashes[m - 1] for m in marks if m > 0], **kw)
