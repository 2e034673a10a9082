from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TicketState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TICKET_STATE_UNSPECIFIED: _ClassVar[TicketState]
    TICKET_STATE_RESERVED: _ClassVar[TicketState]
    TICKET_STATE_WRITING: _ClassVar[TicketState]
    TICKET_STATE_READY: _ClassVar[TicketState]
    TICKET_STATE_CONSUMING: _ClassVar[TicketState]
    TICKET_STATE_DRAINING: _ClassVar[TicketState]
    TICKET_STATE_RELEASED: _ClassVar[TicketState]

class TicketOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TICKET_OUTCOME_UNSPECIFIED: _ClassVar[TicketOutcome]
    TICKET_OUTCOME_OK: _ClassVar[TicketOutcome]
    TICKET_OUTCOME_CANCELLED: _ClassVar[TicketOutcome]
    TICKET_OUTCOME_TIMED_OUT: _ClassVar[TicketOutcome]
    TICKET_OUTCOME_FAILED: _ClassVar[TicketOutcome]
TICKET_STATE_UNSPECIFIED: TicketState
TICKET_STATE_RESERVED: TicketState
TICKET_STATE_WRITING: TicketState
TICKET_STATE_READY: TicketState
TICKET_STATE_CONSUMING: TicketState
TICKET_STATE_DRAINING: TicketState
TICKET_STATE_RELEASED: TicketState
TICKET_OUTCOME_UNSPECIFIED: TicketOutcome
TICKET_OUTCOME_OK: TicketOutcome
TICKET_OUTCOME_CANCELLED: TicketOutcome
TICKET_OUTCOME_TIMED_OUT: TicketOutcome
TICKET_OUTCOME_FAILED: TicketOutcome

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "role", "incarnation_id", "layout_version", "version", "endpoint", "regions", "geometry", "parallelism", "num_pages", "max_tokens", "transport", "stage_id", "max_num_seqs", "up", "fenced", "lease_expire_time", "max_image_side")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_SIDE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    role: _common_pb2.ReplicaRole
    incarnation_id: str
    layout_version: int
    version: str
    endpoint: str
    regions: _containers.RepeatedCompositeFieldContainer[_common_pb2.MemoryRegion]
    geometry: _common_pb2.KvGeometry
    parallelism: _common_pb2.Parallelism
    num_pages: int
    max_tokens: int
    transport: _common_pb2.TransportKind
    stage_id: int
    max_num_seqs: int
    up: bool
    fenced: bool
    lease_expire_time: _timestamp_pb2.Timestamp
    max_image_side: int
    def __init__(self, replica_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.ReplicaRole, str]] = ..., incarnation_id: _Optional[str] = ..., layout_version: _Optional[int] = ..., version: _Optional[str] = ..., endpoint: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[_common_pb2.MemoryRegion, _Mapping]]] = ..., geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ..., parallelism: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., num_pages: _Optional[int] = ..., max_tokens: _Optional[int] = ..., transport: _Optional[_Union[_common_pb2.TransportKind, str]] = ..., stage_id: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., up: bool = ..., fenced: bool = ..., lease_expire_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., max_image_side: _Optional[int] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("replica", "token", "unresolved_writes", "held_ticket_ids", "owed_releases", "registered_before", "highest_ticket_sequence")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    UNRESOLVED_WRITES_FIELD_NUMBER: _ClassVar[int]
    HELD_TICKET_IDS_FIELD_NUMBER: _ClassVar[int]
    OWED_RELEASES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_TICKET_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaInfo
    token: str
    unresolved_writes: _containers.RepeatedCompositeFieldContainer[_common_pb2.WriteKey]
    held_ticket_ids: _containers.RepeatedScalarFieldContainer[str]
    owed_releases: _containers.RepeatedCompositeFieldContainer[OwedRelease]
    registered_before: bool
    highest_ticket_sequence: int
    def __init__(self, replica: _Optional[_Union[ReplicaInfo, _Mapping]] = ..., token: _Optional[str] = ..., unresolved_writes: _Optional[_Iterable[_Union[_common_pb2.WriteKey, _Mapping]]] = ..., held_ticket_ids: _Optional[_Iterable[str]] = ..., owed_releases: _Optional[_Iterable[_Union[OwedRelease, _Mapping]]] = ..., registered_before: bool = ..., highest_ticket_sequence: _Optional[int] = ...) -> None: ...

class OwedRelease(_message.Message):
    __slots__ = ("ticket_id", "outcome", "reason")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    outcome: TicketOutcome
    reason: str
    def __init__(self, ticket_id: _Optional[str] = ..., outcome: _Optional[_Union[TicketOutcome, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("lease_seconds", "fenced")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    fenced: bool
    def __init__(self, lease_seconds: _Optional[float] = ..., fenced: bool = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "incarnation_id", "unresolved_writes", "receiver_run")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    UNRESOLVED_WRITES_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_RUN_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation_id: str
    unresolved_writes: _containers.RepeatedCompositeFieldContainer[_common_pb2.WriteKey]
    receiver_run: ReceiverRun
    def __init__(self, replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., unresolved_writes: _Optional[_Iterable[_Union[_common_pb2.WriteKey, _Mapping]]] = ..., receiver_run: _Optional[_Union[ReceiverRun, _Mapping]] = ...) -> None: ...

class ReceiverRun(_message.Message):
    __slots__ = ("probe", "stall_free_seconds", "ranks")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    STALL_FREE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    probe: int
    stall_free_seconds: float
    ranks: int
    def __init__(self, probe: _Optional[int] = ..., stall_free_seconds: _Optional[float] = ..., ranks: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("fenced", "lease_seconds", "poll_writes", "fence_reason", "credential_superseded", "credential_grace_seconds", "probe", "next_heartbeat_seconds")
    FENCED_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLL_WRITES_FIELD_NUMBER: _ClassVar[int]
    FENCE_REASON_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fenced: bool
    lease_seconds: float
    poll_writes: _containers.RepeatedCompositeFieldContainer[_common_pb2.WriteKey]
    fence_reason: str
    credential_superseded: bool
    credential_grace_seconds: float
    probe: int
    next_heartbeat_seconds: float
    def __init__(self, fenced: bool = ..., lease_seconds: _Optional[float] = ..., poll_writes: _Optional[_Iterable[_Union[_common_pb2.WriteKey, _Mapping]]] = ..., fence_reason: _Optional[str] = ..., credential_superseded: bool = ..., credential_grace_seconds: _Optional[float] = ..., probe: _Optional[int] = ..., next_heartbeat_seconds: _Optional[float] = ...) -> None: ...

class DeregisterReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "incarnation_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation_id: str
    def __init__(self, replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class DeregisterReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WriteProgress(_message.Message):
    __slots__ = ("row", "src_rank", "dst_rank", "status", "checksum", "bytes")
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    row: int
    src_rank: int
    dst_rank: int
    status: _common_pb2.WriteStatus
    checksum: int
    bytes: int
    def __init__(self, row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.WriteStatus, str]] = ..., checksum: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("row", "dst_rank", "loaded")
    ROW_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    row: int
    dst_rank: int
    loaded: bool
    def __init__(self, row: _Optional[int] = ..., dst_rank: _Optional[int] = ..., loaded: bool = ...) -> None: ...

class Ticket(_message.Message):
    __slots__ = ("ticket_id", "request_id", "state", "outcome", "ar_replica_id", "dit_replica_id", "rows", "armed", "writes", "loads", "reason", "create_time", "update_time", "sequence")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    AR_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DIT_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ARMED_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    request_id: str
    state: TicketState
    outcome: TicketOutcome
    ar_replica_id: str
    dit_replica_id: str
    rows: _containers.RepeatedCompositeFieldContainer[_common_pb2.RowPages]
    armed: bool
    writes: _containers.RepeatedCompositeFieldContainer[WriteProgress]
    loads: _containers.RepeatedCompositeFieldContainer[LoadProgress]
    reason: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    sequence: int
    def __init__(self, ticket_id: _Optional[str] = ..., request_id: _Optional[str] = ..., state: _Optional[_Union[TicketState, str]] = ..., outcome: _Optional[_Union[TicketOutcome, str]] = ..., ar_replica_id: _Optional[str] = ..., dit_replica_id: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[_common_pb2.RowPages, _Mapping]]] = ..., armed: bool = ..., writes: _Optional[_Iterable[_Union[WriteProgress, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[LoadProgress, _Mapping]]] = ..., reason: _Optional[str] = ..., create_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...

class CreateTicketRequest(_message.Message):
    __slots__ = ("request_id", "ar_replica_id", "dit_replica_id", "row_token_counts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AR_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DIT_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ar_replica_id: str
    dit_replica_id: str
    row_token_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., ar_replica_id: _Optional[str] = ..., dit_replica_id: _Optional[str] = ..., row_token_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class CreateTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ReserveTicketRequest(_message.Message):
    __slots__ = ("ticket_id", "ar_replica_id", "incarnation_id")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    AR_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    ar_replica_id: str
    incarnation_id: str
    def __init__(self, ticket_id: _Optional[str] = ..., ar_replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class ReserveTicketResponse(_message.Message):
    __slots__ = ("ticket", "destinations", "writes", "dit_geometry", "dit_parallelism", "dit_num_pages", "verify_checksums")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    DIT_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    DIT_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    DIT_NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    destinations: _containers.RepeatedCompositeFieldContainer[_common_pb2.MemoryRegion]
    writes: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlannedWrite]
    dit_geometry: _common_pb2.KvGeometry
    dit_parallelism: _common_pb2.Parallelism
    dit_num_pages: int
    verify_checksums: bool
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ..., destinations: _Optional[_Iterable[_Union[_common_pb2.MemoryRegion, _Mapping]]] = ..., writes: _Optional[_Iterable[_Union[_common_pb2.PlannedWrite, _Mapping]]] = ..., dit_geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ..., dit_parallelism: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., dit_num_pages: _Optional[int] = ..., verify_checksums: bool = ...) -> None: ...

class ReportWriteRequest(_message.Message):
    __slots__ = ("ticket_id", "row", "src_rank", "dst_rank", "replica_id", "incarnation_id", "status", "checksum", "bytes", "message", "writes")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    row: int
    src_rank: int
    dst_rank: int
    replica_id: str
    incarnation_id: str
    status: _common_pb2.WriteStatus
    checksum: int
    bytes: int
    message: str
    writes: _containers.RepeatedCompositeFieldContainer[WriteReport]
    def __init__(self, ticket_id: _Optional[str] = ..., row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.WriteStatus, str]] = ..., checksum: _Optional[int] = ..., bytes: _Optional[int] = ..., message: _Optional[str] = ..., writes: _Optional[_Iterable[_Union[WriteReport, _Mapping]]] = ...) -> None: ...

class WriteReport(_message.Message):
    __slots__ = ("row", "src_rank", "dst_rank", "status", "checksum", "bytes", "message")
    ROW_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    row: int
    src_rank: int
    dst_rank: int
    status: _common_pb2.WriteStatus
    checksum: int
    bytes: int
    message: str
    def __init__(self, row: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.WriteStatus, str]] = ..., checksum: _Optional[int] = ..., bytes: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReportWriteResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ReportLoadRequest(_message.Message):
    __slots__ = ("ticket_id", "row", "dst_rank", "replica_id", "incarnation_id", "verified", "loads")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    row: int
    dst_rank: int
    replica_id: str
    incarnation_id: str
    verified: _containers.RepeatedCompositeFieldContainer[WriteProgress]
    loads: _containers.RepeatedCompositeFieldContainer[LoadReport]
    def __init__(self, ticket_id: _Optional[str] = ..., row: _Optional[int] = ..., dst_rank: _Optional[int] = ..., replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., verified: _Optional[_Iterable[_Union[WriteProgress, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[LoadReport, _Mapping]]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("row", "dst_rank", "verified")
    ROW_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    row: int
    dst_rank: int
    verified: _containers.RepeatedCompositeFieldContainer[WriteProgress]
    def __init__(self, row: _Optional[int] = ..., dst_rank: _Optional[int] = ..., verified: _Optional[_Iterable[_Union[WriteProgress, _Mapping]]] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class TicketPlan(_message.Message):
    __slots__ = ("ticket", "writes", "destinations", "dit_geometry", "dit_parallelism", "dit_num_pages", "verify_checksums", "src_shards")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    DIT_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    DIT_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    DIT_NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SRC_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    writes: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlannedWrite]
    destinations: _containers.RepeatedCompositeFieldContainer[_common_pb2.MemoryRegion]
    dit_geometry: _common_pb2.KvGeometry
    dit_parallelism: _common_pb2.Parallelism
    dit_num_pages: int
    verify_checksums: bool
    src_shards: int
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ..., writes: _Optional[_Iterable[_Union[_common_pb2.PlannedWrite, _Mapping]]] = ..., destinations: _Optional[_Iterable[_Union[_common_pb2.MemoryRegion, _Mapping]]] = ..., dit_geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ..., dit_parallelism: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., dit_num_pages: _Optional[int] = ..., verify_checksums: bool = ..., src_shards: _Optional[int] = ...) -> None: ...

class StartConsumingRequest(_message.Message):
    __slots__ = ("ticket_id", "replica_id", "incarnation_id")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    replica_id: str
    incarnation_id: str
    def __init__(self, ticket_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class StartConsumingResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ReleaseTicketRequest(_message.Message):
    __slots__ = ("ticket_id", "outcome", "reason", "replica_id", "incarnation_id")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    outcome: TicketOutcome
    reason: str
    replica_id: str
    incarnation_id: str
    def __init__(self, ticket_id: _Optional[str] = ..., outcome: _Optional[_Union[TicketOutcome, str]] = ..., reason: _Optional[str] = ..., replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class ReleaseTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class CancelTicketRequest(_message.Message):
    __slots__ = ("ticket_id", "outcome", "reason")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    outcome: TicketOutcome
    reason: str
    def __init__(self, ticket_id: _Optional[str] = ..., outcome: _Optional[_Union[TicketOutcome, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class GetTicketRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class GetTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class WatchTicketRequest(_message.Message):
    __slots__ = ("ticket_id",)
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    ticket_id: str
    def __init__(self, ticket_id: _Optional[str] = ...) -> None: ...

class WatchTicketResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class ListTicketsRequest(_message.Message):
    __slots__ = ("states", "replica_id")
    STATES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[TicketState]
    replica_id: str
    def __init__(self, states: _Optional[_Iterable[_Union[TicketState, str]]] = ..., replica_id: _Optional[str] = ...) -> None: ...

class ListTicketsResponse(_message.Message):
    __slots__ = ("tickets",)
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    tickets: _containers.RepeatedCompositeFieldContainer[Ticket]
    def __init__(self, tickets: _Optional[_Iterable[_Union[Ticket, _Mapping]]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("replica_id", "total_pages", "free_pages", "reserved_pages", "draining_pages", "fenced", "up", "available_pages")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_PAGES_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    total_pages: int
    free_pages: int
    reserved_pages: int
    draining_pages: int
    fenced: bool
    up: bool
    available_pages: int
    def __init__(self, replica_id: _Optional[str] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., draining_pages: _Optional[int] = ..., fenced: bool = ..., up: bool = ..., available_pages: _Optional[int] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "forgotten_incarnations", "replica_authentication", "credential_refusals", "credential_grace_seconds")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_AUTHENTICATION_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    forgotten_incarnations: _containers.RepeatedCompositeFieldContainer[ForgottenIncarnation]
    replica_authentication: str
    credential_refusals: _containers.RepeatedCompositeFieldContainer[CredentialRefusal]
    credential_grace_seconds: float
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., forgotten_incarnations: _Optional[_Iterable[_Union[ForgottenIncarnation, _Mapping]]] = ..., replica_authentication: _Optional[str] = ..., credential_refusals: _Optional[_Iterable[_Union[CredentialRefusal, _Mapping]]] = ..., credential_grace_seconds: _Optional[float] = ...) -> None: ...

class CredentialRefusal(_message.Message):
    __slots__ = ("replica_id", "reason", "method", "refusals", "first_refusal_time", "last_refusal_time")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    FIRST_REFUSAL_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_TIME_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    reason: str
    method: str
    refusals: int
    first_refusal_time: _timestamp_pb2.Timestamp
    last_refusal_time: _timestamp_pb2.Timestamp
    def __init__(self, replica_id: _Optional[str] = ..., reason: _Optional[str] = ..., method: _Optional[str] = ..., refusals: _Optional[int] = ..., first_refusal_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., last_refusal_time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ForgottenIncarnation(_message.Message):
    __slots__ = ("replica_id", "incarnation_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation_id: str
    def __init__(self, replica_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class ForgetReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "force")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    force: bool
    def __init__(self, replica_id: _Optional[str] = ..., force: bool = ...) -> None: ...

class ForgetReplicaResponse(_message.Message):
    __slots__ = ("ended_ticket_ids",)
    ENDED_TICKET_IDS_FIELD_NUMBER: _ClassVar[int]
    ended_ticket_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ended_ticket_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReloadCredentialsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CredentialSourceReload(_message.Message):
    __slots__ = ("key", "source", "state")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: str
    state: str
    def __init__(self, key: _Optional[str] = ..., source: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class ReloadCredentialsResponse(_message.Message):
    __slots__ = ("sources", "rotated", "grace_seconds", "error")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ROTATED_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[CredentialSourceReload]
    rotated: bool
    grace_seconds: float
    error: str
    def __init__(self, sources: _Optional[_Iterable[_Union[CredentialSourceReload, _Mapping]]] = ..., rotated: bool = ..., grace_seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...
