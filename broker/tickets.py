"""The transfer ticket state machine (DESIGN.md section 6) and the broker's error family.

Owns the one transition table, the per-ticket record of expected writes (per
`(row, src_rank, dst_rank)`, with checksums) and loads (per `(row, dst_rank)`), and the rules
that decide when a ticket is READY, when it must DRAIN and when it may be RELEASED.
Must never touch pages, replicas, sockets, gRPC or a clock: the caller passes `now` and
`quiet_seconds`, and moves pages according to the state a method returns.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Final

TicketId = str
ReplicaId = str
PageId = int


# ---------------------------------------------------------------------------- errors
# Carry a gRPC status code *name* and an UPPER_SNAKE reason, so that the servicer maps them
# to google.rpc.ErrorInfo without this module importing gRPC.


class BrokerError(Exception):
    code: ClassVar[str] = "INTERNAL"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class InvalidArgument(BrokerError):
    code = "INVALID_ARGUMENT"


class NotFound(BrokerError):
    code = "NOT_FOUND"


class AlreadyExists(BrokerError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(BrokerError):
    code = "FAILED_PRECONDITION"


class IllegalTransition(FailedPrecondition):
    """An event the transition table does not allow in the ticket's state."""


class Unavailable(BrokerError):
    code = "UNAVAILABLE"


class ResourceExhausted(BrokerError):
    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(BrokerError):
    code = "UNAUTHENTICATED"


class BrokenInvariant(FailedPrecondition):
    """A report that proves the reporting replica is broken: the caller fences that replica."""


# ----------------------------------------------------------------------- the machine


class TicketState(enum.Enum):
    RESERVED = "RESERVED"
    WRITING = "WRITING"
    READY = "READY"
    CONSUMING = "CONSUMING"
    DRAINING = "DRAINING"
    RELEASED = "RELEASED"


class TicketOutcome(enum.Enum):
    OK = "OK"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"


class TicketEvent(enum.Enum):
    ARM = "ARM"  # destination map handed to the AR
    ROLLBACK = "ROLLBACK"  # request over before arming: nothing can have been written
    ALL_LOADED = "ALL_LOADED"  # every (row, dst_rank) verified at the receiver
    START_CONSUMING = "START_CONSUMING"  # the DiT starts reading the pages
    END_RESOLVED = "END_RESOLVED"  # request over, every write final, quiet period passed
    END_UNRESOLVED = "END_UNRESOLVED"  # request over, a write may still land (or quiet pending)
    DRAINED = "DRAINED"  # every write resolved and the quiet period passed
    # The DiT replica re-registered with a new incarnation: the pages' memory no longer exists
    # and fresh transport ports mean no old writer can reach the new memory.
    DESTINATION_GONE = "DESTINATION_GONE"


S, E = TicketState, TicketEvent
# The one table of legal transitions. Anything else raises IllegalTransition.
TRANSITIONS: Final[Mapping[tuple[TicketState, TicketEvent], TicketState]] = {
    (S.RESERVED, E.ARM): S.WRITING,
    (S.RESERVED, E.ROLLBACK): S.RELEASED,
    (S.WRITING, E.ALL_LOADED): S.READY,
    (S.WRITING, E.END_RESOLVED): S.RELEASED,
    (S.WRITING, E.END_UNRESOLVED): S.DRAINING,
    (S.READY, E.START_CONSUMING): S.CONSUMING,
    # By READY every write is final and verified at the receiver: READY and CONSUMING never drain.
    (S.READY, E.END_RESOLVED): S.RELEASED,
    (S.CONSUMING, E.END_RESOLVED): S.RELEASED,
    (S.DRAINING, E.DRAINED): S.RELEASED,
    (S.RESERVED, E.DESTINATION_GONE): S.RELEASED,
    (S.WRITING, E.DESTINATION_GONE): S.RELEASED,
    (S.READY, E.DESTINATION_GONE): S.RELEASED,
    (S.CONSUMING, E.DESTINATION_GONE): S.RELEASED,
    (S.DRAINING, E.DESTINATION_GONE): S.RELEASED,
}
del S, E

# States whose pages the pool counts as reserved (DRAINING pages are draining, RELEASED free).
HOLDING_STATES: Final = frozenset(
    {TicketState.RESERVED, TicketState.WRITING, TicketState.READY, TicketState.CONSUMING}
)


def next_state(ticket_id: TicketId, state: TicketState, event: TicketEvent) -> TicketState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(
            "ILLEGAL_TRANSITION", f"ticket {ticket_id}: {event.value} is not allowed in state {state.value}"
        ) from None


class WriteStatus(enum.Enum):
    """Three kinds of outcome: final OK, final failure (FAILED, NOT_STARTED, WRITER_GONE: provably
    nothing more lands), and in doubt (PENDING, IN_DOUBT: the transport call may still be running)."""

    PENDING = "PENDING"
    OK = "OK"
    FAILED = "FAILED"  # the transport call itself returned an error
    NOT_STARTED = "NOT_STARTED"
    WRITER_GONE = "WRITER_GONE"  # proven: the writer's replica re-registered with a new incarnation
    # The sender stopped waiting while its transport call still runs ("I stopped waiting" is not
    # "it is over"): unresolved until the sender reports the call's real end.
    IN_DOUBT = "IN_DOUBT"


# What a writer may report; WRITER_GONE is only ever concluded by the broker.
REPORTABLE: Final = frozenset({WriteStatus.OK, WriteStatus.FAILED, WriteStatus.NOT_STARTED, WriteStatus.IN_DOUBT})
# Nothing more of the write can land.
FINAL_WRITE_STATUSES: Final = frozenset(
    {WriteStatus.OK, WriteStatus.FAILED, WriteStatus.NOT_STARTED, WriteStatus.WRITER_GONE}
)
# What may follow IN_DOUBT: the call returned (with any status). NOT_STARTED would contradict it.
_AFTER_IN_DOUBT: Final = frozenset({WriteStatus.OK, WriteStatus.FAILED})


@dataclass(frozen=True, slots=True, order=True)
class WriteKey:
    row: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, slots=True, order=True)
class LoadKey:
    row: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class RowPages:
    row: int
    num_tokens: int
    page_ids: tuple[PageId, ...]


@dataclass(frozen=True, slots=True)
class WriteProgress:
    key: WriteKey
    status: WriteStatus
    checksum: int
    bytes: int


@dataclass(frozen=True, slots=True)
class LoadProgress:
    key: LoadKey
    loaded: bool


@dataclass(frozen=True, slots=True)
class Ticket:
    """A snapshot of one ticket; what the broker's API hands out."""

    ticket_id: TicketId
    request_id: str
    state: TicketState
    outcome: TicketOutcome | None
    ar_replica_id: ReplicaId
    dit_replica_id: ReplicaId
    rows: tuple[RowPages, ...]
    armed: bool
    writes: tuple[WriteProgress, ...]
    loads: tuple[LoadProgress, ...]
    reason: str
    create_time: float
    update_time: float
    sequence: int
    version: int
    request_over: bool
    # Made by hand with the operator's BrokerService.CreateTicket, not by the orchestrator for a
    # generation: a generation's request id is never such a ticket's while its request is live.
    by_hand: bool = False

    @property
    def page_ids(self) -> tuple[PageId, ...]:
        return tuple(p for r in self.rows for p in r.page_ids)

    def unresolved_writes(self) -> tuple[WriteKey, ...]:
        """Writes that may still land: never reported (PENDING) or reported IN_DOUBT."""
        return tuple(w.key for w in self.writes if w.status not in FINAL_WRITE_STATUSES)

    def in_doubt_writes(self) -> tuple[WriteKey, ...]:
        return tuple(w.key for w in self.writes if w.status is WriteStatus.IN_DOUBT)


@dataclass(slots=True)
class WriteRecord:
    status: WriteStatus = WriteStatus.PENDING
    checksum: int = 0
    bytes: int = 0
    message: str = ""


class TicketRecord:
    """The mutable state of one ticket. Every state change goes through `_apply`."""

    __slots__ = (
        "ticket_id", "request_id", "ar_replica_id", "dit_replica_id", "rows", "sequence",
        "src_shards", "dst_shards", "create_time", "update_time", "state", "outcome", "reason",
        "armed", "armed_incarnation", "dit_incarnation", "request_over", "writes", "loads",
        "last_resolution_time", "drain_start_time", "version", "orphaned", "by_hand",
    )  # fmt: skip

    def __init__(
        self,
        *,
        ticket_id: TicketId,
        request_id: str,
        ar_replica_id: ReplicaId,
        dit_replica_id: ReplicaId,
        rows: tuple[RowPages, ...],
        write_keys: Iterable[WriteKey],
        src_shards: int,
        dst_shards: int,
        sequence: int,
        dit_incarnation: str,
        now: float,
        by_hand: bool = False,
    ) -> None:
        self.ticket_id = ticket_id
        self.request_id = request_id
        self.ar_replica_id = ar_replica_id
        self.dit_replica_id = dit_replica_id
        self.rows = rows
        self.sequence = sequence
        self.src_shards = src_shards
        self.dst_shards = dst_shards
        self.create_time = now
        self.update_time = now
        self.state = TicketState.RESERVED
        self.outcome: TicketOutcome | None = None
        self.reason = ""
        self.armed = False
        self.armed_incarnation = ""
        self.dit_incarnation = dit_incarnation
        self.request_over = False
        self.writes: dict[WriteKey, WriteRecord] = {k: WriteRecord() for k in sorted(write_keys)}
        # One load per (row, DiT rank) the plan writes to: every rank of the replica, or only the
        # ranks of the row's CFG group on a CFG-parallel DiT (a rank that never reads a row holds
        # no pages for it and reports no load of it).
        self.loads: dict[LoadKey, bool] = {LoadKey(k.row, k.dst_rank): False for k in self.writes}
        self.last_resolution_time: float | None = None
        self.drain_start_time: float | None = None
        self.version = 0
        # The request was ended by the broker's restart (`orphan`), not by anyone who saw it end:
        # the DiT's release of a READY/CONSUMING ticket then records what really happened.
        self.orphaned = False
        # Made with BrokerService.CreateTicket (an operator's), not for a generation (journaled).
        self.by_hand = by_hand

    # ------------------------------------------------------------------ queries

    @property
    def page_ids(self) -> list[PageId]:
        return [p for r in self.rows for p in r.page_ids]

    def unresolved(self) -> list[WriteKey]:
        """Writes that may still land (PENDING or IN_DOUBT): the pages stay held while any exists."""
        return [k for k, w in self.writes.items() if w.status not in FINAL_WRITE_STATUSES]

    def writer_gone_writes(self) -> list[WriteKey]:
        """Writes resolved by proof that their sender is gone, not by its own final report."""
        return [k for k, w in self.writes.items() if w.status is WriteStatus.WRITER_GONE]

    def receiver_unsettled_writes(self) -> list[WriteKey]:
        """Resolved writes whose bytes may still sit in the receiver's socket: nothing more is
        sent, but what was sent is not known to have landed. WRITER_GONE (the sender is gone), and
        FAILED: the transport call returned an error, which ends the sending, not the receiving
        (Mooncake's engine fails a batch after its own MC_TRANSFER_TIMEOUT while a stopped
        receiving rank still holds part of it in its socket, and writes it into the pages once it
        runs again). OK was acknowledged by the receiver; NOT_STARTED sent nothing."""
        return [k for k, w in self.writes.items() if w.status in (WriteStatus.WRITER_GONE, WriteStatus.FAILED)]

    def quiet_until(self, quiet_seconds: float) -> float:
        """When the pages may be freed, once every write is resolved."""
        last = self.last_resolution_time
        return (last + quiet_seconds) if last is not None else float("-inf")

    def snapshot(self) -> Ticket:
        return Ticket(
            ticket_id=self.ticket_id,
            request_id=self.request_id,
            state=self.state,
            outcome=self.outcome,
            ar_replica_id=self.ar_replica_id,
            dit_replica_id=self.dit_replica_id,
            rows=self.rows,
            armed=self.armed,
            writes=tuple(WriteProgress(k, w.status, w.checksum, w.bytes) for k, w in self.writes.items()),
            loads=tuple(LoadProgress(k, v) for k, v in self.loads.items()),
            reason=self.reason,
            create_time=self.create_time,
            update_time=self.update_time,
            sequence=self.sequence,
            version=self.version,
            request_over=self.request_over,
            by_hand=self.by_hand,
        )

    # ------------------------------------------------------------------ events
    # Each returns True when the ticket changed (so the caller journals and notifies).

    def _apply(self, event: TicketEvent, now: float) -> None:
        new = next_state(self.ticket_id, self.state, event)
        if new is TicketState.DRAINING:
            self.drain_start_time = now
        self.state = new
        self._touch(now)

    def _touch(self, now: float) -> None:
        self.update_time = now
        self.version += 1

    def _end(self, outcome: TicketOutcome, reason: str) -> None:
        # The first end decides the outcome the client saw; later ends only repeat it.
        if not self.request_over:
            self.request_over = True
            self.outcome = outcome
            self.reason = reason

    def arm(self, incarnation_id: str, now: float) -> bool:
        if self.armed:
            if incarnation_id != self.armed_incarnation:
                raise FailedPrecondition(
                    "ALREADY_ARMED", f"ticket {self.ticket_id} was armed by another AR incarnation"
                )
            return False  # a retried ReserveTicket: same answer, no change
        if self.state is not TicketState.RESERVED:
            raise IllegalTransition(
                "TICKET_ENDED", f"ticket {self.ticket_id} is {self.state.value}; it can no longer be armed"
            )
        self._apply(TicketEvent.ARM, now)
        self.armed = True
        self.armed_incarnation = incarnation_id
        return True

    def end_request(self, outcome: TicketOutcome, reason: str, now: float, quiet_seconds: float) -> bool:
        """The request is over (cancel, timeout, failure, or the DiT is done): free what may be freed."""
        state = self.state
        if state is TicketState.RELEASED or state is TicketState.DRAINING:
            return False
        if state is TicketState.CONSUMING and self.request_over:
            return False
        self._end(outcome, reason)
        if state is TicketState.RESERVED:
            # Not armed: no AR holds a destination map, so nothing can have been written.
            self._apply(TicketEvent.ROLLBACK, now)
        elif state is TicketState.WRITING:
            if not self.unresolved() and now >= self.quiet_until(quiet_seconds):
                self._apply(TicketEvent.END_RESOLVED, now)
            else:
                self._apply(TicketEvent.END_UNRESOLVED, now)
        elif state is TicketState.READY:
            self._apply(TicketEvent.END_RESOLVED, now)
        else:
            # CONSUMING: the DiT is reading the pages; they free when it releases them.
            self._touch(now)
        return True

    def release_by_consumer(self, outcome: TicketOutcome, reason: str, now: float, quiet_seconds: float) -> bool:
        """The DiT is done with the ticket (any outcome). A ticket the broker's restart orphaned
        while READY or CONSUMING takes the DiT's outcome: the DiT saw the request end (its image
        made, its call cancelled, ...), the broker only lost track of it."""
        if self.orphaned and self.state in (TicketState.READY, TicketState.CONSUMING):
            self.outcome, self.reason, self.orphaned = outcome, reason, False
        if self.state is TicketState.CONSUMING:
            self._end(outcome, reason)
            self._apply(TicketEvent.END_RESOLVED, now)
            return True
        return self.end_request(outcome, reason, now, quiet_seconds)

    def start_consuming(self, now: float) -> bool:
        if self.state is TicketState.CONSUMING:
            return False
        self._apply(TicketEvent.START_CONSUMING, now)
        return True

    def destination_gone(self, reason: str, now: float) -> bool:
        if self.state is TicketState.RELEASED:
            return False
        self._end(TicketOutcome.FAILED, reason)
        # The outcome stays what the client saw; the reason records why the pages were freed
        # with writes possibly unresolved (their destination no longer exists).
        self.reason = reason
        self._apply(TicketEvent.DESTINATION_GONE, now)
        return True

    def orphan(self, reason: str, now: float, quiet_seconds: float) -> bool:
        """The broker restarted: the request that owned this ticket is gone.

        RESERVED rolls back, WRITING ends (draining if a write may still land); READY and
        CONSUMING keep their pages until the DiT says (re-registering) whether it still reads them.
        """
        if self.state in (TicketState.READY, TicketState.CONSUMING):
            if self.request_over:
                return False
            self._end(TicketOutcome.FAILED, reason)
            self.orphaned = True
            self._touch(now)
            return True
        return self.end_request(TicketOutcome.FAILED, reason, now, quiet_seconds)

    def try_drain(self, now: float, quiet_seconds: float) -> bool:
        if self.state is not TicketState.DRAINING or self.unresolved():
            return False
        if now < self.quiet_until(quiet_seconds):
            return False
        self._apply(TicketEvent.DRAINED, now)
        return True

    def check_write_key(self, key: WriteKey) -> None:
        if not (0 <= key.src_rank < self.src_shards) or not (0 <= key.dst_rank < self.dst_shards):
            raise BrokenInvariant(
                "UNKNOWN_RANK",
                f"ticket {self.ticket_id}: write {key} names a rank that does not exist "
                f"({self.src_shards} AR ranks, {self.dst_shards} DiT ranks)",
            )
        if key not in self.writes:
            raise BrokenInvariant("WRITE_NOT_IN_PLAN", f"ticket {self.ticket_id}: write {key} is not in the plan")

    def report_write(
        self, key: WriteKey, status: WriteStatus, checksum: int, nbytes: int, message: str, now: float
    ) -> bool:
        if status not in REPORTABLE:
            raise InvalidArgument(
                "INVALID_STATUS", f"a writer reports OK, FAILED, NOT_STARTED or IN_DOUBT, not {status.value}"
            )
        self.check_write_key(key)
        if not self.armed:
            # The writer cannot know the destination without the map; a write before arming
            # means the ticket could have been rolled back under a live write.
            raise BrokenInvariant(
                "WRITE_BEFORE_ARM", f"ticket {self.ticket_id}: write {key} reported before the ticket was armed"
            )
        record = self.writes[key]
        if record.status is WriteStatus.IN_DOUBT and status is WriteStatus.IN_DOUBT:
            return False  # a retry (the checksum of an in-doubt write may be unknown: not compared)
        if record.status is WriteStatus.IN_DOUBT and status in _AFTER_IN_DOUBT:
            pass  # the call really returned: the final word on an in-doubt write
        elif record.status is not WriteStatus.PENDING:
            if record.status is WriteStatus.WRITER_GONE:
                return False  # resolved by proof; the writer's late word changes nothing
            if (record.status, record.checksum, record.bytes) == (status, checksum, nbytes):
                return False  # a retry
            if record.status in _AFTER_IN_DOUBT and status is WriteStatus.IN_DOUBT:
                return False  # a delayed retry of the in-doubt report, after the final one
            raise BrokenInvariant(
                "CONFLICTING_REPORT",
                f"ticket {self.ticket_id}: write {key} reported {status.value} after {record.status.value}: "
                "the writer contradicts itself, so no rollback is proven",
            )
        if self.state is TicketState.RELEASED:
            return False  # released by proof (the DiT's memory is gone); nothing to protect
        record.status, record.checksum, record.bytes, record.message = status, checksum, nbytes, message
        if status is not WriteStatus.IN_DOUBT:
            # Only a final report starts the quiet period: an in-doubt write may land any time.
            self.last_resolution_time = now
        self._touch(now)
        return True

    def writer_gone(self, now: float) -> bool:
        pending = self.unresolved()
        for key in pending:
            self.writes[key].status = WriteStatus.WRITER_GONE
        if pending:
            self.last_resolution_time = now
            self._touch(now)
        return bool(pending)

    def report_load(
        self, key: LoadKey, verified: Mapping[WriteKey, int], verify_checksums: bool, now: float
    ) -> bool:
        if not 0 <= key.dst_rank < self.dst_shards:
            raise BrokenInvariant(
                "UNKNOWN_RANK", f"ticket {self.ticket_id}: load from DiT rank {key.dst_rank} of {self.dst_shards}"
            )
        if key not in self.loads:
            raise BrokenInvariant("LOAD_NOT_IN_PLAN", f"ticket {self.ticket_id}: load {key} is not in the plan")
        expected = [k for k in self.writes if k.row == key.row and k.dst_rank == key.dst_rank]
        for wkey in verified:
            if wkey not in self.writes or wkey.row != key.row or wkey.dst_rank != key.dst_rank:
                raise BrokenInvariant(
                    "WRITE_NOT_IN_PLAN", f"ticket {self.ticket_id}: load {key} verified write {wkey} not in the plan"
                )
        if self.loads[key]:
            return False  # a retry
        if self.state is not TicketState.WRITING:
            return False  # the request is over (or never armed): a late load changes nothing
        for wkey in expected:
            record = self.writes[wkey]
            if record.status is WriteStatus.PENDING:
                raise FailedPrecondition(
                    "WRITE_NOT_REPORTED", f"ticket {self.ticket_id}: write {wkey} has no report from its writer yet"
                )
            if record.status is WriteStatus.IN_DOUBT:
                # The writer gave up waiting: a load verified now could still be overwritten.
                raise FailedPrecondition(
                    "WRITE_IN_DOUBT", f"ticket {self.ticket_id}: write {wkey} is in doubt (its sender stopped waiting)"
                )
            if record.status is not WriteStatus.OK:
                raise FailedPrecondition(
                    "WRITE_FAILED", f"ticket {self.ticket_id}: write {wkey} ended {record.status.value}"
                )
            if verify_checksums:
                if wkey not in verified:
                    raise InvalidArgument(
                        "MISSING_CHECKSUM", f"ticket {self.ticket_id}: load {key} lacks the checksum of write {wkey}"
                    )
                if verified[wkey] != record.checksum:
                    # Not fatal: bytes may still be in flight; the DiT re-checks until its timeout.
                    raise FailedPrecondition(
                        "CHECKSUM_MISMATCH",
                        f"ticket {self.ticket_id}: write {wkey}: receiver has {verified[wkey]:#x}, "
                        f"writer reported {record.checksum:#x}",
                    )
        self.loads[key] = True
        self._touch(now)
        if all(self.loads.values()):
            self._apply(TicketEvent.ALL_LOADED, now)
        return True
