from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardHeader(_message.Message):
    __slots__ = ("job_id", "owner_node_id", "rank", "step", "total_bytes", "sha256", "generation", "kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    owner_node_id: str
    rank: int
    step: int
    total_bytes: int
    sha256: str
    generation: int
    kind: str
    def __init__(self, job_id: _Optional[str] = ..., owner_node_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("header", "offset", "data", "crc32")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    offset: int
    data: bytes
    crc32: int
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PutShardReply(_message.Message):
    __slots__ = ("rank", "step", "bytes", "sha256", "received_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    bytes: int
    sha256: str
    received_s: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., received_s: _Optional[float] = ...) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("job_id", "rank", "step", "owner_node_id", "kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OWNER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    step: int
    owner_node_id: str
    kind: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., owner_node_id: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("job_id", "verify")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    verify: bool
    def __init__(self, job_id: _Optional[str] = ..., verify: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("rank", "step", "bytes", "sha256", "kind", "owner_node_id", "generation", "path")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OWNER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    bytes: int
    sha256: str
    kind: str
    owner_node_id: str
    generation: int
    path: str
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., kind: _Optional[str] = ..., owner_node_id: _Optional[str] = ..., generation: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class RejectedShardInfo(_message.Message):
    __slots__ = ("rank", "step", "kind", "path", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    kind: str
    path: str
    reason: str
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[str] = ..., path: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListShardsReply(_message.Message):
    __slots__ = ("node_id", "shards", "rejected")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedShardInfo]
    def __init__(self, node_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., rejected: _Optional[_Iterable[_Union[RejectedShardInfo, _Mapping]]] = ...) -> None: ...
