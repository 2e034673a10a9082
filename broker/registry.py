"""The replica registry: who is registered, with which incarnation, lease and fence.

Owns registration validation (roles, ranks, geometry agreement between AR and DiT naming the
field, layout version), leases and fences. Pure: no gRPC, no sockets; the clock is passed in.
Must never decide anything about tickets or pages: BrokerCore reacts to what `register`
reports (a new incarnation proves the old process gone).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvrelay.broker.tickets import FailedPrecondition, InvalidArgument, NotFound, ReplicaId, ResourceExhausted
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.planner import MAX_CFG_ROWS

# Geometry fields that AR and DiT must agree on; page_size is the DiT's alone (DESIGN.md section 3).
SHARED_GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype")
# The broker keeps one byte of state per page and CFG group (pool.PagePool), allocated when the
# replica registers: one RegisterReplica saying num_pages 4e9 grew the broker by 4 GB and stalled
# its event loop for 10 s. 4Mi pages is ~57 GiB of BAGEL-7B KV per rank at page_size 1.
MAX_PAGES_PER_REPLICA = 1 << 22
# Distinct replica ids the registry holds (live, lapsed, deregistered and restored ones): a holder
# of the shared replica token could otherwise grow the broker's memory, journal and metrics
# without bound by registering made-up ids. Room is made by forgetting idle ones first
# (BrokerCore.register_replica).
MAX_REPLICAS = 256
# Page states the broker holds across every DiT replica it keeps (num_pages x CFG groups, a byte
# each, registered, lapsed and restored ones alike): MAX_REPLICAS made-up DiT replicas at
# MAX_PAGES_PER_REPLICA with two CFG groups grew it by 2 GiB. 64Mi page states (64 MiB) is 256
# replicas of 256Ki pages per rank, ~57 GiB of BAGEL-7B KV each at page_size 16 (broker.max_total_pages).
MAX_TOTAL_PAGES = 1 << 26


# Longest strings and most regions a registration may carry (ids are bounded by the interceptor,
# kvrelay.security.MAX_ID_CHARS). Each is kept for as long as the replica id is: in memory, in the
# journal, in ListReplicas and ReserveTicket replies. Bounded only by the request size (8 MiB), one
# registration with an 8 MB endpoint made every one of those copies 8 MB, and the broker dialled
# it. An endpoint is `host:port` (a DNS name is at most 253 characters) or a CUDA IPC descriptor
# (`cudaipc:<hostname>/<boot id>:<GPU uuid>`); a CUDA IPC handle is 64 bytes.
MAX_ENDPOINT_CHARS = 512
MAX_VERSION_CHARS = 256
MAX_IPC_HANDLE_BYTES = 1024
MAX_REGIONS = 1024


class ReplicaRole(enum.Enum):
    AR = "AR"
    DIT = "DIT"


@dataclass(frozen=True, slots=True)
class MemoryRegionSpec:
    rank: int
    transport: str  # "mooncake" | "grpc" | "cuda_ipc"
    endpoint: str
    base_address: int
    length: int
    ipc_handle: bytes = b""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What a replica says about itself when it registers."""

    replica_id: ReplicaId
    role: ReplicaRole
    incarnation_id: str
    layout_version: int
    version: str
    endpoint: str
    geometry: KvGeometry
    tensor_parallel_size: int = 1
    sequence_parallel_size: int = 1
    # CFG-parallel DiT: `cfg_parallel_size` groups of tp * sp ranks, each with its own page-id space.
    cfg_parallel_size: int = 1
    regions: tuple[MemoryRegionSpec, ...] = ()
    num_pages: int = 0
    max_tokens: int = 0
    transport: str = "mooncake"
    stage_id: int = 0
    max_num_seqs: int = 1
    # DiT: the largest image width or height its model generates (0 = no limit of its own).
    max_image_side: int = 0

    @property
    def head_shards(self) -> int:
        """The KV head shards one CFG group splits the heads into (tp * sp)."""
        return self.tensor_parallel_size * self.sequence_parallel_size

    @property
    def world_size(self) -> int:
        """Every rank of the replica: cfg_parallel_size groups of head_shards ranks."""
        return self.cfg_parallel_size * self.head_shards

    def to_json(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "replica_id": self.replica_id, "role": self.role.value, "incarnation_id": self.incarnation_id,
            "layout_version": self.layout_version, "version": self.version, "endpoint": self.endpoint,
            "geometry": [g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.page_size],
            "tensor_parallel_size": self.tensor_parallel_size,
            "sequence_parallel_size": self.sequence_parallel_size,
            "cfg_parallel_size": self.cfg_parallel_size,
            "regions": [
                [r.rank, r.transport, r.endpoint, r.base_address, r.length, r.ipc_handle.hex()] for r in self.regions
            ],
            "num_pages": self.num_pages, "max_tokens": self.max_tokens, "transport": self.transport,
            "stage_id": self.stage_id, "max_num_seqs": self.max_num_seqs,
            "max_image_side": self.max_image_side,
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReplicaSpec:
        nl, nh, hd, dt, ps = d["geometry"]
        return cls(
            replica_id=d["replica_id"], role=ReplicaRole(d["role"]), incarnation_id=d["incarnation_id"],
            layout_version=d["layout_version"], version=d["version"], endpoint=d["endpoint"],
            geometry=KvGeometry(nl, nh, hd, dt, ps),
            tensor_parallel_size=d["tensor_parallel_size"], sequence_parallel_size=d["sequence_parallel_size"],
            cfg_parallel_size=d.get("cfg_parallel_size", 1),  # journals written before CFG-parallel
            regions=tuple(
                MemoryRegionSpec(r[0], r[1], r[2], r[3], r[4], bytes.fromhex(r[5])) for r in d["regions"]
            ),
            num_pages=d["num_pages"], max_tokens=d["max_tokens"], transport=d["transport"],
            stage_id=d["stage_id"], max_num_seqs=d["max_num_seqs"],
            max_image_side=d.get("max_image_side", 0),  # journals written before it
        )  # fmt: skip


@dataclass(slots=True)
class ReplicaRecord:
    spec: ReplicaSpec
    lease_expire_time: float
    fenced: bool = False
    fence_reason: str = ""
    deregistered: bool = False
    # Deregistered by another caller (an operator) while the process may still run: its next
    # heartbeat is told to register again (never journaled: a restarted broker asks every replica
    # to register again anyway).
    deregistered_by_other: bool = False
    # When this broker saw it deregister (never journaled: a restored record is down from the
    # broker's start), for broker.forget_down_replicas_after_seconds.
    deregister_time: float | None = None
    # Restored from the journal after a broker restart: the replica must register again
    # (same incarnation: reconcile; new one: the old process is proven gone).
    needs_registration: bool = False
    # A call the broker made to it failed to connect (refused, reset, no route) since its last
    # heartbeat. Placement only, never journaled: a lease or a fence is what ownership rules read.
    unreachable: bool = False

    def up(self, now: float) -> bool:
        return not self.deregistered and not self.needs_registration and now < self.lease_expire_time

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "fenced": self.fenced,
            "fence_reason": self.fence_reason,
            "deregistered": self.deregistered,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReplicaRecord:
        return cls(
            spec=ReplicaSpec.from_json(d["spec"]),
            lease_expire_time=float("-inf"),
            fenced=d["fenced"],
            fence_reason=d["fence_reason"],
            deregistered=d["deregistered"],
            needs_registration=True,
        )


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A snapshot of one replica for listing."""

    spec: ReplicaSpec
    up: bool
    fenced: bool
    fence_reason: str
    lease_expire_time: float
    deregistered: bool
    # False from a failed connection to it (the broker's own call) until its next heartbeat:
    # placement skips it meanwhile (`BrokerCore.mark_unreachable`).
    reachable: bool = True


class Registration(enum.Enum):
    NEW = "NEW"  # never seen this replica id
    SAME_INCARNATION = "SAME_INCARNATION"  # re-registration of the same process (e.g. broker restart)
    NEW_INCARNATION = "NEW_INCARNATION"  # the process restarted: the old one is proven gone
    # An incarnation an operator forgot by force (BrokerCore.forget_replica): answered fenced and
    # kept nowhere, so that process fails stop and only a new incarnation (new memory) returns.
    FORGOTTEN = "FORGOTTEN"
    # A DiT incarnation registered before (RegisterReplicaRequest.registered_before) that this broker
    # holds no record of (a lost or replaced journal, a new broker, a journal older than it):
    # answered fenced and kept nowhere (BrokerCore.register_replica), as FORGOTTEN.
    UNKNOWN = "UNKNOWN"


def takeover_needs_probe(old: ReplicaRecord | None, spec: ReplicaSpec, now: float) -> bool:
    """Whether registering `spec` would replace an incarnation that may still be alive: another
    incarnation of the id, neither fenced nor deregistered, and within its lease or restored from
    the journal by a restarted broker (whose lease it has not renewed yet: a live one registers
    again with its incarnation soon). The broker then asks the old one's endpoint
    (kvrelay.broker.service.grpc_incarnation_probe) and refuses the newcomer while it answers
    (`REPLICA_ID_IN_USE`): the replica lock proves the old process gone only on its own host. One
    that lapsed, stopped or was fenced is replaced at once."""
    return (
        old is not None
        and old.spec.incarnation_id != spec.incarnation_id
        and not old.fenced
        and not old.deregistered
        and (old.needs_registration or now < old.lease_expire_time)
    )


def validate_spec(spec: ReplicaSpec, layout_version: int) -> None:
    if not spec.replica_id:
        raise InvalidArgument("MISSING_FIELD", "replica.replica_id is required")
    if not spec.incarnation_id:
        raise InvalidArgument("MISSING_FIELD", "replica.incarnation_id is required")
    if spec.layout_version != layout_version:
        raise InvalidArgument(
            "LAYOUT_VERSION_MISMATCH",
            f"replica.layout_version: replica {spec.replica_id} uses page layout {spec.layout_version}, "
            f"the broker {layout_version}",
        )
    if spec.tensor_parallel_size < 1 or spec.sequence_parallel_size < 1 or spec.cfg_parallel_size < 1:
        raise InvalidArgument("INVALID_PARALLELISM", "replica.parallelism: sizes must be >= 1")
    if spec.role is ReplicaRole.AR and spec.sequence_parallel_size != 1:
        raise InvalidArgument("INVALID_PARALLELISM", "replica.parallelism.sequence_parallel_size: AR is TP only")
    if spec.role is ReplicaRole.AR and spec.cfg_parallel_size != 1:
        raise InvalidArgument("INVALID_PARALLELISM", "replica.parallelism.cfg_parallel_size: CFG-parallel is the DiT's")
    if spec.cfg_parallel_size > MAX_CFG_ROWS:
        raise InvalidArgument(
            "INVALID_PARALLELISM",
            f"replica.parallelism.cfg_parallel_size: {spec.cfg_parallel_size} groups for at most {MAX_CFG_ROWS} CFG rows",
        )
    if spec.geometry.num_kv_heads % spec.head_shards:
        raise InvalidArgument(
            "INVALID_PARALLELISM",
            f"replica.parallelism: {spec.head_shards} head shards (tp x sp) do not divide "
            f"num_kv_heads={spec.geometry.num_kv_heads}",
        )
    if spec.role is ReplicaRole.AR and spec.regions:
        # An AR receives nothing: its regions were kept (memory, journal, ListReplicas) and used by
        # nothing, up to MAX_REGIONS of them (1.5 MB a registration, 256 replica ids).
        raise InvalidArgument(
            "UNEXPECTED_REGIONS",
            f"replica.regions: {len(spec.regions)} regions, but an AR replica receives nothing (regions are a DiT's)",
        )
    if spec.role is ReplicaRole.DIT:
        if spec.num_pages <= 0:
            raise InvalidArgument("MISSING_FIELD", "replica.num_pages: a DiT replica needs pages")
        if spec.num_pages > MAX_PAGES_PER_REPLICA:
            raise InvalidArgument(
                "TOO_MANY_PAGES",
                f"replica.num_pages: {spec.num_pages} pages per rank; the broker tracks at most "
                f"{MAX_PAGES_PER_REPLICA} (raise the DiT stage's page_size)",
            )
        ranks = sorted(r.rank for r in spec.regions)
        if ranks != list(range(spec.world_size)):
            # A DiT rank without a region is a missing worker rank: nothing could land there.
            raise InvalidArgument(
                "MISSING_RANK",
                f"replica.regions: DiT {spec.replica_id} has {spec.world_size} ranks "
                f"(cfg {spec.cfg_parallel_size} x tp {spec.tensor_parallel_size} x sp {spec.sequence_parallel_size}) "
                f"but regions for {ranks}",
            )


def page_states(spec: ReplicaSpec) -> int:
    """The page states (bytes) the broker keeps for a replica: `num_pages` per CFG group, DiT only."""
    return spec.num_pages * spec.cfg_parallel_size if spec.role is ReplicaRole.DIT else 0


def geometry_mismatch(a: KvGeometry, b: KvGeometry) -> str | None:
    for name in SHARED_GEOMETRY_FIELDS:
        if getattr(a, name) != getattr(b, name):
            return name
    return None


class ReplicaRegistry:
    def __init__(
        self, layout_version: int, max_replicas: int = MAX_REPLICAS, max_total_pages: int = MAX_TOTAL_PAGES
    ) -> None:
        self.layout_version = layout_version
        self.max_replicas = max_replicas
        self.max_total_pages = max_total_pages
        self._replicas: dict[ReplicaId, ReplicaRecord] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[ReplicaRecord]:
        # A copy: the metrics endpoint iterates from its own thread while the loop registers.
        return iter(list(self._replicas.values()))

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def get(self, replica_id: ReplicaId) -> ReplicaRecord:
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise NotFound("UNKNOWN_REPLICA", f"replica {replica_id!r} is not registered") from None

    def find(self, replica_id: ReplicaId) -> ReplicaRecord | None:
        return self._replicas.get(replica_id)

    def restore(self, record: ReplicaRecord) -> None:
        self._replicas[record.spec.replica_id] = record

    def forget(self, replica_id: ReplicaId) -> None:
        """Drop a replica's record for good (BrokerCore decides that nothing needs it)."""
        del self._replicas[replica_id]

    def total_pages(self) -> int:
        """Page states held for every DiT replica the registry keeps (`page_states`)."""
        return sum(page_states(r.spec) for r in self._replicas.values())

    def exceeds_page_budget(self, spec: ReplicaSpec) -> bool:
        """Whether registering `spec` would grow the page states held beyond `max_total_pages`.
        Never for a registration that does not grow them (a same-incarnation re-registration, a
        restart with as many pages): a replica that may own journaled pages can always return."""
        old = self._replicas.get(spec.replica_id)
        held = page_states(old.spec) if old is not None else 0
        wanted = page_states(spec)
        return wanted > held and self.total_pages() - held + wanted > self.max_total_pages

    def check_compatible(self, spec: ReplicaSpec) -> None:
        for other in self._replicas.values():
            if other.spec.replica_id == spec.replica_id or other.deregistered:
                continue
            bad = geometry_mismatch(spec.geometry, other.spec.geometry)
            if bad is not None:
                # What a user bringing their own model can change (a checkpoint's dtype is not
                # always what the engine runs: vLLM may pick bfloat16 for a float32 one).
                fix = ("set the same model.dtype on both stages" if bad == "dtype"
                       else "the AR and DiT models must have the same KV shape (layers, kv heads, head_dim)")
                raise InvalidArgument(
                    "GEOMETRY_MISMATCH",
                    f"replica.geometry.{bad}: {spec.replica_id} has {bad}={getattr(spec.geometry, bad)!r} but "
                    f"{other.spec.replica_id} ({other.spec.role.value}) has {getattr(other.spec.geometry, bad)!r}: "
                    f"{fix}",
                )

    def register(self, spec: ReplicaSpec, now: float, lease_seconds: float) -> tuple[Registration, ReplicaRecord]:
        validate_spec(spec, self.layout_version)
        self.check_compatible(spec)
        old = self._replicas.get(spec.replica_id)
        if old is None and len(self._replicas) >= self.max_replicas:
            raise ResourceExhausted(
                "TOO_MANY_REPLICAS",
                f"replica {spec.replica_id}: the broker already holds {len(self._replicas)} replica ids "
                f"(at most {self.max_replicas}); deregister replicas that are gone "
                "(an idle deregistered or lapsed one is forgotten to make room)",
            )
        if old is not None and old.spec.role is not spec.role:
            raise InvalidArgument(
                "ROLE_MISMATCH",
                f"replica.role: {spec.replica_id} registered as {old.spec.role.value}, now {spec.role.value}",
            )
        if self.exceeds_page_budget(spec):
            raise ResourceExhausted(
                "PAGE_BUDGET_EXHAUSTED",
                f"replica.num_pages: {spec.replica_id} would add {page_states(spec)} page states "
                f"({spec.num_pages} pages x {spec.cfg_parallel_size} CFG groups) to the {self.total_pages()} the broker "
                f"holds, above broker.max_total_pages {self.max_total_pages}; deregister DiT replicas that are gone "
                "(an idle deregistered or lapsed one is forgotten to make room), raise the DiT stage's page_size, "
                "or raise broker.max_total_pages",
            )
        if old is None:
            kind = Registration.NEW
            record = ReplicaRecord(spec=spec, lease_expire_time=now + lease_seconds)
        elif old.spec.incarnation_id == spec.incarnation_id:
            kind = Registration.SAME_INCARNATION
            if old.spec.role is ReplicaRole.DIT and (
                old.spec.num_pages != spec.num_pages or old.spec.world_size != spec.world_size
            ):
                raise InvalidArgument(
                    "INCARNATION_CHANGED_SHAPE",
                    f"replica {spec.replica_id}: same incarnation re-registered with other pages or ranks",
                )
            # Same process: the fence (if any) stays; it must fail stop.
            record = ReplicaRecord(
                spec=spec,
                lease_expire_time=now + lease_seconds,
                fenced=old.fenced,
                fence_reason=old.fence_reason,
            )
        else:
            # A new incarnation took the replica's lock file: every worker of the old one is dead,
            # and the fence on the old process is lifted with it.
            kind = Registration.NEW_INCARNATION
            record = ReplicaRecord(spec=spec, lease_expire_time=now + lease_seconds)
        self._replicas[spec.replica_id] = record
        return kind, record

    def check_incarnation(self, replica_id: ReplicaId, incarnation_id: str) -> ReplicaRecord:
        record = self.get(replica_id)
        if record.spec.incarnation_id != incarnation_id:
            # Never names the registered incarnation: with a shared replica token, any holder can
            # declare any replica id, and the incarnation id is then all that stands between it
            # and reports in that replica's name (a write reported NOT_STARTED while it may land).
            raise FailedPrecondition(
                "STALE_INCARNATION",
                f"replica {replica_id}: incarnation {incarnation_id!r} is not the registered one; "
                "the report is ignored",
            )
        return record

    def heartbeat(self, replica_id: ReplicaId, incarnation_id: str, now: float, lease_seconds: float) -> ReplicaRecord:
        record = self.check_incarnation(replica_id, incarnation_id)
        if record.needs_registration:
            raise NotFound(
                "REPLICA_NOT_REGISTERED",
                f"replica {replica_id}: the broker restarted; register again with the same incarnation",
            )
        if record.deregistered and record.deregistered_by_other:
            # Found black-box: an operator's DeregisterReplica of a live replica left it serving and
            # heartbeating but never placed on again (every Generate NO_DIT_REPLICA) until restarted.
            raise NotFound(
                "REPLICA_NOT_REGISTERED",
                f"replica {replica_id}: deregistered by an operator while it still runs; register again "
                "with the same incarnation (stop the process to take it out of service)",
            )
        # A replica that deregistered itself keeps heartbeating while it finishes its writes: it
        # still gets polled for them, but it stays out of scheduling (`up` is False once deregistered).
        record.lease_expire_time = now + lease_seconds
        return record

    def status(self, record: ReplicaRecord, now: float) -> ReplicaStatus:
        return ReplicaStatus(
            spec=record.spec,
            up=record.up(now),
            fenced=record.fenced,
            fence_reason=record.fence_reason,
            lease_expire_time=record.lease_expire_time,
            deregistered=record.deregistered,
            reachable=not record.unreachable,
        )
