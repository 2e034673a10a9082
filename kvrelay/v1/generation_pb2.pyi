from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_STATE_UNSPECIFIED: _ClassVar[GenerationState]
    GENERATION_STATE_QUEUED: _ClassVar[GenerationState]
    GENERATION_STATE_PREFILLING: _ClassVar[GenerationState]
    GENERATION_STATE_TRANSFERRING: _ClassVar[GenerationState]
    GENERATION_STATE_DENOISING: _ClassVar[GenerationState]
    GENERATION_STATE_SUCCEEDED: _ClassVar[GenerationState]
    GENERATION_STATE_FAILED: _ClassVar[GenerationState]
    GENERATION_STATE_CANCELLED: _ClassVar[GenerationState]
GENERATION_STATE_UNSPECIFIED: GenerationState
GENERATION_STATE_QUEUED: GenerationState
GENERATION_STATE_PREFILLING: GenerationState
GENERATION_STATE_TRANSFERRING: GenerationState
GENERATION_STATE_DENOISING: GenerationState
GENERATION_STATE_SUCCEEDED: GenerationState
GENERATION_STATE_FAILED: GenerationState
GENERATION_STATE_CANCELLED: GenerationState

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "negative_prompt", "seed", "width", "height", "num_inference_steps", "guidance_scale", "detach_timeout_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    DETACH_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    detach_timeout_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., seed: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., detach_timeout_seconds: _Optional[float] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("prompt", "negative_prompt", "seed", "width", "height", "num_inference_steps", "guidance_scale")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    def __init__(self, prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., seed: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ...) -> None: ...

class GenerationEvent(_message.Message):
    __slots__ = ("request_id", "state", "step", "total_steps", "image", "timings", "error", "ticket_id", "event_time", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: GenerationState
    step: int
    total_steps: int
    image: _common_pb2.Image
    timings: _common_pb2.PhaseTimings
    error: _common_pb2.ErrorStatus
    ticket_id: str
    event_time: _timestamp_pb2.Timestamp
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[GenerationState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., image: _Optional[_Union[_common_pb2.Image, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.PhaseTimings, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorStatus, _Mapping]] = ..., ticket_id: _Optional[str] = ..., event_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "state", "params", "step", "total_steps", "image", "timings", "error", "ticket_id", "create_time", "update_time", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: GenerationState
    params: GenerationParams
    step: int
    total_steps: int
    image: _common_pb2.Image
    timings: _common_pb2.PhaseTimings
    error: _common_pb2.ErrorStatus
    ticket_id: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[GenerationState, str]] = ..., params: _Optional[_Union[GenerationParams, _Mapping]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., image: _Optional[_Union[_common_pb2.Image, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.PhaseTimings, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorStatus, _Mapping]] = ..., ticket_id: _Optional[str] = ..., create_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class GetGenerationRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetGenerationResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: Generation
    def __init__(self, generation: _Optional[_Union[Generation, _Mapping]] = ...) -> None: ...

class CancelGenerationRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelGenerationResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: Generation
    def __init__(self, generation: _Optional[_Union[Generation, _Mapping]] = ...) -> None: ...

class ListGenerationsRequest(_message.Message):
    __slots__ = ("states", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[GenerationState]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[GenerationState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListGenerationsResponse(_message.Message):
    __slots__ = ("generations", "next_page_token")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    next_page_token: str
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
