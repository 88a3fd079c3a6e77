from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffSource(_message.Message):
    __slots__ = ("handoff_key", "first_token_id", "first_token_logprob", "cached_tokens")
    HANDOFF_KEY_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handoff_key: _common_pb2.ObjectKey
    first_token_id: int
    first_token_logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    def __init__(self, handoff_key: _Optional[_Union[_common_pb2.ObjectKey, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class LocalPrefill(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("handoff", "local", "generation")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    handoff: HandoffSource
    local: LocalPrefill
    generation: _common_pb2.GenerationRequest
    def __init__(self, handoff: _Optional[_Union[HandoffSource, _Mapping]] = ..., local: _Optional[_Union[LocalPrefill, _Mapping]] = ..., generation: _Optional[_Union[_common_pb2.GenerationRequest, _Mapping]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "usage", "used_handoff", "cached_tokens", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    USED_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    usage: _common_pb2.Usage
    used_handoff: bool
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., used_handoff: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("model", "prompt", "tenant_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: _common_pb2.TokenIds
    tenant_salt: bytes
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., tenant_salt: _Optional[bytes] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("cached_tokens", "running", "waiting", "kv_usage")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    running: int
    waiting: int
    kv_usage: float
    def __init__(self, cached_tokens: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ...) -> None: ...
