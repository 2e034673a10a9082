from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvrelay.v1 import broker_pb2 as _broker_pb2
from kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DenoisePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENOISE_PHASE_UNSPECIFIED: _ClassVar[DenoisePhase]
    DENOISE_PHASE_LOADING: _ClassVar[DenoisePhase]
    DENOISE_PHASE_LOADED: _ClassVar[DenoisePhase]
    DENOISE_PHASE_STEP: _ClassVar[DenoisePhase]
    DENOISE_PHASE_DECODED: _ClassVar[DenoisePhase]
DENOISE_PHASE_UNSPECIFIED: DenoisePhase
DENOISE_PHASE_LOADING: DenoisePhase
DENOISE_PHASE_LOADED: DenoisePhase
DENOISE_PHASE_STEP: DenoisePhase
DENOISE_PHASE_DECODED: DenoisePhase

class DenoiseRequest(_message.Message):
    __slots__ = ("ticket_id", "request_id", "width", "height", "num_inference_steps", "guidance_scale", "seed", "plan", "deadline_time")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_TIME_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    request_id: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    plan: _broker_pb2.TicketPlan
    deadline_time: _timestamp_pb2.Timestamp
    def __init__(self, ticket_id: _Optional[str] = ..., request_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., plan: _Optional[_Union[_broker_pb2.TicketPlan, _Mapping]] = ..., deadline_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DenoiseEvent(_message.Message):
    __slots__ = ("phase", "step", "total_steps", "image", "load_seconds", "denoise_seconds", "decode_seconds", "bytes_loaded")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    phase: DenoisePhase
    step: int
    total_steps: int
    image: _common_pb2.Image
    load_seconds: float
    denoise_seconds: float
    decode_seconds: float
    bytes_loaded: int
    def __init__(self, phase: _Optional[_Union[DenoisePhase, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., image: _Optional[_Union[_common_pb2.Image, _Mapping]] = ..., load_seconds: _Optional[float] = ..., denoise_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., bytes_loaded: _Optional[int] = ...) -> None: ...

class PutKvRequest(_message.Message):
    __slots__ = ("ticket_id", "row", "src_rank", "dst_rank", "dst_offset", "data")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    row: int
    src_rank: int
    dst_rank: int
    dst_offset: int
    data: bytes
    def __init__(self, ticket_id: _Optional[str] = ..., row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., dst_offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutKvResponse(_message.Message):
    __slots__ = ("bytes_received", "chunks_received")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    chunks_received: int
    def __init__(self, bytes_received: _Optional[int] = ..., chunks_received: _Optional[int] = ...) -> None: ...
