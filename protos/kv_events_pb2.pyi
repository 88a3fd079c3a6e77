from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCK_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCK_REMOVED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_SNAPSHOT_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_SNAPSHOT_REMOVED: _ClassVar[KVEventKind]
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_BLOCK_STORED: KVEventKind
KV_EVENT_KIND_BLOCK_REMOVED: KVEventKind
KV_EVENT_KIND_SNAPSHOT_STORED: KVEventKind
KV_EVENT_KIND_SNAPSHOT_REMOVED: KVEventKind

class KVSubscribeRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class KVEventMessage(_message.Message):
    __slots__ = ("epoch", "sequence", "snapshot", "events", "load")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    sequence: int
    snapshot: KVCacheSnapshot
    events: KVEventBatch
    load: WorkerLoad
    def __init__(self, epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[_Union[KVCacheSnapshot, _Mapping]] = ..., events: _Optional[_Union[KVEventBatch, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class KVCacheSnapshot(_message.Message):
    __slots__ = ("block_hashes", "snapshot_hashes", "block_size", "fingerprint", "snapshots_required", "any_model", "loads_remote_prefix")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ANY_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOADS_REMOTE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    snapshot_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    fingerprint: bytes
    snapshots_required: bool
    any_model: bool
    loads_remote_prefix: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., snapshot_hashes: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., snapshots_required: _Optional[bool] = ..., any_model: _Optional[bool] = ..., loads_remote_prefix: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hash")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: KVEventKind
    block_hash: bytes
    def __init__(self, kind: _Optional[_Union[KVEventKind, str]] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ...) -> None: ...
