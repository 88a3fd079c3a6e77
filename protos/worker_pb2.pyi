from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "model", "max_model_len", "block_size", "speculative_method", "num_speculative_tokens", "tensor_parallel_size", "expert_parallel")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    max_model_len: int
    block_size: int
    speculative_method: str
    num_speculative_tokens: int
    tensor_parallel_size: int
    expert_parallel: bool
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., expert_parallel: _Optional[bool] = ...) -> None: ...
