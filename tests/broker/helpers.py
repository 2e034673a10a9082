"""Builders shared by the broker tests: replica specs, a hand-driven clock, a full lifecycle."""

from __future__ import annotations

import uuid
from dataclasses import replace

from kvrelay import LAYOUT_VERSION
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import MemoryRegionSpec, ReplicaRole, ReplicaSpec
from kvrelay.broker.tickets import Ticket, TicketOutcome, WriteKey, WriteStatus
from kvrelay.transfer.layout import KvGeometry

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=16)


class ManualClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ar_spec(replica_id: str = "ar-0", tp: int = 1, incarnation: str | None = None, **kw: object) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id,
        role=ReplicaRole.AR,
        incarnation_id=incarnation or uuid.uuid4().hex,
        layout_version=LAYOUT_VERSION,
        version="test",
        endpoint="127.0.0.1:1",
        geometry=kw.pop("geometry", GEOMETRY),  # type: ignore[arg-type]
        tensor_parallel_size=tp,
        max_tokens=int(kw.pop("max_tokens", 4096)),  # type: ignore[call-overload]
        **kw,  # type: ignore[arg-type]
    )


def dit_spec(
    replica_id: str = "dit-0", tp: int = 1, sp: int = 1, num_pages: int = 64, incarnation: str | None = None,
    **kw: object,
) -> ReplicaSpec:
    world = tp * sp * int(kw.get("cfg_parallel_size", 1))  # type: ignore[call-overload]
    return ReplicaSpec(
        replica_id=replica_id,
        role=ReplicaRole.DIT,
        incarnation_id=incarnation or uuid.uuid4().hex,
        layout_version=LAYOUT_VERSION,
        version="test",
        endpoint="127.0.0.1:2",
        geometry=kw.pop("geometry", GEOMETRY),  # type: ignore[arg-type]
        tensor_parallel_size=tp,
        sequence_parallel_size=sp,
        regions=tuple(MemoryRegionSpec(r, "mooncake", f"127.0.0.1:{9000 + r}", 1 << 20, 1 << 30) for r in range(world)),
        num_pages=num_pages,
        **kw,  # type: ignore[arg-type]
    )


def new_incarnation(spec: ReplicaSpec) -> ReplicaSpec:
    return replace(spec, incarnation_id=uuid.uuid4().hex)


def checksum_of(ticket_id: str, key: WriteKey) -> int:
    """A deterministic stand-in for the xxh3 of a write's bytes (the broker only compares them)."""
    return hash((ticket_id, key.row, key.src_rank, key.dst_rank)) & 0xFFFF_FFFF_FFFF_FFFF


def write_all(core: BrokerCore, ticket: Ticket, ar: ReplicaSpec, status: WriteStatus = WriteStatus.OK) -> Ticket:
    for w in ticket.writes:
        ticket = core.report_write(
            ticket.ticket_id, w.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
            status=status, checksum=checksum_of(ticket.ticket_id, w.key), nbytes=100,
        )
    return ticket


def load_all(core: BrokerCore, ticket: Ticket, dit: ReplicaSpec) -> Ticket:
    for ld in ticket.loads:
        verified = {
            w.key: checksum_of(ticket.ticket_id, w.key)
            for w in ticket.writes
            if w.key.row == ld.key.row and w.key.dst_rank == ld.key.dst_rank
        }
        ticket = core.report_load(
            ticket.ticket_id, ld.key.row, ld.key.dst_rank,
            replica_id=dit.replica_id, incarnation_id=dit.incarnation_id, verified=verified,
        )
    return ticket


def full_lifecycle(core: BrokerCore, ar: ReplicaSpec, dit: ReplicaSpec, request_id: str, rows: list[int]) -> Ticket:
    ticket = core.create_ticket(request_id, ar.replica_id, dit.replica_id, rows)
    assert ticket is not None
    core.arm_ticket(ticket.ticket_id, ar.replica_id, ar.incarnation_id)
    ticket = write_all(core, ticket, ar)
    ticket = load_all(core, ticket, dit)
    core.start_consuming(ticket.ticket_id)
    return core.release_ticket(ticket.ticket_id, TicketOutcome.OK, replica_id=dit.replica_id)
