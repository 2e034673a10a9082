"""Public value types of the SDK: frozen dataclasses and IntEnums, never protobuf messages.

Owns the mapping from `kvrelay.v1` messages to these types (`*_from_pb`, private to the SDK).
Enum values equal the proto's numbers, so `GenerationState(pb.state)` is the whole conversion;
an unknown future value decodes to `UNSPECIFIED` rather than failing an old client.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, TypeVar

from kvrelay.v1 import broker_pb2, common_pb2, generation_pb2

_E = TypeVar("_E", bound=IntEnum)


class GenerationState(IntEnum):
    """Where a generation is (DESIGN.md section 7); mirrors `kvrelay.v1.GenerationState`."""

    UNSPECIFIED = 0
    QUEUED = 1
    PREFILLING = 2
    TRANSFERRING = 3
    DENOISING = 4
    SUCCEEDED = 5
    FAILED = 6
    CANCELLED = 7

    @property
    def is_terminal(self) -> bool:
        return self in (GenerationState.SUCCEEDED, GenerationState.FAILED, GenerationState.CANCELLED)


class TicketState(IntEnum):
    UNSPECIFIED = 0
    RESERVED = 1
    WRITING = 2
    READY = 3
    CONSUMING = 4
    DRAINING = 5
    RELEASED = 6


class TicketOutcome(IntEnum):
    UNSPECIFIED = 0
    OK = 1
    CANCELLED = 2
    TIMED_OUT = 3
    FAILED = 4


class ReplicaRole(IntEnum):
    UNSPECIFIED = 0
    AR = 1
    DIT = 2


class TransportKind(IntEnum):
    UNSPECIFIED = 0
    MOONCAKE = 1
    GRPC_STREAM = 2
    CUDA_IPC = 3


class WriteStatus(IntEnum):
    UNSPECIFIED = 0
    OK = 1
    FAILED = 2
    NOT_STARTED = 3
    WRITER_GONE = 4


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Where the time of one request went, in seconds, measured where it happened."""

    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    transfer_seconds: float = 0.0
    load_seconds: float = 0.0
    denoise_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    # Reservation of the ticket until every row is loaded on every DiT rank.
    handoff_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Image:
    """A finished image: PNG bytes and what it was made with."""

    png: bytes
    width: int
    height: int
    seed: int


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    """Why a generation FAILED or was CANCELLED: gRPC code name, UPPER_SNAKE reason, message."""

    code: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One event of a `Generate` stream.

    `step`/`total_steps` count denoising steps (set in DENOISING); `image` and `timings` come
    with SUCCEEDED; `error` with FAILED and CANCELLED.
    """

    request_id: str
    state: GenerationState
    step: int = 0
    total_steps: int = 0
    image: Image | None = None
    timings: PhaseTimings | None = None
    error: ErrorStatus | None = None
    ticket_id: str = ""
    event_time: _dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """The outcome of a SUCCEEDED generation."""

    request_id: str
    png: bytes
    width: int
    height: int
    seed: int
    timings: PhaseTimings

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the PNG to `path` (parents are created)."""
        target = os.fspath(path)
        parent = os.path.dirname(target)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(target, "wb") as out:
            out.write(self.png)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """The resolved parameters of a generation (server defaults filled in)."""

    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float


@dataclass(frozen=True, slots=True)
class Generation:
    """A generation as the broker knows it (`GetGeneration`, `ListGenerations`, `CancelGeneration`)."""

    request_id: str
    state: GenerationState
    params: GenerationParams | None
    step: int
    total_steps: int
    image: Image | None
    timings: PhaseTimings | None
    error: ErrorStatus | None
    ticket_id: str
    create_time: _dt.datetime | None
    update_time: _dt.datetime | None


@dataclass(frozen=True, slots=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int


@dataclass(frozen=True, slots=True)
class Replica:
    """An AR or DiT replica registered with the broker."""

    replica_id: str
    role: ReplicaRole
    incarnation_id: str
    endpoint: str
    version: str
    layout_version: int
    stage_id: int
    transport: TransportKind
    tensor_parallel_size: int
    sequence_parallel_size: int
    max_num_seqs: int
    num_pages: int
    max_tokens: int
    geometry: KvGeometry | None
    up: bool
    fenced: bool
    lease_expire_time: _dt.datetime | None


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """Page accounting of one DiT replica: free + reserved + draining == total."""

    replica_id: str
    total_pages: int
    free_pages: int
    reserved_pages: int
    draining_pages: int
    fenced: bool


@dataclass(frozen=True, slots=True)
class RowPages:
    row: int
    num_tokens: int
    page_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WriteProgress:
    row: int
    src_rank: int
    dst_rank: int
    status: WriteStatus
    checksum: int
    bytes: int


@dataclass(frozen=True, slots=True)
class LoadProgress:
    row: int
    dst_rank: int
    loaded: bool


@dataclass(frozen=True, slots=True)
class Ticket:
    """A transfer ticket (DESIGN.md section 6)."""

    ticket_id: str
    request_id: str
    state: TicketState
    outcome: TicketOutcome
    ar_replica_id: str
    dit_replica_id: str
    rows: tuple[RowPages, ...]
    armed: bool
    writes: tuple[WriteProgress, ...]
    loads: tuple[LoadProgress, ...]
    reason: str
    sequence: int
    create_time: _dt.datetime | None
    update_time: _dt.datetime | None

    @property
    def num_pages(self) -> int:
        return sum(len(r.page_ids) for r in self.rows)


# ---------------------------------------------------------------------------------------------
# protobuf -> public types (private to the SDK)
# ---------------------------------------------------------------------------------------------


def _enum(kind: type[_E], value: int) -> _E:
    try:
        return kind(value)
    except ValueError:
        return kind(0)


def _time(msg: Any, field: str) -> _dt.datetime | None:
    if not msg.HasField(field):
        return None
    ts = getattr(msg, field)
    return _dt.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=_dt.UTC)


def timings_from_pb(msg: common_pb2.PhaseTimings) -> PhaseTimings:
    return PhaseTimings(
        queue_seconds=msg.queue_seconds,
        prefill_seconds=msg.prefill_seconds,
        transfer_seconds=msg.transfer_seconds,
        load_seconds=msg.load_seconds,
        denoise_seconds=msg.denoise_seconds,
        decode_seconds=msg.decode_seconds,
        total_seconds=msg.total_seconds,
        handoff_seconds=msg.handoff_seconds,
    )


def image_from_pb(msg: common_pb2.Image) -> Image:
    return Image(png=bytes(msg.png), width=msg.width, height=msg.height, seed=msg.seed)


def error_status_from_pb(msg: common_pb2.ErrorStatus) -> ErrorStatus:
    return ErrorStatus(code=msg.code, reason=msg.reason or msg.code, message=msg.message)


def event_from_pb(msg: generation_pb2.GenerationEvent) -> GenerationEvent:
    return GenerationEvent(
        request_id=msg.request_id,
        state=_enum(GenerationState, msg.state),
        step=msg.step,
        total_steps=msg.total_steps,
        image=image_from_pb(msg.image) if msg.HasField("image") else None,
        timings=timings_from_pb(msg.timings) if msg.HasField("timings") else None,
        error=error_status_from_pb(msg.error) if msg.HasField("error") else None,
        ticket_id=msg.ticket_id,
        event_time=_time(msg, "event_time"),
    )


def params_from_pb(msg: generation_pb2.GenerationParams) -> GenerationParams:
    return GenerationParams(
        prompt=msg.prompt,
        negative_prompt=msg.negative_prompt,
        seed=msg.seed,
        width=msg.width,
        height=msg.height,
        num_inference_steps=msg.num_inference_steps,
        guidance_scale=msg.guidance_scale,
    )


def generation_from_pb(msg: generation_pb2.Generation) -> Generation:
    return Generation(
        request_id=msg.request_id,
        state=_enum(GenerationState, msg.state),
        params=params_from_pb(msg.params) if msg.HasField("params") else None,
        step=msg.step,
        total_steps=msg.total_steps,
        image=image_from_pb(msg.image) if msg.HasField("image") else None,
        timings=timings_from_pb(msg.timings) if msg.HasField("timings") else None,
        error=error_status_from_pb(msg.error) if msg.HasField("error") else None,
        ticket_id=msg.ticket_id,
        create_time=_time(msg, "create_time"),
        update_time=_time(msg, "update_time"),
    )


def event_from_generation(gen: Generation) -> GenerationEvent:
    """The event a stream would have carried for this state (used when a stream is re-joined)."""
    return GenerationEvent(
        request_id=gen.request_id,
        state=gen.state,
        step=gen.step,
        total_steps=gen.total_steps,
        image=gen.image,
        timings=gen.timings,
        error=gen.error,
        ticket_id=gen.ticket_id,
        event_time=gen.update_time,
    )


_DTYPES = {
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_FLOAT32: "float32",
}


def replica_from_pb(msg: broker_pb2.ReplicaInfo) -> Replica:
    geometry = None
    if msg.HasField("geometry"):
        g = msg.geometry
        geometry = KvGeometry(
            g.num_layers, g.num_kv_heads, g.head_dim, _DTYPES.get(g.dtype, "unspecified"), g.page_size
        )
    par = msg.parallelism
    return Replica(
        replica_id=msg.replica_id,
        role=_enum(ReplicaRole, msg.role),
        incarnation_id=msg.incarnation_id,
        endpoint=msg.endpoint,
        version=msg.version,
        layout_version=msg.layout_version,
        stage_id=msg.stage_id,
        transport=_enum(TransportKind, msg.transport),
        tensor_parallel_size=par.tensor_parallel_size or 1,
        sequence_parallel_size=par.sequence_parallel_size or 1,
        max_num_seqs=msg.max_num_seqs,
        num_pages=msg.num_pages,
        max_tokens=msg.max_tokens,
        geometry=geometry,
        up=msg.up,
        fenced=msg.fenced,
        lease_expire_time=_time(msg, "lease_expire_time"),
    )


def pool_from_pb(msg: broker_pb2.PoolStatus) -> PoolStatus:
    return PoolStatus(
        replica_id=msg.replica_id,
        total_pages=msg.total_pages,
        free_pages=msg.free_pages,
        reserved_pages=msg.reserved_pages,
        draining_pages=msg.draining_pages,
        fenced=msg.fenced,
    )


def ticket_from_pb(msg: broker_pb2.Ticket) -> Ticket:
    return Ticket(
        ticket_id=msg.ticket_id,
        request_id=msg.request_id,
        state=_enum(TicketState, msg.state),
        outcome=_enum(TicketOutcome, msg.outcome),
        ar_replica_id=msg.ar_replica_id,
        dit_replica_id=msg.dit_replica_id,
        rows=tuple(RowPages(r.row, r.num_tokens, tuple(r.page_ids)) for r in msg.rows),
        armed=msg.armed,
        writes=tuple(
            WriteProgress(w.row, w.src_rank, w.dst_rank, _enum(WriteStatus, w.status), w.checksum, w.bytes)
            for w in msg.writes
        ),
        loads=tuple(LoadProgress(x.row, x.dst_rank, x.loaded) for x in msg.loads),
        reason=msg.reason,
        sequence=msg.sequence,
        create_time=_time(msg, "create_time"),
        update_time=_time(msg, "update_time"),
    )


__all__ = [
    "ErrorStatus",
    "Generation",
    "GenerationEvent",
    "GenerationParams",
    "GenerationResult",
    "GenerationState",
    "Image",
    "KvGeometry",
    "LoadProgress",
    "PhaseTimings",
    "PoolStatus",
    "Replica",
    "ReplicaRole",
    "RowPages",
    "Ticket",
    "TicketOutcome",
    "TicketState",
    "TransportKind",
    "WriteProgress",
    "WriteStatus",
]
