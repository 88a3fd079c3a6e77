from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "sampling", "tenant_salt", "media", "priority", "handoff_ttl_ms", "snapshot_hints")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HINTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    tenant_salt: bytes
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaItem]
    priority: int
    handoff_ttl_ms: int
    snapshot_hints: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[bytes] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaItem, _Mapping]]] = ..., priority: _Optional[int] = ..., handoff_ttl_ms: _Optional[int] = ..., snapshot_hints: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_ms", "load_ms", "compute_ms", "publish_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    load_ms: float
    compute_ms: float
    publish_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., load_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., publish_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprob", "handoff_key", "finish_reason", "prompt_tokens", "cached_tokens", "handoff_bytes", "published_blocks", "published_snapshots", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_KEY_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprob: _common_pb2.TokenLogprob
    handoff_key: _common_pb2.ObjectKey
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    cached_tokens: int
    handoff_bytes: int
    published_blocks: int
    published_snapshots: int
    timings: PrefillTimings
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., handoff_key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., handoff_bytes: _Optional[int] = ..., published_blocks: _Optional[int] = ..., published_snapshots: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ...) -> None: ...
