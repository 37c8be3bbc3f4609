from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PreFillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "max_new_tokens", "temperature")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("request_id", "layer_idx", "block_idx", "k_data", "v_data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDX_FIELD_NUMBER: _ClassVar[int]
    K_DATA_FIELD_NUMBER: _ClassVar[int]
    V_DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer_idx: int
    block_idx: int
    k_data: bytes
    v_data: bytes
    def __init__(self, request_id: _Optional[str] = ..., layer_idx: _Optional[int] = ..., block_idx: _Optional[int] = ..., k_data: _Optional[bytes] = ..., v_data: _Optional[bytes] = ...) -> None: ...

class KVBlockStream(_message.Message):
    __slots__ = ("block", "done")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    block: KVBlock
    done: bool
    def __init__(self, block: _Optional[_Union[KVBlock, _Mapping]] = ..., done: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_blocks", "token_ids", "max_new_tokens", "temperature")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    def __init__(self, request_id: _Optional[str] = ..., kv_blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class TokenStream(_message.Message):
    __slots__ = ("request_id", "token_id", "done", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    done: bool
    finish_reason: str
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., done: _Optional[bool] = ..., finish_reason: _Optional[str] = ...) -> None: ...
