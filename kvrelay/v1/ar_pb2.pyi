from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvrelay.v1 import broker_pb2 as _broker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_counts", "max_tokens")
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    def __init__(self, token_counts: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("ticket_id", "request_id", "rows", "seed", "plan", "deadline_time", "write_token")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_TIME_FIELD_NUMBER: _ClassVar[int]
    WRITE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    request_id: str
    rows: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    plan: _broker_pb2.TicketPlan
    deadline_time: _timestamp_pb2.Timestamp
    write_token: str
    def __init__(self, ticket_id: _Optional[str] = ..., request_id: _Optional[str] = ..., rows: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., plan: _Optional[_Union[_broker_pb2.TicketPlan, _Mapping]] = ..., deadline_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., write_token: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_counts", "bytes_written", "prefill_seconds", "transfer_seconds")
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    bytes_written: int
    prefill_seconds: float
    transfer_seconds: float
    def __init__(self, token_counts: _Optional[_Iterable[int]] = ..., bytes_written: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...
