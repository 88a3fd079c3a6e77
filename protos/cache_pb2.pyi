from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_SHA256: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_XXH3_64: _ClassVar[ChecksumAlgorithm]

class KeyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_STATUS_UNSPECIFIED: _ClassVar[KeyStatus]
    KEY_STATUS_FOUND: _ClassVar[KeyStatus]
    KEY_STATUS_STORED: _ClassVar[KeyStatus]
    KEY_STATUS_REMOVED: _ClassVar[KeyStatus]
    KEY_STATUS_MISSING: _ClassVar[KeyStatus]
    KEY_STATUS_CORRUPT: _ClassVar[KeyStatus]
    KEY_STATUS_ERROR: _ClassVar[KeyStatus]
    KEY_STATUS_LEASED: _ClassVar[KeyStatus]
    KEY_STATUS_TOO_LARGE: _ClassVar[KeyStatus]
    KEY_STATUS_INVALID: _ClassVar[KeyStatus]
    KEY_STATUS_RESERVED: _ClassVar[KeyStatus]
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32: ChecksumAlgorithm
CHECKSUM_ALGORITHM_SHA256: ChecksumAlgorithm
CHECKSUM_ALGORITHM_XXH3_64: ChecksumAlgorithm
KEY_STATUS_UNSPECIFIED: KeyStatus
KEY_STATUS_FOUND: KeyStatus
KEY_STATUS_STORED: KeyStatus
KEY_STATUS_REMOVED: KeyStatus
KEY_STATUS_MISSING: KeyStatus
KEY_STATUS_CORRUPT: KeyStatus
KEY_STATUS_ERROR: KeyStatus
KEY_STATUS_LEASED: KeyStatus
KEY_STATUS_TOO_LARGE: KeyStatus
KEY_STATUS_INVALID: KeyStatus
KEY_STATUS_RESERVED: KeyStatus

class Checksum(_message.Message):
    __slots__ = ("algorithm", "value")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    algorithm: ChecksumAlgorithm
    value: bytes
    def __init__(self, algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., value: _Optional[bytes] = ...) -> None: ...

class KeyResult(_message.Message):
    __slots__ = ("key", "status", "message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ObjectKey
    status: KeyStatus
    message: str
    def __init__(self, key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., status: _Optional[_Union[KeyStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ObjectHeader(_message.Message):
    __slots__ = ("key", "size_bytes", "checksum", "ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ObjectKey
    size_bytes: int
    checksum: Checksum
    ttl_ms: int
    def __init__(self, key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ObjectHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ObjectHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BatchPutResponse(_message.Message):
    __slots__ = ("results", "bytes_received")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    bytes_received: int
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.ObjectKey, _Mapping]]] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "status", "size_bytes", "checksum", "data", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: KeyStatus
    size_bytes: int
    checksum: Checksum
    data: bytes
    message: str
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[KeyStatus, str]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., data: _Optional[bytes] = ..., message: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_fingerprint", "tenant_salt", "kind", "content_hashes", "include_presence")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PRESENCE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    tenant_salt: bytes
    kind: _common_pb2.ObjectKind
    content_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    include_presence: bool
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., tenant_salt: _Optional[bytes] = ..., kind: _Optional[_Union[_common_pb2.ObjectKind, str]] = ..., content_hashes: _Optional[_Iterable[bytes]] = ..., include_presence: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_hit_length", "present")
    PREFIX_HIT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    prefix_hit_length: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, prefix_hit_length: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("keys", "ttl_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectKey]
    ttl_ms: int
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.ObjectKey, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "results", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found", "released_keys")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RELEASED_KEYS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    released_keys: int
    def __init__(self, found: _Optional[bool] = ..., released_keys: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys", "force")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectKey]
    force: bool
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.ObjectKey, _Mapping]]] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("backend", "objects", "stored_bytes", "capacity_bytes", "leased_objects", "active_leases", "hits", "misses", "corrupt_reads", "evictions", "expirations", "puts", "removes", "errors", "high_watermark", "low_watermark")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_READS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REMOVES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    backend: str
    objects: int
    stored_bytes: int
    capacity_bytes: int
    leased_objects: int
    active_leases: int
    hits: int
    misses: int
    corrupt_reads: int
    evictions: int
    expirations: int
    puts: int
    removes: int
    errors: int
    high_watermark: float
    low_watermark: float
    def __init__(self, backend: _Optional[str] = ..., objects: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., leased_objects: _Optional[int] = ..., active_leases: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., corrupt_reads: _Optional[int] = ..., evictions: _Optional[int] = ..., expirations: _Optional[int] = ..., puts: _Optional[int] = ..., removes: _Optional[int] = ..., errors: _Optional[int] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GrpcDataPlane(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RedisDataPlane(_message.Message):
    __slots__ = ("url", "key_prefix", "chunk_bytes", "inline_bytes", "socket_timeout_ms", "connect_timeout_ms")
    URL_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOCKET_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CONNECT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    url: str
    key_prefix: bytes
    chunk_bytes: int
    inline_bytes: int
    socket_timeout_ms: int
    connect_timeout_ms: int
    def __init__(self, url: _Optional[str] = ..., key_prefix: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ..., inline_bytes: _Optional[int] = ..., socket_timeout_ms: _Optional[int] = ..., connect_timeout_ms: _Optional[int] = ...) -> None: ...

class ShmDataPlane(_message.Message):
    __slots__ = ("path", "size_bytes", "token", "token_offset")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    token: bytes
    token_offset: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., token: _Optional[bytes] = ..., token_offset: _Optional[int] = ...) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("grpc", "redis", "shm", "max_object_bytes", "handoff_ttl_ms")
    GRPC_FIELD_NUMBER: _ClassVar[int]
    REDIS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    grpc: GrpcDataPlane
    redis: RedisDataPlane
    shm: ShmDataPlane
    max_object_bytes: int
    handoff_ttl_ms: int
    def __init__(self, grpc: _Optional[_Union[GrpcDataPlane, _Mapping]] = ..., redis: _Optional[_Union[RedisDataPlane, _Mapping]] = ..., shm: _Optional[_Union[ShmDataPlane, _Mapping]] = ..., max_object_bytes: _Optional[int] = ..., handoff_ttl_ms: _Optional[int] = ...) -> None: ...

class ReserveObject(_message.Message):
    __slots__ = ("key", "size_bytes", "ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.ObjectKey
    size_bytes: int
    ttl_ms: int
    def __init__(self, key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., size_bytes: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("objects", "ttl_ms")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ReserveObject]
    ttl_ms: int
    def __init__(self, objects: _Optional[_Iterable[_Union[ReserveObject, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReserveResult(_message.Message):
    __slots__ = ("status", "offset", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    offset: int
    message: str
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., offset: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "ttl_ms", "results", "arena_token")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    ttl_ms: int
    results: _containers.RepeatedCompositeFieldContainer[ReserveResult]
    arena_token: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., results: _Optional[_Iterable[_Union[ReserveResult, _Mapping]]] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "checksums")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    checksums: _containers.RepeatedCompositeFieldContainer[Checksum]
    def __init__(self, reservation_id: _Optional[str] = ..., checksums: _Optional[_Iterable[_Union[Checksum, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("found", "results", "bytes_stored")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    bytes_stored: int
    def __init__(self, found: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ..., bytes_stored: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("keys", "pin_ttl_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectKey]
    pin_ttl_ms: int
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.ObjectKey, _Mapping]]] = ..., pin_ttl_ms: _Optional[int] = ...) -> None: ...

class Location(_message.Message):
    __slots__ = ("status", "offset", "size_bytes", "checksum", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: KeyStatus
    offset: int
    size_bytes: int
    checksum: Checksum
    message: str
    def __init__(self, status: _Optional[_Union[KeyStatus, str]] = ..., offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("pin_id", "ttl_ms", "locations", "arena_token")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    ttl_ms: int
    locations: _containers.RepeatedCompositeFieldContainer[Location]
    arena_token: bytes
    def __init__(self, pin_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[Location, _Mapping]]] = ..., arena_token: _Optional[bytes] = ...) -> None: ...
