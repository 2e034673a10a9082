from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_UNSPECIFIED: _ClassVar[ReplicaRole]
    REPLICA_ROLE_AR: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DIT: _ClassVar[ReplicaRole]

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_MOONCAKE: _ClassVar[TransportKind]
    TRANSPORT_KIND_GRPC_STREAM: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]

class WriteStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_STATUS_UNSPECIFIED: _ClassVar[WriteStatus]
    WRITE_STATUS_OK: _ClassVar[WriteStatus]
    WRITE_STATUS_FAILED: _ClassVar[WriteStatus]
    WRITE_STATUS_NOT_STARTED: _ClassVar[WriteStatus]
    WRITE_STATUS_WRITER_GONE: _ClassVar[WriteStatus]
    WRITE_STATUS_IN_DOUBT: _ClassVar[WriteStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
REPLICA_ROLE_UNSPECIFIED: ReplicaRole
REPLICA_ROLE_AR: ReplicaRole
REPLICA_ROLE_DIT: ReplicaRole
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_MOONCAKE: TransportKind
TRANSPORT_KIND_GRPC_STREAM: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind
WRITE_STATUS_UNSPECIFIED: WriteStatus
WRITE_STATUS_OK: WriteStatus
WRITE_STATUS_FAILED: WriteStatus
WRITE_STATUS_NOT_STARTED: WriteStatus
WRITE_STATUS_WRITER_GONE: WriteStatus
WRITE_STATUS_IN_DOUBT: WriteStatus

class KvGeometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    page_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., page_size: _Optional[int] = ...) -> None: ...

class Parallelism(_message.Message):
    __slots__ = ("tensor_parallel_size", "sequence_parallel_size", "cfg_parallel_size")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CFG_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    sequence_parallel_size: int
    cfg_parallel_size: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., sequence_parallel_size: _Optional[int] = ..., cfg_parallel_size: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("rank", "transport", "endpoint", "base_address", "length", "ipc_handle")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    transport: TransportKind
    endpoint: str
    base_address: int
    length: int
    ipc_handle: bytes
    def __init__(self, rank: _Optional[int] = ..., transport: _Optional[_Union[TransportKind, str]] = ..., endpoint: _Optional[str] = ..., base_address: _Optional[int] = ..., length: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("src_offset", "dst_offset", "length")
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    src_offset: int
    dst_offset: int
    length: int
    def __init__(self, src_offset: _Optional[int] = ..., dst_offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PlannedWrite(_message.Message):
    __slots__ = ("row", "src_rank", "dst_rank", "segments")
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    row: int
    src_rank: int
    dst_rank: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class WriteKey(_message.Message):
    __slots__ = ("ticket_id", "row", "src_rank", "dst_rank")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    row: int
    src_rank: int
    dst_rank: int
    def __init__(self, ticket_id: _Optional[str] = ..., row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ...) -> None: ...

class RowPages(_message.Message):
    __slots__ = ("row", "num_tokens", "page_ids")
    ROW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    row: int
    num_tokens: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, row: _Optional[int] = ..., num_tokens: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PhaseTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "transfer_seconds", "load_seconds", "denoise_seconds", "decode_seconds", "total_seconds", "handoff_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    load_seconds: float
    denoise_seconds: float
    decode_seconds: float
    total_seconds: float
    handoff_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., denoise_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., handoff_seconds: _Optional[float] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("png", "width", "height", "seed")
    PNG_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    png: bytes
    width: int
    height: int
    seed: int
    def __init__(self, png: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...
