"""Public value types of the SDK: frozen dataclasses and IntEnums, never protobuf messages.

Owns the mapping from `kvrelay.v1` messages to these types (`*_from_pb`, private to the SDK).
The proto is the one definition of every enum: each public IntEnum takes its members' numbers
from the generated stubs and is checked at import to have exactly the proto enum's members, so
`GenerationState(pb.state)` is the whole conversion; an unknown future value (a newer server)
decodes to `UNSPECIFIED` rather than failing an old client.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any, TypeVar

from kvrelay.v1 import broker_pb2, common_pb2, generation_pb2

_E = TypeVar("_E", bound=IntEnum)


class GenerationState(IntEnum):
    """Where a generation is (DESIGN.md section 7): `kvrelay.v1.GenerationState`."""

    UNSPECIFIED = generation_pb2.GENERATION_STATE_UNSPECIFIED
    QUEUED = generation_pb2.GENERATION_STATE_QUEUED
    PREFILLING = generation_pb2.GENERATION_STATE_PREFILLING
    TRANSFERRING = generation_pb2.GENERATION_STATE_TRANSFERRING
    DENOISING = generation_pb2.GENERATION_STATE_DENOISING
    SUCCEEDED = generation_pb2.GENERATION_STATE_SUCCEEDED
    FAILED = generation_pb2.GENERATION_STATE_FAILED
    CANCELLED = generation_pb2.GENERATION_STATE_CANCELLED

    @property
    def is_terminal(self) -> bool:
        return self in (GenerationState.SUCCEEDED, GenerationState.FAILED, GenerationState.CANCELLED)


class TicketState(IntEnum):
    """`kvrelay.v1.TicketState`."""

    UNSPECIFIED = broker_pb2.TICKET_STATE_UNSPECIFIED
    RESERVED = broker_pb2.TICKET_STATE_RESERVED
    WRITING = broker_pb2.TICKET_STATE_WRITING
    READY = broker_pb2.TICKET_STATE_READY
    CONSUMING = broker_pb2.TICKET_STATE_CONSUMING
    DRAINING = broker_pb2.TICKET_STATE_DRAINING
    RELEASED = broker_pb2.TICKET_STATE_RELEASED


class TicketOutcome(IntEnum):
    """`kvrelay.v1.TicketOutcome`."""

    UNSPECIFIED = broker_pb2.TICKET_OUTCOME_UNSPECIFIED
    OK = broker_pb2.TICKET_OUTCOME_OK
    CANCELLED = broker_pb2.TICKET_OUTCOME_CANCELLED
    TIMED_OUT = broker_pb2.TICKET_OUTCOME_TIMED_OUT
    FAILED = broker_pb2.TICKET_OUTCOME_FAILED


class ReplicaRole(IntEnum):
    """`kvrelay.v1.ReplicaRole`."""

    UNSPECIFIED = common_pb2.REPLICA_ROLE_UNSPECIFIED
    AR = common_pb2.REPLICA_ROLE_AR
    DIT = common_pb2.REPLICA_ROLE_DIT


class TransportKind(IntEnum):
    """`kvrelay.v1.TransportKind`."""

    UNSPECIFIED = common_pb2.TRANSPORT_KIND_UNSPECIFIED
    MOONCAKE = common_pb2.TRANSPORT_KIND_MOONCAKE
    GRPC_STREAM = common_pb2.TRANSPORT_KIND_GRPC_STREAM
    CUDA_IPC = common_pb2.TRANSPORT_KIND_CUDA_IPC


class WriteStatus(IntEnum):
    """`kvrelay.v1.WriteStatus`."""

    UNSPECIFIED = common_pb2.WRITE_STATUS_UNSPECIFIED
    OK = common_pb2.WRITE_STATUS_OK
    FAILED = common_pb2.WRITE_STATUS_FAILED
    NOT_STARTED = common_pb2.WRITE_STATUS_NOT_STARTED
    WRITER_GONE = common_pb2.WRITE_STATUS_WRITER_GONE
    IN_DOUBT = common_pb2.WRITE_STATUS_IN_DOUBT


# (public enum, its proto enum, the proto's name prefix): each public enum is its proto enum.
MIRRORS: tuple[tuple[type[IntEnum], Any, str], ...] = (
    (GenerationState, generation_pb2.GenerationState, "GENERATION_STATE_"),
    (TicketState, broker_pb2.TicketState, "TICKET_STATE_"),
    (TicketOutcome, broker_pb2.TicketOutcome, "TICKET_OUTCOME_"),
    (ReplicaRole, common_pb2.ReplicaRole, "REPLICA_ROLE_"),
    (TransportKind, common_pb2.TransportKind, "TRANSPORT_KIND_"),
    (WriteStatus, common_pb2.WriteStatus, "WRITE_STATUS_"),
)


def check_mirrors(mirrors: tuple[tuple[type[IntEnum], Any, str], ...] = MIRRORS) -> None:
    """Each public enum has exactly its proto enum's members (names without the prefix, numbers
    from the stubs): a value added to a .proto fails this import, naming the member to add."""
    for kind, proto, prefix in mirrors:
        wire = {name.removeprefix(prefix): number for name, number in proto.items()}
        mine = {member.name: member.value for member in kind}
        if mine != wire:
            missing = sorted(wire.keys() - mine.keys())
            extra = sorted(mine.keys() - wire.keys())
            raise ImportError(
                f"{kind.__name__} differs from {proto.DESCRIPTOR.full_name}: add {missing}, drop {extra}"
            )


check_mirrors()


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
    with SUCCEEDED; `error` with FAILED and CANCELLED. `attempt` is 1, or more once the broker
    ran the generation again after its replica or its KV transfer failed (state and step still
    never go back).
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
    attempt: int = 1


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
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class GenerationPage:
    """One page of `ListGenerations`: pass `next_page_token` (with the same states) for the next
    one; "" when there are no more. May hold fewer than the page size, even none, while a token
    is set (the reply stays below 4 MiB; a filtered page looks at a bounded number)."""

    generations: list[Generation]
    next_page_token: str


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
    num_pages: int  # per rank (a CFG-parallel DiT has this many in each CFG group)
    max_tokens: int
    geometry: KvGeometry | None
    up: bool
    fenced: bool
    lease_expire_time: _dt.datetime | None
    # CFG-parallel DiT: groups of tp * sp ranks, group g computing CFG row g (1 = none).
    cfg_parallel_size: int = 1
    # DiT: the largest image width or height its model generates (0 = only the API's bound).
    max_image_side: int = 0


@dataclass(frozen=True, slots=True)
class ForgottenIncarnation:
    """An incarnation forgotten by `forget_replica` with `force=True`, which the broker refuses:
    if that process comes back (it was cut off, not gone), its registration is answered fenced and
    it fails stop; a new incarnation of `replica_id` (a restart) registers normally. Journaled."""

    replica_id: str
    incarnation_id: str


@dataclass(frozen=True, slots=True)
class CredentialRefusal:
    """A replica id whose calls the broker refuses for their credential (`reason`
    `REPLICA_TOKEN_MISMATCH`: a token of a rotated replica secret or another id's; or
    `UNAUTHENTICATED`), since the broker started or since that id last authenticated: that replica
    is down until it holds the token `kvrelay token ID` prints (written into its token file, which it
    re-reads while refused; else a restart with it). `method`: the last refused RPC."""

    replica_id: str
    reason: str
    method: str
    refusals: int
    first_refusal_time: _dt.datetime | None
    last_refusal_time: _dt.datetime | None


@dataclass(frozen=True, slots=True)
class CredentialSourceReload:
    """One credential of the broker as `reload_credentials` found it: `key` (`replica_secret`,
    `replica_token`, `api_token`, `operator_token`), `source` (where it comes from, e.g.
    `security.api_token_file (/run/secrets/api)`) and `state` (`reloaded`, `unchanged`,
    `not reloadable`: an environment variable, which a running broker cannot re-read; `failed`)."""

    key: str
    source: str
    state: str


@dataclass(frozen=True, slots=True)
class CredentialsReload:
    """The broker's answer to `reload_credentials`: each source, whether a new credential was
    taken (`rotated`), how long the replaced ones are still taken (`grace_seconds`), and why
    nothing was taken (`error`, "" when none)."""

    sources: list[CredentialSourceReload]
    rotated: bool
    grace_seconds: float
    error: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaRegistry:
    """The broker's registry as one `ListReplicas` answer (`kvrelay status`).

    `replica_authentication`: how the broker authenticates replicas, in words ("bound replica
    tokens", "the shared replica token", "client certificates", several joined by " or ", or
    "none (development: every caller trusted)"); "" from a broker that does not say.
    `credential_refusals`: replica ids the broker refuses for their credential, by id.
    `credential_grace_seconds`: seconds left of a credential rotation's grace (`kvrelay
    rotate-secrets`), while the replaced credentials are still taken; 0.0 when none runs."""

    replicas: list[Replica]
    forgotten_incarnations: list[ForgottenIncarnation]
    replica_authentication: str
    credential_refusals: list[CredentialRefusal] = field(default_factory=list)
    credential_grace_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """Page accounting of one DiT replica: free + reserved + draining == total.

    `up` False: the broker keeps this replica from its journal (an earlier config's, or one that
    stopped or lost its lease) but it is not live; its pages are still accounted, in-doubt ones
    held, and none is capacity a request could get. `available_pages` is what a request could be
    given now: `free_pages` of a live, unfenced replica, else 0. Sum that for capacity.
    """

    replica_id: str
    total_pages: int
    free_pages: int
    reserved_pages: int
    draining_pages: int
    fenced: bool
    up: bool = True
    available_pages: int = 0


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


# The fields a GenerationEvent and a Generation share (the proto gives both the same names).
_PROGRESS = ("request_id", "state", "step", "total_steps", "image", "timings", "error", "ticket_id", "attempt")


def _progress_from_pb(msg: generation_pb2.GenerationEvent | generation_pb2.Generation) -> dict[str, Any]:
    return {
        "request_id": msg.request_id,
        "state": _enum(GenerationState, msg.state),
        "step": msg.step,
        "total_steps": msg.total_steps,
        "image": image_from_pb(msg.image) if msg.HasField("image") else None,
        "timings": timings_from_pb(msg.timings) if msg.HasField("timings") else None,
        "error": error_status_from_pb(msg.error) if msg.HasField("error") else None,
        "ticket_id": msg.ticket_id,
        # 0: a broker that predates retries, where every generation has one attempt.
        "attempt": max(1, msg.attempt),
    }


def event_from_pb(msg: generation_pb2.GenerationEvent) -> GenerationEvent:
    return GenerationEvent(**_progress_from_pb(msg), event_time=_time(msg, "event_time"))


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
        **_progress_from_pb(msg),
        params=params_from_pb(msg.params) if msg.HasField("params") else None,
        create_time=_time(msg, "create_time"),
        update_time=_time(msg, "update_time"),
    )


def event_from_generation(gen: Generation) -> GenerationEvent:
    """The event a stream would have carried for this state (used when a stream is re-joined)."""
    return GenerationEvent(**{name: getattr(gen, name) for name in _PROGRESS}, event_time=gen.update_time)


_DTYPES = {
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_FLOAT32: "float32",
}


def credentials_reload_from_pb(msg: broker_pb2.ReloadCredentialsResponse) -> CredentialsReload:
    return CredentialsReload(
        [CredentialSourceReload(s.key, s.source, s.state) for s in msg.sources],
        msg.rotated,
        msg.grace_seconds,
        msg.error,
    )


def forgotten_incarnation_from_pb(msg: broker_pb2.ForgottenIncarnation) -> ForgottenIncarnation:
    return ForgottenIncarnation(msg.replica_id, msg.incarnation_id)


def replica_registry_from_pb(msg: broker_pb2.ListReplicasResponse) -> ReplicaRegistry:
    return ReplicaRegistry(
        [replica_from_pb(r) for r in msg.replicas],
        [forgotten_incarnation_from_pb(f) for f in msg.forgotten_incarnations],
        msg.replica_authentication,
        [
            CredentialRefusal(r.replica_id, r.reason, r.method, r.refusals, _time(r, "first_refusal_time"),
                              _time(r, "last_refusal_time"))  # fmt: skip
            for r in msg.credential_refusals
        ],
        msg.credential_grace_seconds,
    )


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
        cfg_parallel_size=par.cfg_parallel_size or 1,
        max_image_side=msg.max_image_side,
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
        up=msg.up,
        available_pages=msg.available_pages,
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
    "CredentialSourceReload",
    "CredentialsReload",
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
