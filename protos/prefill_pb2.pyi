from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("handoff_ttl_ms", "generation")
    HANDOFF_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    handoff_ttl_ms: int
    generation: _common_pb2.GenerationRequest
    def __init__(self, handoff_ttl_ms: _Optional[int] = ..., generation: _Optional[_Union[_common_pb2.GenerationRequest, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("request_id", "first_token_id", "first_token_logprob", "handoff_key", "finish_reason", "prompt_tokens", "cached_tokens", "handoff_bytes", "published_blocks", "published_snapshots", "timings", "prompt_logprobs")
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
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
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
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., handoff_key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., handoff_bytes: _Optional[int] = ..., published_blocks: _Optional[int] = ..., published_snapshots: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
