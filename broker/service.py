"""BrokerService: the thin grpc.aio adapter over BrokerCore (DESIGN.md section 8).

Owns the proto <-> dataclass conversions of the broker's messages and the mapping of the
core's errors to gRPC status codes with google.rpc.ErrorInfo reasons. Must never hold
lifecycle logic of its own: every decision is BrokerCore's, so the orchestrator (which calls
the core in-process) and remote replicas (which call this servicer) see the same rules.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import ipaddress
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.broker.core import Arming, BrokerCore, PoolStatus, ReceiverRun, ReportedWrite
from kvrelay.broker.credential_reload import BrokerSecrets
from kvrelay.broker.journal import JournalWriteError
from kvrelay.broker.registry import (
    MAX_ENDPOINT_CHARS,
    MAX_IPC_HANDLE_BYTES,
    MAX_REGIONS,
    MAX_VERSION_CHARS,
    MemoryRegionSpec,
    ReplicaRole,
    ReplicaSpec,
    ReplicaStatus,
    takeover_needs_probe,
)
from kvrelay.broker.tickets import (
    AlreadyExists,
    BrokerError,
    InvalidArgument,
    LoadKey,
    ResourceExhausted,
    Ticket,
    TicketOutcome,
    TicketState,
    WriteKey,
    WriteStatus,
)
from kvrelay.broker.wire import wire_enum
from kvrelay.errors import KvRelayServerError, abort_with, bounded_message
from kvrelay.security import (
    MAX_ID_CHARS,
    ChannelSecurity,
    CredentialRefusals,
    Credentials,
    current_caller,
    is_loopback,
    make_channel,
)
from kvrelay.server import incarnation_health_service
from kvrelay.transfer.convert import geometry_from_proto, geometry_to_proto, write_to_proto
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

_ROLE = wire_enum(ReplicaRole, common_pb2.ReplicaRole, "REPLICA_ROLE_")
_ROLE_FROM_PB, _ROLE_TO_PB = _ROLE.from_pb, _ROLE.to_pb
_TRANSPORT_FROM_PB = {
    common_pb2.TRANSPORT_KIND_MOONCAKE: "mooncake",
    common_pb2.TRANSPORT_KIND_GRPC_STREAM: "grpc",
    common_pb2.TRANSPORT_KIND_CUDA_IPC: "cuda_ipc",
}
_TRANSPORT_TO_PB = {v: k for k, v in _TRANSPORT_FROM_PB.items()}
# Built by name from the proto and checked both ways (broker/wire.py).
_STATE = wire_enum(TicketState, broker_pb2.TicketState, "TICKET_STATE_")
_STATE_TO_PB, _STATE_FROM_PB = _STATE.to_pb, _STATE.from_pb
_OUTCOME = wire_enum(TicketOutcome, broker_pb2.TicketOutcome, "TICKET_OUTCOME_")
_OUTCOME_TO_PB, _OUTCOME_FROM_PB = _OUTCOME.to_pb, _OUTCOME.from_pb
# PENDING (no report yet) is what the wire calls UNSPECIFIED.
_WRITE_STATUS = wire_enum(WriteStatus, common_pb2.WriteStatus, "WRITE_STATUS_", unspecified=WriteStatus.PENDING)
_WRITE_STATUS_TO_PB, _WRITE_STATUS_FROM_PB = _WRITE_STATUS.to_pb, _WRITE_STATUS.from_pb


def plan_to_proto(arming: Arming) -> broker_pb2.TicketPlan:
    """The broker's plan for a ticket, as Prefill and Denoise carry it (DESIGN.md section 7)."""
    return broker_pb2.TicketPlan(
        ticket=ticket_to_proto(arming.ticket),
        writes=[write_to_proto(w) for w in arming.writes],
        destinations=[region_to_proto(r) for r in arming.destinations],
        dit_geometry=geometry_to_proto(arming.dit_geometry),
        dit_parallelism=common_pb2.Parallelism(
            tensor_parallel_size=arming.dit_tensor_parallel_size,
            sequence_parallel_size=arming.dit_sequence_parallel_size,
            cfg_parallel_size=arming.dit_cfg_parallel_size,
        ),
        dit_num_pages=arming.dit_num_pages,
        verify_checksums=arming.verify_checksums,
        src_shards=arming.src_shards,
    )


def to_server_error(err: BrokerError | JournalWriteError) -> KvRelayServerError:
    if isinstance(err, JournalWriteError):
        # The change was not made durable, and the broker stops to recover from its journal
        # (kvrelay.broker.main): retryable once it is back.
        return KvRelayServerError(
            grpc.StatusCode.UNAVAILABLE, "JOURNAL_FAILED", f"{err}; the broker stops and recovers from its journal"
        )
    return KvRelayServerError(grpc.StatusCode[err.code], err.reason, err.message)


# ---------------------------------------------------------------- conversions


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds == seconds and abs(seconds) != float("inf"):
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def ticket_to_proto(t: Ticket) -> broker_pb2.Ticket:
    return broker_pb2.Ticket(
        ticket_id=t.ticket_id,
        request_id=t.request_id,
        state=_STATE_TO_PB[t.state],
        outcome=_OUTCOME_TO_PB[t.outcome] if t.outcome else broker_pb2.TICKET_OUTCOME_UNSPECIFIED,
        ar_replica_id=t.ar_replica_id,
        dit_replica_id=t.dit_replica_id,
        rows=[common_pb2.RowPages(row=r.row, num_tokens=r.num_tokens, page_ids=list(r.page_ids)) for r in t.rows],
        armed=t.armed,
        writes=[
            broker_pb2.WriteProgress(
                row=w.key.row,
                src_rank=w.key.src_rank,
                dst_rank=w.key.dst_rank,
                status=_WRITE_STATUS_TO_PB[w.status],
                checksum=w.checksum,
                bytes=w.bytes,
            )
            for w in t.writes
        ],
        loads=[broker_pb2.LoadProgress(row=ld.key.row, dst_rank=ld.key.dst_rank, loaded=ld.loaded) for ld in t.loads],
        reason=t.reason,
        create_time=_timestamp(t.create_time),
        update_time=_timestamp(t.update_time),
        sequence=t.sequence,
    )


def _too_long(field: str, size: int, limit: int, unit: str = "characters") -> InvalidArgument:
    return InvalidArgument("FIELD_TOO_LONG", f"{field}: {size} {unit}, at most {limit}")


def check_replica_lengths(pb: broker_pb2.ReplicaInfo) -> None:
    """The strings and regions a registration carries are bounded (registry.MAX_*), before anything
    is kept or dialled: INVALID_ARGUMENT FIELD_TOO_LONG naming the field."""
    if len(pb.version) > MAX_VERSION_CHARS:
        raise _too_long("replica.version", len(pb.version), MAX_VERSION_CHARS)
    if len(pb.endpoint) > MAX_ENDPOINT_CHARS:
        raise _too_long("replica.endpoint", len(pb.endpoint), MAX_ENDPOINT_CHARS)
    if len(pb.regions) > MAX_REGIONS:
        raise _too_long("replica.regions", len(pb.regions), MAX_REGIONS, "regions")
    for i, r in enumerate(pb.regions):
        if len(r.endpoint) > MAX_ENDPOINT_CHARS:
            raise _too_long(f"replica.regions[{i}].endpoint", len(r.endpoint), MAX_ENDPOINT_CHARS)
        if len(r.ipc_handle) > MAX_IPC_HANDLE_BYTES:
            raise _too_long(f"replica.regions[{i}].ipc_handle", len(r.ipc_handle), MAX_IPC_HANDLE_BYTES, "bytes")


def check_listed_ids(request: broker_pb2.RegisterReplicaRequest | broker_pb2.HeartbeatRequest) -> None:
    """Every ticket id a replica lists is an id (at most MAX_ID_CHARS; the interceptor looks at
    the first 64 entries of a repeated message only), and a DiT owes one release per ticket: two
    with one id leave which outcome to record to chance (INVALID_ARGUMENT DUPLICATE_ENTRY)."""
    for i, key in enumerate(request.unresolved_writes):
        if len(key.ticket_id) > MAX_ID_CHARS:
            raise _too_long(f"unresolved_writes[{i}].ticket_id", len(key.ticket_id), MAX_ID_CHARS)
    if not isinstance(request, broker_pb2.RegisterReplicaRequest):
        return
    for i, ticket_id in enumerate(request.held_ticket_ids):
        if len(ticket_id) > MAX_ID_CHARS:
            raise _too_long(f"held_ticket_ids[{i}]", len(ticket_id), MAX_ID_CHARS)
    owed: set[str] = set()
    for i, o in enumerate(request.owed_releases):
        if len(o.ticket_id) > MAX_ID_CHARS:
            raise _too_long(f"owed_releases[{i}].ticket_id", len(o.ticket_id), MAX_ID_CHARS)
        if o.ticket_id in owed:
            raise InvalidArgument(
                "DUPLICATE_ENTRY", f"owed_releases[{i}].ticket_id: {o.ticket_id!r} is listed twice (one release a ticket)"
            )
        owed.add(o.ticket_id)


def spec_from_proto(pb: broker_pb2.ReplicaInfo) -> ReplicaSpec:
    check_replica_lengths(pb)
    role = _ROLE_FROM_PB.get(pb.role)
    if role is None:
        raise InvalidArgument("INVALID_ARGUMENT", "replica.role: must be REPLICA_ROLE_AR or REPLICA_ROLE_DIT")
    geometry_pb = pb.geometry
    if role is ReplicaRole.AR and geometry_pb.page_size == 0:
        # page_size is the DiT's alone; an AR may leave it unset.
        geometry_pb = common_pb2.KvGeometry()
        geometry_pb.CopyFrom(pb.geometry)
        geometry_pb.page_size = 1
    try:
        geometry = geometry_from_proto(geometry_pb)
    except ValueError as err:
        raise InvalidArgument("INVALID_ARGUMENT", f"replica.geometry: {err}") from None
    regions = []
    for r in pb.regions:
        transport = _TRANSPORT_FROM_PB.get(r.transport)
        if transport is None:
            raise InvalidArgument("INVALID_ARGUMENT", f"replica.regions[{r.rank}].transport: unspecified")
        regions.append(MemoryRegionSpec(r.rank, transport, r.endpoint, r.base_address, r.length, r.ipc_handle))
    return ReplicaSpec(
        replica_id=pb.replica_id,
        role=role,
        incarnation_id=pb.incarnation_id,
        layout_version=pb.layout_version,
        version=pb.version,
        endpoint=pb.endpoint,
        geometry=geometry,
        # proto3 zero = unset = no parallelism along that axis.
        tensor_parallel_size=pb.parallelism.tensor_parallel_size or 1,
        sequence_parallel_size=pb.parallelism.sequence_parallel_size or 1,
        cfg_parallel_size=pb.parallelism.cfg_parallel_size or 1,
        regions=tuple(sorted(regions, key=lambda r: r.rank)),
        num_pages=pb.num_pages,
        max_tokens=pb.max_tokens,
        transport=_TRANSPORT_FROM_PB.get(pb.transport, "mooncake"),
        stage_id=pb.stage_id,
        max_num_seqs=pb.max_num_seqs or 1,
        max_image_side=pb.max_image_side,
    )


def region_to_proto(r: MemoryRegionSpec) -> common_pb2.MemoryRegion:
    return common_pb2.MemoryRegion(
        rank=r.rank,
        transport=_TRANSPORT_TO_PB[r.transport],
        endpoint=r.endpoint,
        base_address=r.base_address,
        length=r.length,
        ipc_handle=r.ipc_handle,
    )


def replica_to_proto(s: ReplicaStatus) -> broker_pb2.ReplicaInfo:
    spec = s.spec
    return broker_pb2.ReplicaInfo(
        replica_id=spec.replica_id,
        role=_ROLE_TO_PB[spec.role],
        incarnation_id=spec.incarnation_id,
        layout_version=spec.layout_version,
        version=spec.version,
        endpoint=spec.endpoint,
        regions=[region_to_proto(r) for r in spec.regions],
        geometry=geometry_to_proto(spec.geometry),
        parallelism=common_pb2.Parallelism(
            tensor_parallel_size=spec.tensor_parallel_size, sequence_parallel_size=spec.sequence_parallel_size,
            cfg_parallel_size=spec.cfg_parallel_size,
        ),
        num_pages=spec.num_pages,
        max_tokens=spec.max_tokens,
        transport=_TRANSPORT_TO_PB.get(spec.transport, common_pb2.TRANSPORT_KIND_UNSPECIFIED),
        stage_id=spec.stage_id,
        max_num_seqs=spec.max_num_seqs,
        max_image_side=spec.max_image_side,
        up=s.up,
        fenced=s.fenced,
        # None (unset) for a replica restored from the journal that has not registered again:
        # its lease is -inf, which has no timestamp (an empty one read as 1970 in `kvrelay status`).
        lease_expire_time=_timestamp(s.lease_expire_time) if math.isfinite(s.lease_expire_time) else None,
    )


def pool_to_proto(p: PoolStatus) -> broker_pb2.PoolStatus:
    return broker_pb2.PoolStatus(
        replica_id=p.replica_id,
        total_pages=p.total,
        free_pages=p.free,
        reserved_pages=p.reserved,
        draining_pages=p.draining,
        fenced=p.fenced,
        up=p.up,
        available_pages=p.available,
    )


def _write_key(pb: common_pb2.WriteKey) -> tuple[str, WriteKey]:
    return pb.ticket_id, WriteKey(pb.row, pb.src_rank, pb.dst_rank)


# ------------------------------------------------------------------ servicer

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


def _peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a grpc peer string (`ipv4:10.0.0.2:5000`, `ipv6:[::ffff:10.0.0.2]:5000`), or None
    (a unix socket, anything else)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` is an address of this host (loopback, or one a socket can bind)."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def loopback_endpoint_problem(
    spec: ReplicaSpec, peer: str, is_local: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool] | None = None
) -> str:
    """Why a registration from `peer` cannot be reached where it says, or "" when it may be.

    A replica on another host that advertises a loopback address (its stage's `advertise_host`
    left at 127.0.0.1 while `--host` or the network put it elsewhere) would have the broker call
    the broker's own host, and ARs write KV into their own host's loopback: every request placed
    on it fails (or reaches whatever listens there). Only provable cases are refused: a peer
    address of this host (loopback or not) or an endpoint given as a name passes."""
    ip = _peer_ip(peer)
    if ip is None or (is_local or is_local_address)(ip):
        return ""
    named = [("replica.endpoint", spec.endpoint)] + [
        (f"replica.regions[{r.rank}].endpoint", r.endpoint) for r in spec.regions if r.endpoint
    ]
    for field_name, endpoint in named:
        host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
        if is_loopback(host):  # a name other than localhost: resolvers may differ, nothing to prove
            return (
                f"{field_name}: {spec.replica_id} advertises {endpoint}, a loopback address, but registered "
                f"from {ip}, another host: set its stage's advertise_host to an address the broker and "
                "the other replicas reach (docs/operations.md, Ports)"
            )
    return ""


# How long RegisterReplica waits for a replica's advertised endpoint to answer: well inside the
# replicas' own RegisterReplica deadline (5 s), long enough for a connect across a LAN.
ENDPOINT_PROBE_TIMEOUT_S = 3.0

_NEVER_GOT_THROUGH = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)
# Probes an advertised gRPC endpoint from the broker: "" when it answered, else why not.
EndpointProbe = Callable[[str], Awaitable[str]]


def grpc_endpoint_probe(
    security: ChannelSecurity | Callable[[], ChannelSecurity] | None = None, timeout_s: float = ENDPOINT_PROBE_TIMEOUT_S
) -> EndpointProbe:
    """A probe that dials an endpoint as the orchestrator will (same TLS, same credentials) and
    asks grpc.health.v1 once. Any answer proves the address reaches a gRPC server, whatever it
    says (a replica registers before it reports SERVING); only a call that never got through
    is a problem: UNAVAILABLE, DEADLINE_EXCEEDED, or UNKNOWN (gRPC's answer for a target it
    cannot even build a channel to, such as an empty one; the health service never raises).
    `security` may be a callable, asked at each probe: the broker's TLS client certificate changes
    with `kvrelay rotate-secrets`."""

    async def probe(endpoint: str) -> str:
        try:
            channel = make_channel(endpoint, security() if callable(security) else security,
                                   options=[("grpc.use_local_subchannel_pool", 1)])  # fmt: skip
        except (ValueError, TypeError) as err:
            return f"not a gRPC target: {err}"
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() in _NEVER_GOT_THROUGH:
                return f"{err.code().name}: {err.details()}"
        finally:
            await channel.close()
        return ""

    return probe


# How long RegisterReplica waits for the registered incarnation of a replica id to answer before a
# new one takes the id (grpc_incarnation_probe): a live process answers a health check within
# milliseconds; one that does not within this is taken over, as a stopped (SIGSTOP) or cut-off one
# is. Short, as it delays that takeover, and run beside the endpoint probe: together they stay
# well inside the replicas' RegisterReplica deadline (5 s).
INCARNATION_PROBE_TIMEOUT_S = 1.5
# Asks the process at an endpoint whether it is the given incarnation: True only when it says so.
IncarnationProbe = Callable[[str, str], Awaitable[bool]]


def grpc_incarnation_probe(
    security: ChannelSecurity | Callable[[], ChannelSecurity] | None = None, timeout_s: float = INCARNATION_PROBE_TIMEOUT_S
) -> IncarnationProbe:
    """A probe that asks grpc.health.v1 at `endpoint` for the service of `incarnation_id`
    (kvrelay.server.incarnation_health_service), which only that incarnation's process serves:
    any status is proof that it is alive; NOT_FOUND (another process there, such as the restarted
    one on the same port), no answer within `timeout_s`, or no connection is not."""

    async def probe(endpoint: str, incarnation_id: str) -> bool:
        try:
            channel = make_channel(endpoint, security() if callable(security) else security,
                                   options=[("grpc.use_local_subchannel_pool", 1)])  # fmt: skip
        except (ValueError, TypeError):
            return False
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=incarnation_health_service(incarnation_id)), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close()
        return True

    return probe


async def unreachable_endpoint_problem(spec: ReplicaSpec, peer: str, probe: EndpointProbe) -> str:
    """Why the broker cannot reach `spec.endpoint`, where it will call the replica, or "".

    A replica whose `advertise_host` no one reaches (a typo, another interface, a NAT's inside
    address) registered, showed UP, and every request placed on it failed `REPLICA_UNAVAILABLE`:
    each failure kept it out of placement only until its next heartbeat, so a share of all
    requests failed for as long as it ran (found with network namespaces). A replica on this
    host advertising loopback is not dialled (tests register endpoints nobody serves; `kvrelay
    up` checks its own children)."""
    host = spec.endpoint.rsplit(":", 1)[0] if ":" in spec.endpoint else spec.endpoint
    ip = _peer_ip(peer)
    if is_loopback(host) and (ip is None or is_local_address(ip)):
        return ""
    problem = await probe(spec.endpoint)
    if not problem:
        return ""
    return (
        f"replica.endpoint: {spec.replica_id} advertises {spec.endpoint}, which the broker cannot reach "
        f"({problem}): set its stage's advertise_host (or --advertise-host) to an address of its host that the "
        "broker and the other replicas reach, listen on it (the stage's host or --host) and let them through "
        "any firewall (docs/operations.md, Across hosts)"
    )


async def revealable(core: BrokerCore, context: grpc.aio.ServicerContext, through: int | None = None) -> None:
    """Wait until the journal commits a reply reveals are durable, before it leaves (group commit:
    the core's commits are queued; docs/broker.md, Journal and restart): commit `through` and
    those before it (`BrokerCore.commit_behind` of what the reply shows), or None, every commit
    made so far. A failed journal answers UNAVAILABLE JOURNAL_FAILED instead."""
    try:
        if through is None:
            await core.journal.durable()
        else:
            await core.journal.durable_through(through)
    except JournalWriteError as err:
        await abort_with(context, to_server_error(err))


class _Reveals:
    """What one RPC's reply reveals of the journal: None (the default) is every commit made before
    it leaves; a handler that changes nothing narrows it with `reveals_only`."""

    __slots__ = ("through",)

    def __init__(self) -> None:
        self.through: int | None = None


_REVEALS: contextvars.ContextVar[_Reveals | None] = contextvars.ContextVar("kvrelay_broker_reveals", default=None)


def reveals_only(through: int) -> None:
    """Called by a `_maps_errors` handler that changed nothing: its reply shows no state newer than
    journal commit `through` (`BrokerCore.commit_behind` of the objects it read), so it waits for
    that commit and not for unrelated ones queued before it (a Heartbeat behind other requests'
    tickets). A handler that committed anything waits for everything regardless (its own commit
    is the newest), and so does any refusal."""
    reveals = _REVEALS.get()
    assert reveals is not None, "reveals_only outside a _maps_errors handler"
    reveals.through = through if reveals.through is None else max(reveals.through, through)


def _maps_errors(fn: _Handler[_Req, _Resp]) -> _Handler[_Req, _Resp]:
    @functools.wraps(fn)
    async def handler(self: Any, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        self.rpc_counts[fn.__name__] += 1
        journal = self.core.journal
        before = journal.submitted
        reveals = _Reveals()
        token = _REVEALS.set(reveals)
        try:
            reply = await fn(self, request, context)
        except (BrokerError, JournalWriteError) as err:
            # A refusal reveals state too (a fence it committed, a ticket's state).
            await revealable(self.core, context)
            await abort_with(context, to_server_error(err))
        except asyncio.CancelledError:
            raise
        except Exception:
            await revealable(self.core, context)
            raise
        finally:
            _REVEALS.reset(token)
        # A commit made meanwhile (the handler's own, or another task's while it awaited): wait for
        # everything, as that commit is newer than whatever the reply read.
        narrowed = reveals.through is not None and journal.submitted == before
        await revealable(self.core, context, reveals.through if narrowed else None)
        return reply

    return handler


# WatchTicket streams the broker holds at once, per calling replica and in all. Each held ~25 KB of
# the broker and a waiter in the core for as long as its caller kept it, with no bound: a holder of
# the replica token could open them by the thousand. A DiT opens one per request it serves (the
# AR none), so the bound per replica stays well above any stage's max_num_seqs (broker.max_watch_streams*).
MAX_WATCH_STREAMS = 2048
MAX_WATCH_STREAMS_PER_REPLICA = 256


class WatchStreamLimits:
    """Counts the open WatchTicket streams by the caller's replica id (None: an operator, or an
    undeclared caller of a development deployment, counted together) and refuses one beyond either
    bound with RESOURCE_EXHAUSTED TOO_MANY_STREAMS. Every `open` that returned is paired with one
    `close` (the handler's `finally`)."""

    def __init__(self, total: int = MAX_WATCH_STREAMS, per_replica: int = MAX_WATCH_STREAMS_PER_REPLICA) -> None:
        self.total = total
        self.per_replica = per_replica
        self._open: collections.Counter[str | None] = collections.Counter()

    def open_streams(self, replica_id: str | None = None) -> int:
        return self._open[replica_id]

    def open(self, replica_id: str | None) -> None:
        held = sum(self._open.values())
        if held >= self.total:
            raise ResourceExhausted(
                "TOO_MANY_STREAMS",
                f"WatchTicket: the broker already holds {held} WatchTicket streams (at most {self.total}, "
                "broker.max_watch_streams); retry later, or poll with GetTicket",
            )
        if self._open[replica_id] >= self.per_replica:
            raise ResourceExhausted(
                "TOO_MANY_STREAMS",
                f"WatchTicket: {replica_id or 'this caller'} already holds {self._open[replica_id]} WatchTicket streams "
                f"(at most {self.per_replica} per replica, broker.max_watch_streams_per_replica); end one, or poll "
                "with GetTicket",
            )
        self._open[replica_id] += 1

    def close(self, replica_id: str | None) -> None:
        self._open[replica_id] -= 1
        if self._open[replica_id] <= 0:
            del self._open[replica_id]


def replica_authentication(creds: Credentials) -> str:
    """How `creds` authenticate replicas, in words (ListReplicas, `kvrelay status`): what an
    operator checks after turning on bound tokens or certificates. Says nothing of any secret."""
    if not creds.authenticates_replicas:
        return "none (development: every caller trusted)"
    ways = []
    if creds.bound_replica_tokens:
        ways.append("bound replica tokens")
    elif creds.replica_token:
        ways.append("the shared replica token")
    if creds.tls is not None and creds.tls.require_client_cert:
        ways.append("client certificates")
    return " or ".join(ways)


class BrokerServicer(broker_pb2_grpc.BrokerServiceServicer):
    """Every BrokerService RPC, each one call into BrokerCore."""

    def __init__(
        self,
        core: BrokerCore,
        rpc_ticket_ttl_seconds: float = 600.0,
        endpoint_probe: EndpointProbe | None = None,
        *,
        incarnation_probe: IncarnationProbe | None = None,
        max_watch_streams: int = MAX_WATCH_STREAMS,
        max_watch_streams_per_replica: int = MAX_WATCH_STREAMS_PER_REPLICA,
        replica_authentication: str = "",
        credential_refusals: CredentialRefusals | None = None,
        secrets: BrokerSecrets | None = None,
        generation_state: Callable[[str], str | None] | None = None,
    ) -> None:
        self.core = core
        # The state of the generation a request id names (live, or finished and still held), None
        # when it names none: CreateTicket refuses a generation's id (None: a test's servicer, no
        # generations).
        self.generation_state = generation_state or (lambda _request_id: None)
        # The broker's credentials, reloadable (ReloadCredentials); None: a test's servicer,
        # which answers FAILED_PRECONDITION.
        self.secrets = secrets
        # The broker server's record of replicas it refuses (ListReplicas shows it to operators).
        self.credential_refusals = credential_refusals or CredentialRefusals()
        # Shown to the operator by ListReplicas ("" where nobody said: a test's servicer).
        self.replica_authentication = replica_authentication
        self.watch_streams = WatchStreamLimits(max_watch_streams, max_watch_streams_per_replica)
        # Dials a registering replica's advertised endpoint (unreachable_endpoint_problem).
        self.endpoint_probe = endpoint_probe or grpc_endpoint_probe()
        # Asks a registered incarnation whether it is alive before a new one takes its id.
        self.incarnation_probe = incarnation_probe or grpc_incarnation_probe()
        # Calls by method since start: broker round trips per request are read off these
        # (`kvrelay_broker_rpcs_total{method}`, exported by broker/metrics.py).
        self.rpc_counts: collections.Counter[str] = collections.Counter()
        # Tickets made over CreateTicket (debugging) have no orchestrator to end them: they end
        # TIMED_OUT after this long, as the orchestrator ends a request at its deadline.
        self.rpc_ticket_ttl_seconds = rpc_ticket_ttl_seconds
        self._expiries: dict[str, asyncio.TimerHandle] = {}

    def _expire_later(self, ticket_id: str) -> None:
        if ticket_id in self._expiries:
            return

        def expire() -> None:
            self._expiries.pop(ticket_id, None)
            try:
                if self.core.get_ticket(ticket_id).state is not TicketState.RELEASED:
                    self.core.cancel_ticket(ticket_id, TicketOutcome.TIMED_OUT, "CREATE_TICKET_TTL")
            except BrokerError:
                pass  # already gone

        self._expiries[ticket_id] = asyncio.get_running_loop().call_later(self.rpc_ticket_ttl_seconds, expire)

    async def _alive_incarnation(self, spec: ReplicaSpec) -> str:
        """The registered incarnation of `spec`'s id when a new one would replace it while it may be
        alive (`takeover_needs_probe`) and it answers at its endpoint, else "" (docs/broker.md,
        Registration). The core re-checks after this await: the registration may have changed."""
        old = self.core.registry.find(spec.replica_id)
        if old is None or not takeover_needs_probe(old, spec, self.core.clock()):
            return ""
        incarnation = old.spec.incarnation_id
        return incarnation if await self.incarnation_probe(old.spec.endpoint, incarnation) else ""

    @_maps_errors
    async def RegisterReplica(
        self, request: broker_pb2.RegisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.RegisterReplicaResponse:
        spec = spec_from_proto(request.replica)
        # Bounded before anything is looked at, kept or dialled (docs/broker.md).
        self.core.check_listing(spec, writes=len(request.unresolved_writes), held=len(request.held_ticket_ids),
                                owed=len(request.owed_releases))  # fmt: skip
        check_listed_ids(request)
        # A forgotten incarnation is answered fenced (the core), whatever its endpoint: refused as
        # unreachable instead, a process cut off behind a partial partition would never fail stop.
        alive_incarnation = ""
        if not self.core.incarnation_forgotten(spec):
            problem = loopback_endpoint_problem(spec, context.peer())
            if problem:
                raise InvalidArgument("LOOPBACK_ENDPOINT", problem)
            problem, alive_incarnation = await asyncio.gather(
                unreachable_endpoint_problem(spec, context.peer(), self.endpoint_probe),
                self._alive_incarnation(spec),
            )
            if problem:
                raise InvalidArgument("UNREACHABLE_ENDPOINT", problem)
        reply = self.core.register_replica(
            spec,
            token=request.token,
            unresolved_writes=[_write_key(k) for k in request.unresolved_writes],
            held_ticket_ids=list(request.held_ticket_ids),
            owed_releases={
                o.ticket_id: (_OUTCOME_FROM_PB.get(o.outcome, TicketOutcome.FAILED), bounded_message(o.reason))
                for o in request.owed_releases
            },
            alive_incarnation=alive_incarnation,
            registered_before=request.registered_before,
            highest_ticket_sequence=request.highest_ticket_sequence,
        )
        return broker_pb2.RegisterReplicaResponse(lease_seconds=reply.lease_seconds, fenced=reply.fenced)

    @_maps_errors
    async def Heartbeat(
        self, request: broker_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.HeartbeatResponse:
        record = self.core.registry.find(request.replica_id)
        if request.unresolved_writes and record is not None:  # unknown: the core answers NOT_FOUND
            self.core.check_listing(record.spec, writes=len(request.unresolved_writes))
            check_listed_ids(request)
        run = request.receiver_run
        reply = self.core.heartbeat(
            request.replica_id, request.incarnation_id,
            [_write_key(k) for k in request.unresolved_writes] if record is not None else [],
            ReceiverRun(run.probe, run.stall_free_seconds, run.ranks) if request.HasField("receiver_run") else None,
        )  # fmt: skip
        # Its record (registered, fenced) and, for an AR, the tickets it writes (which it is polled
        # about, and which not); the lease is never journaled.
        reveals_only(self.core.commit_behind(replicas=[request.replica_id], polls_of=request.replica_id))
        # Taken only by credentials a rotation replaced (CredentialRotation): the replica re-reads
        # its token file and presents the new token before the grace ends.
        caller = current_caller()
        superseded = caller is not None and caller.superseded
        # The grace of the generation this replica's token belongs to (CredentialRotation).
        grace = (
            self.secrets.rotation.grace_left_s(request.replica_id) if superseded and self.secrets is not None else 0.0
        )
        return broker_pb2.HeartbeatResponse(
            fenced=reply.fenced,
            fence_reason=reply.fence_reason,
            lease_seconds=reply.lease_seconds,
            credential_superseded=superseded,
            credential_grace_seconds=grace,
            probe=reply.probe,
            next_heartbeat_seconds=reply.next_heartbeat_seconds,
            poll_writes=[
                common_pb2.WriteKey(ticket_id=tid, row=k.row, src_rank=k.src_rank, dst_rank=k.dst_rank)
                for tid, k in reply.poll_writes
            ],
        )

    @_maps_errors
    async def DeregisterReplica(
        self, request: broker_pb2.DeregisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.DeregisterReplicaResponse:
        caller = current_caller()
        by_replica = caller is None or caller.replica_id == request.replica_id
        self.core.deregister_replica(request.replica_id, request.incarnation_id, by_replica=by_replica)
        return broker_pb2.DeregisterReplicaResponse()

    @_maps_errors
    async def CreateTicket(
        self, request: broker_pb2.CreateTicketRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.CreateTicketResponse:
        # The orchestrator makes a generation's tickets under its request id (core.create_ticket):
        # one made here under that id would be taken for the generation's, or refuse its.
        state = self.generation_state(request.request_id) if request.request_id else None
        if state is not None:
            raise AlreadyExists(
                "REQUEST_ID_REUSED",
                f"request_id {request.request_id!r} names a generation of this broker ({state}); "
                "CreateTicket takes a request id of its own",
            )
        # No await from the check above to here: a Generate admitted under this id in between
        # would find this ticket (core.check_generation_id), and this call its generation.
        ticket = self.core.create_ticket(
            request.request_id, request.ar_replica_id, request.dit_replica_id, list(request.row_token_counts),
            by_hand=True,
        )
        if ticket is None:
            no_room = KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "NO_FREE_PAGES",
                f"DiT replica {request.dit_replica_id} has not enough free pages now; retry later",
            )
            await abort_with(context, no_room)  # _maps_errors waits for the journal before it leaves
        self._expire_later(ticket.ticket_id)
        return broker_pb2.CreateTicketResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def ReserveTicket(
        self, request: broker_pb2.ReserveTicketRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ReserveTicketResponse:
        arming = self.core.arm_ticket(request.ticket_id, request.ar_replica_id, request.incarnation_id)
        return broker_pb2.ReserveTicketResponse(
            ticket=ticket_to_proto(arming.ticket),
            destinations=[region_to_proto(r) for r in arming.destinations],
            writes=[write_to_proto(w) for w in arming.writes],
            dit_geometry=geometry_to_proto(arming.dit_geometry),
            dit_parallelism=common_pb2.Parallelism(
                tensor_parallel_size=arming.dit_tensor_parallel_size,
                sequence_parallel_size=arming.dit_sequence_parallel_size,
                cfg_parallel_size=arming.dit_cfg_parallel_size,
            ),
            dit_num_pages=arming.dit_num_pages,
            verify_checksums=arming.verify_checksums,
        )

    @_maps_errors
    async def StartConsuming(
        self, request: broker_pb2.StartConsumingRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.StartConsumingResponse:
        if not request.replica_id:
            raise InvalidArgument("INVALID_ARGUMENT", "replica_id: the DiT names itself")
        ticket = self.core.start_consuming(request.ticket_id, request.replica_id, request.incarnation_id)
        return broker_pb2.StartConsumingResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def ReportWrite(
        self, request: broker_pb2.ReportWriteRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ReportWriteResponse:
        # Bounded by the ticket's plan before the batch is converted (the core checks it again).
        self.core.check_report_counts(request.ticket_id, writes=len(request.writes))
        # `writes` (several writes, one commit) or the single write's own fields.
        items: list[broker_pb2.WriteReport | broker_pb2.ReportWriteRequest] = [*request.writes] or [request]
        reports = []
        for item in items:
            status = _WRITE_STATUS_FROM_PB.get(item.status, WriteStatus.PENDING)
            if status is WriteStatus.PENDING or status is WriteStatus.WRITER_GONE:
                raise InvalidArgument(
                    "INVALID_ARGUMENT", "status: a writer reports OK, FAILED, NOT_STARTED or IN_DOUBT"
                )
            reports.append(ReportedWrite(WriteKey(item.row, item.src_rank, item.dst_rank), status,
                                         item.checksum, item.bytes, bounded_message(item.message)))  # fmt: skip
        ticket = self.core.report_writes(
            request.ticket_id, reports, replica_id=request.replica_id, incarnation_id=request.incarnation_id
        )
        return broker_pb2.ReportWriteResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def ReportLoad(
        self, request: broker_pb2.ReportLoadRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ReportLoadResponse:
        self.core.check_report_counts(
            request.ticket_id, loads=len(request.loads),
            verified=max([len(request.verified), *(len(item.verified) for item in request.loads)]),
        )  # fmt: skip
        # `loads` (several loads, one commit) or the single load's own fields.
        items: list[broker_pb2.LoadReport | broker_pb2.ReportLoadRequest] = [*request.loads] or [request]
        loads = [
            (LoadKey(item.row, item.dst_rank),
             {WriteKey(v.row, v.src_rank, v.dst_rank): v.checksum for v in item.verified})
            for item in items
        ]  # fmt: skip
        ticket = self.core.report_loads(
            request.ticket_id, loads, replica_id=request.replica_id, incarnation_id=request.incarnation_id
        )
        return broker_pb2.ReportLoadResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def ReleaseTicket(
        self, request: broker_pb2.ReleaseTicketRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ReleaseTicketResponse:
        if not request.replica_id:
            # The owner check must not be skippable by leaving the id out.
            raise InvalidArgument("MISSING_FIELD", "replica_id: required (the releasing DiT replica)")
        if not request.incarnation_id:
            # So must the incarnation check: a release from another process of the replica id
            # (an old incarnation, a replayed call) would free pages the live one's ranks read.
            raise InvalidArgument("MISSING_FIELD", "incarnation_id: required (the releasing DiT's incarnation)")
        outcome = _OUTCOME_FROM_PB.get(request.outcome)
        if outcome is None:
            # Before, anything but a known outcome (UNSPECIFIED, 99) was recorded OK: a ticket
            # never loaded was released "served".
            raise InvalidArgument(
                "INVALID_OUTCOME",
                f"outcome: {request.outcome} is not OK, CANCELLED, TIMED_OUT or FAILED (how the DiT's call ended)",
            )
        # Reasons and messages a replica sends are kept (the ticket, the journal, the released history)
        # cut as status messages are: a 1 MB reason was kept whole, in every copy.
        reason = bounded_message(request.reason)
        ticket = self.core.release_ticket(request.ticket_id, outcome, reason, request.replica_id,
                                          request.incarnation_id)
        return broker_pb2.ReleaseTicketResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def CancelTicket(
        self, request: broker_pb2.CancelTicketRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.CancelTicketResponse:
        # UNSPECIFIED (left out) means CANCELLED; a number that is no outcome is the caller's bug.
        outcome = (TicketOutcome.CANCELLED if request.outcome == broker_pb2.TICKET_OUTCOME_UNSPECIFIED
                   else _OUTCOME_FROM_PB.get(request.outcome))
        if outcome is None:
            raise InvalidArgument(
                "INVALID_OUTCOME", f"outcome: {request.outcome} is not CANCELLED, TIMED_OUT or FAILED (or left out)"
            )
        try:
            was_over = self.core.get_ticket(request.ticket_id).request_over
        except BrokerError:
            was_over = True  # unknown: cancel_ticket below raises what it always did
        ticket = self.core.cancel_ticket(request.ticket_id, outcome, bounded_message(request.reason))
        # The request's own AR rolling back an unarmed ticket reports its failure in its Prefill
        # reply; anyone else (an operator) ends the generation here. Found black-box: an
        # operator's cancel of a CONSUMING ticket only marked it, the DiT read on, and the
        # generation ended SUCCEEDED. Ending it cancels the Denoise call: the DiT stops within a
        # step and releases the pages, which stay held until then.
        caller = current_caller()
        own_replica = caller is not None and caller.replica_id in (ticket.ar_replica_id, ticket.dit_replica_id)
        if not was_over and ticket.request_over and not own_replica and self.core.on_request_cancelled:
            self.core.on_request_cancelled(ticket)
        return broker_pb2.CancelTicketResponse(ticket=ticket_to_proto(ticket))

    @_maps_errors
    async def GetTicket(
        self, request: broker_pb2.GetTicketRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.GetTicketResponse:
        ticket = self.core.get_ticket(request.ticket_id)
        reveals_only(self.core.commit_behind(tickets=[ticket.ticket_id]))
        return broker_pb2.GetTicketResponse(ticket=ticket_to_proto(ticket))

    async def WatchTicket(
        self, request: broker_pb2.WatchTicketRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[broker_pb2.WatchTicketResponse]:
        self.rpc_counts["WatchTicket"] += 1
        caller = current_caller()
        holder = caller.replica_id if caller is not None else None
        try:
            self.watch_streams.open(holder)
        except BrokerError as err:
            await abort_with(context, to_server_error(err))
        # The core's waiter is removed in its own `finally` when this stream is cancelled.
        try:
            async for ticket in self.core.waiters.watch_ticket(request.ticket_id):
                # Read now, after the snapshot: a later change only makes it newer (waits more).
                await revealable(self.core, context, self.core.commit_behind(tickets=[ticket.ticket_id]))
                yield broker_pb2.WatchTicketResponse(ticket=ticket_to_proto(ticket))
        except (BrokerError, JournalWriteError) as err:
            # A refusal shows state too, as `_maps_errors` says: UNKNOWN_TICKET of a ticket whose
            # queued release pushed it out of the released history (a kill brings it back live).
            await revealable(self.core, context)
            await abort_with(context, to_server_error(err))
        finally:
            self.watch_streams.close(holder)

    @_maps_errors
    async def ListTickets(
        self, request: broker_pb2.ListTicketsRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ListTicketsResponse:
        states = [_STATE_FROM_PB[s] for s in request.states if s in _STATE_FROM_PB]
        if len(states) != len(request.states):
            # Named the number sent: `states: [42]` was called TICKET_STATE_UNSPECIFIED (black-box).
            bad = next(s for s in request.states if s not in _STATE_FROM_PB)
            raise InvalidArgument("INVALID_ARGUMENT", f"states: {bad} is not a ticket state (0 = unspecified)")
        tickets = self.core.list_tickets(states or None, request.replica_id or None)
        # Not narrowed: a filtered listing also shows which tickets are not in those states (one
        # whose release is still queued), so it waits for every commit made before it.
        return broker_pb2.ListTicketsResponse(tickets=[ticket_to_proto(t) for t in tickets])

    @_maps_errors
    async def GetPool(
        self, request: broker_pb2.GetPoolRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.GetPoolResponse:
        pools = self.core.pool_status(request.replica_id or None)
        shown = [p.replica_id for p in pools]
        # Every pool: which DiTs exist too (a forgotten one is missing from the list).
        reveals_only(self.core.commit_behind(pools=shown, replicas=shown, membership=not request.replica_id))
        return broker_pb2.GetPoolResponse(pools=[pool_to_proto(p) for p in pools])

    @_maps_errors
    async def ListReplicas(
        self, request: broker_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ListReplicasResponse:
        replicas = self.core.list_replicas()
        forgotten = self.core.forgotten_incarnations()
        # A forced forget records its incarnation in the commit that forgets the replica: membership.
        reveals_only(self.core.commit_behind(replicas=[s.spec.replica_id for s in replicas], membership=True))
        return broker_pb2.ListReplicasResponse(
            replicas=[replica_to_proto(s) for s in replicas],
            forgotten_incarnations=[
                broker_pb2.ForgottenIncarnation(replica_id=r, incarnation_id=i) for r, i in forgotten
            ],
            replica_authentication=self.replica_authentication,
            credential_refusals=[
                broker_pb2.CredentialRefusal(
                    replica_id=r.replica_id, reason=r.reason, method=r.method, refusals=r.refusals,
                    first_refusal_time=_timestamp(r.first_time), last_refusal_time=_timestamp(r.last_time),
                )
                for r in self.credential_refusals.snapshot()
            ],
            credential_grace_seconds=self.secrets.rotation.grace_left_s() if self.secrets is not None else 0.0,
        )

    @_maps_errors
    async def ForgetReplica(
        self, request: broker_pb2.ForgetReplicaRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ForgetReplicaResponse:
        if not request.replica_id:
            raise InvalidArgument("MISSING_FIELD", "replica_id: required (the replica to forget)")
        ended = self.core.forget_replica(request.replica_id, force=request.force)
        return broker_pb2.ForgetReplicaResponse(ended_ticket_ids=[t.ticket_id for t in ended])

    @_maps_errors
    async def ReloadCredentials(
        self, request: broker_pb2.ReloadCredentialsRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ReloadCredentialsResponse:
        if self.secrets is None:
            raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION",
                                     "this broker has no reloadable credentials")  # fmt: skip
        answer = await self.secrets.reload()
        return broker_pb2.ReloadCredentialsResponse(
            sources=[broker_pb2.CredentialSourceReload(key=s.key, source=s.source, state=s.state)
                     for s in answer.sources],
            rotated=answer.rotated,
            grace_seconds=answer.grace_seconds,
            error=answer.error,
        )  # fmt: skip


def add_broker_servicer(core: BrokerCore, server: grpc.aio.Server) -> BrokerServicer:
    servicer = BrokerServicer(core)
    broker_pb2_grpc.add_BrokerServiceServicer_to_server(servicer, server)
    return servicer


__all__ = ["BrokerServicer", "add_broker_servicer", "ticket_to_proto", "spec_from_proto"]
