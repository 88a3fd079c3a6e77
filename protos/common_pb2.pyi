from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ObjectKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECT_KIND_UNSPECIFIED: _ClassVar[ObjectKind]
    OBJECT_KIND_KV_BLOCK: _ClassVar[ObjectKind]
    OBJECT_KIND_STATE_SNAPSHOT: _ClassVar[ObjectKind]
    OBJECT_KIND_HANDOFF: _ClassVar[ObjectKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
OBJECT_KIND_UNSPECIFIED: ObjectKind
OBJECT_KIND_KV_BLOCK: ObjectKind
OBJECT_KIND_STATE_SNAPSHOT: ObjectKind
OBJECT_KIND_HANDOFF: ObjectKind

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "top_logprobs", "n", "skip_special_tokens", "structured_output", "prompt_logprobs", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: bool
    top_logprobs: int
    n: int
    skip_special_tokens: bool
    structured_output: StructuredOutput
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerationRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "sampling", "tenant_salt", "media", "priority", "snapshot_hints", "tenant", "output_interval_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HINTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: TokenIds
    sampling: SamplingParams
    tenant_salt: bytes
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    priority: int
    snapshot_hints: _containers.RepeatedScalarFieldContainer[int]
    tenant: TenantShare
    output_interval_ms: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[bytes] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., priority: _Optional[int] = ..., snapshot_hints: _Optional[_Iterable[int]] = ..., tenant: _Optional[_Union[TenantShare, _Mapping]] = ..., output_interval_ms: _Optional[int] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "json_schema", "tools", "tool_mode", "tool_name", "parallel_tool_calls", "output_format", "starts_in_reasoning", "max_reasoning_tokens", "max_string_tokens")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[StructuredOutput.Kind]
        KIND_JSON_OBJECT: _ClassVar[StructuredOutput.Kind]
        KIND_JSON_SCHEMA: _ClassVar[StructuredOutput.Kind]
        KIND_TOOL_CALL: _ClassVar[StructuredOutput.Kind]
        KIND_TEXT: _ClassVar[StructuredOutput.Kind]
    KIND_UNSPECIFIED: StructuredOutput.Kind
    KIND_JSON_OBJECT: StructuredOutput.Kind
    KIND_JSON_SCHEMA: StructuredOutput.Kind
    KIND_TOOL_CALL: StructuredOutput.Kind
    KIND_TEXT: StructuredOutput.Kind
    class ToolMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TOOL_MODE_UNSPECIFIED: _ClassVar[StructuredOutput.ToolMode]
        TOOL_MODE_REQUIRED: _ClassVar[StructuredOutput.ToolMode]
        TOOL_MODE_NAMED: _ClassVar[StructuredOutput.ToolMode]
    TOOL_MODE_UNSPECIFIED: StructuredOutput.ToolMode
    TOOL_MODE_REQUIRED: StructuredOutput.ToolMode
    TOOL_MODE_NAMED: StructuredOutput.ToolMode
    class Tool(_message.Message):
        __slots__ = ("name", "parameters_json")
        NAME_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
        name: str
        parameters_json: str
        def __init__(self, name: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_MODE_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STARTS_IN_REASONING_FIELD_NUMBER: _ClassVar[int]
    MAX_REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STRING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredOutput.Kind
    json_schema: str
    tools: _containers.RepeatedCompositeFieldContainer[StructuredOutput.Tool]
    tool_mode: StructuredOutput.ToolMode
    tool_name: str
    parallel_tool_calls: bool
    output_format: str
    starts_in_reasoning: bool
    max_reasoning_tokens: int
    max_string_tokens: int
    def __init__(self, kind: _Optional[_Union[StructuredOutput.Kind, str]] = ..., json_schema: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[StructuredOutput.Tool, _Mapping]]] = ..., tool_mode: _Optional[_Union[StructuredOutput.ToolMode, str]] = ..., tool_name: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., output_format: _Optional[str] = ..., starts_in_reasoning: _Optional[bool] = ..., max_reasoning_tokens: _Optional[int] = ..., max_string_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("content_hash", "token_offset", "num_tokens", "data", "mime_type")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    token_offset: int
    num_tokens: int
    data: bytes
    mime_type: str
    def __init__(self, content_hash: _Optional[bytes] = ..., token_offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ObjectKey(_message.Message):
    __slots__ = ("model_fingerprint", "tenant_salt", "kind", "content_hash")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    tenant_salt: bytes
    kind: ObjectKind
    content_hash: bytes
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., tenant_salt: _Optional[bytes] = ..., kind: _Optional[_Union[ObjectKind, str]] = ..., content_hash: _Optional[bytes] = ...) -> None: ...
