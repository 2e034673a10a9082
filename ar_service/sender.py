"""The AR replica's write ledger and its reports to the broker (the sending side's bookkeeping).

Owns what this incarnation knows about every write it was handed: arming in progress, in
flight, in doubt (the rank's transport stopped waiting while its call still runs), or final
(OK / FAILED / NOT_STARTED) and whether the broker has acknowledged the report.
It answers the broker's polls (`HeartbeatResponse.poll_writes`) from that knowledge:

- a final write is reported (again: `ReportWrite` is idempotent) until the broker acknowledges;
- a write in flight or in doubt, or of a ticket whose `ReserveTicket` answer has not arrived, is
  listed as unresolved in the next heartbeat (absence is no proof: the answer may still be on
  its way); an in-doubt write becomes final only when the rank's transport call has returned
  (`CollectFinished`), and `needs_collect()` says while the service must keep asking;
- a write this incarnation has never heard of was never begun by it: `NOT_STARTED`, and the
  ledger remembers that, so the write can never start afterwards.

It must never report a write twice with different statuses (the broker fences a writer that
contradicts itself), so every report is derived from the one final outcome recorded here.
All methods run on the service's event loop; the state changes are synchronous (no await between
a check and the change it guards), which is what makes "check unknown, then mark" atomic.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from kvrelay.errors import KvRelayServerError
from kvrelay.logging import get_logger
from kvrelay.transfer.convert import outcome_to_report, outcomes_to_report, writes_from_proto
from kvrelay.transfer.planner import PlannedWrite
from kvrelay.transfer.transport import WriteOutcome
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

log = get_logger(__name__)

WriteId = tuple[str, int, int, int]  # (ticket_id, row, src_rank, dst_rank)

# Codes after which a retry of the same idempotent RPC can succeed.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})  # fmt: skip
# How many tickets' final outcomes to keep after the broker acknowledged them, to answer a poll
# with the real outcome rather than "never heard of it".
HISTORY = 4096


def write_id(ticket_id: str, w: PlannedWrite | WriteOutcome) -> WriteId:
    return (ticket_id, w.row, w.src_rank, w.dst_rank)


@dataclass(slots=True)
class _TicketWrites:
    # Not final yet: sent or about to be, including in-doubt ones (their calls still run).
    in_flight: set[WriteId] = field(default_factory=set)
    in_doubt: dict[WriteId, WriteOutcome] = field(default_factory=dict)
    final: dict[WriteId, WriteOutcome] = field(default_factory=dict)
    acknowledged: set[WriteId] = field(default_factory=set)


class WriteLedger:
    def __init__(self) -> None:
        self._arming: set[str] = set()
        self._tickets: OrderedDict[str, _TicketWrites] = OrderedDict()
        # Tickets answered NOT_STARTED in full before we knew them: they must never start.
        self._refused: set[str] = set()

    # -- transitions -------------------------------------------------------------------------------

    def begin_arming(self, ticket_id: str) -> None:
        """Before ReserveTicket: from now on a poll about this ticket is answered 'unresolved'."""
        self._arming.add(ticket_id)

    def end_arming(self, ticket_id: str) -> None:
        """ReserveTicket was refused (the ticket is not armed) or its outcome is settled."""
        self._arming.discard(ticket_id)

    def start(self, ticket_id: str, writes: Sequence[PlannedWrite]) -> bool:
        """Mark `writes` in flight. False when nothing may be sent: the ticket's writes were
        already answered NOT_STARTED (a poll came first), or one of them already has an outcome
        or is in flight (a second attempt at the same ticket: its first outcome is what the
        broker was, or will be, told, so sending again could land bytes behind a final report)."""
        self._arming.discard(ticket_id)
        if ticket_id in self._refused:
            return False
        entry = self._tickets.setdefault(ticket_id, _TicketWrites())
        wids = [write_id(ticket_id, w) for w in writes]
        if any(wid in entry.final or wid in entry.in_flight for wid in wids):
            return False
        entry.in_flight.update(wids)
        return True

    def finish(self, ticket_id: str, outcome: WriteOutcome) -> WriteOutcome:
        """Record what is known of one write: an IN_DOUBT outcome keeps it in flight; the first
        final outcome recorded wins (see module doc). Returns what to report."""
        entry = self._tickets.setdefault(ticket_id, _TicketWrites())
        wid = write_id(ticket_id, outcome)
        known = entry.final.get(wid)
        if known is not None:
            return known
        if not outcome.final:
            entry.in_flight.add(wid)
            entry.in_doubt[wid] = outcome
            return outcome
        entry.in_flight.discard(wid)
        entry.in_doubt.pop(wid, None)
        entry.final[wid] = outcome
        return outcome

    def acknowledge(self, ticket_id: str, outcome: WriteOutcome) -> None:
        """The broker took a report. Only a final one ends the reporting of that write."""
        entry = self._tickets.get(ticket_id)
        if entry is not None and outcome.final:
            entry.acknowledged.add(write_id(ticket_id, outcome))
            self._trim()

    def _trim(self) -> None:
        while len(self._tickets) > HISTORY:
            oldest, entry = next(iter(self._tickets.items()))
            if entry.in_flight or len(entry.acknowledged) < len(entry.final):
                break
            del self._tickets[oldest]

    # -- queries -----------------------------------------------------------------------------------

    def pending_reports(self) -> list[tuple[str, WriteOutcome]]:
        """Final outcomes the broker has not acknowledged yet."""
        return [
            (tid, o)
            for tid, entry in self._tickets.items()
            for wid, o in entry.final.items()
            if wid not in entry.acknowledged
        ]

    def in_flight(self) -> list[WriteId]:
        return [wid for entry in self._tickets.values() for wid in entry.in_flight]

    def in_doubt(self) -> list[tuple[str, WriteOutcome]]:
        """Writes whose transport call has not returned though the rank stopped waiting."""
        return [(tid, o) for tid, entry in self._tickets.items() for o in entry.in_doubt.values()]

    def needs_collect(self) -> bool:
        """True while some rank must still be asked whether its in-doubt calls returned."""
        return any(entry.in_doubt for entry in self._tickets.values())

    def busy_tickets(self) -> list[str]:
        """Tickets with writes in flight, in doubt or being armed (a clean stop waits for them)."""
        return sorted(self._arming | {tid for tid, e in self._tickets.items() if e.in_flight})

    def answer_poll(self, polled: Iterable[WriteId]) -> tuple[list[WriteId], list[tuple[str, WriteOutcome]]]:
        """(unresolved, to_report) for the writes the broker asks about."""
        unresolved: list[WriteId] = []
        to_report: list[tuple[str, WriteOutcome]] = []
        for wid in polled:
            ticket_id, row, src, dst = wid
            entry = self._tickets.get(ticket_id)
            if ticket_id in self._arming or (entry is not None and wid in entry.in_flight):
                unresolved.append(wid)
            elif entry is not None and wid in entry.final:
                to_report.append((ticket_id, entry.final[wid]))
            else:
                # Never heard of: this incarnation never began it, and now never will.
                self._refused.add(ticket_id)
                outcome = WriteOutcome(
                    row, src, dst, "NOT_STARTED", 0, 0, "the writer never received this write"
                )
                to_report.append((ticket_id, self.finish(ticket_id, outcome)))
        return unresolved, to_report


def settle_outcomes(
    writes: Sequence[PlannedWrite],
    reported: Iterable[WriteOutcome],
    *,
    sent: bool,
    why: str = "",
) -> list[WriteOutcome]:
    """One outcome per planned write, from what the ranks `reported`. A write without a reported
    outcome is NOT_STARTED only when the write command was never `sent` to the ranks; once it
    was, nobody can say how far the rank got (its handler raised, its reply was lost, it died
    mid-call), so the write is IN_DOUBT (`why` says why): never FAILED, which is final and
    would let the broker free pages the still-running transport call may write into. It stays in
    doubt until the rank's `CollectFinished` returns the call's real end, or the broker sees this
    incarnation gone."""
    known = {(o.row, o.src_rank, o.dst_rank): o for o in reported}
    settled = []
    for w in writes:
        o = known.get((w.row, w.src_rank, w.dst_rank))
        if o is None and sent:
            o = WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", w.num_bytes, 0,
                             why or "the rank gave no outcome for a write it was sent")  # fmt: skip
        elif o is None:
            o = WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, why or "never began")
        settled.append(o)
    return settled


# -- the write protocol (pure: events in, commands out; the servicer only carries them out) -------


@dataclass(frozen=True, slots=True)
class Arm:
    """Command: arm the ticket (ReserveTicket). After it nothing stops for free: every write
    the broker expects ends with a report."""


@dataclass(frozen=True, slots=True)
class Abandon:
    """Command: drop the ranks' KV, roll the unarmed ticket back when `rollback` names a ticket
    outcome (CANCELLED, TIMED_OUT), and fail the request with `failure`."""

    failure: KvRelayServerError
    rollback: str | None = None


def after_prefill(*, cancel_requested: bool, deadline_left_s: float, min_transfer_s: float) -> Arm | Abandon:
    """The last point where stopping is free: nothing is armed, the ticket can roll back."""
    if cancel_requested:
        return Abandon(KvRelayServerError(
            grpc.StatusCode.CANCELLED, "CANCELLED", "the request was cancelled during prefill"
        ), "CANCELLED")  # fmt: skip
    if deadline_left_s <= min_transfer_s:
        return Abandon(KvRelayServerError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "TIMED_OUT", "the deadline passed during prefill"
        ), "TIMED_OUT")  # fmt: skip
    return Arm()


def after_arming(answer: object) -> Abandon | None:
    """What ReserveTicket's answer means: None (go on to the writes) for a reply; the broker's
    refusal (a KvRelayServerError) or no answer at all (None: settled in the background, see
    ArServicer._settle_lost_arming) abandon the request, the KV dropped."""
    if answer is None:
        return Abandon(KvRelayServerError(
            grpc.StatusCode.UNAVAILABLE, "BROKER_UNAVAILABLE", "ReserveTicket got no answer from the broker"
        ))  # fmt: skip
    if isinstance(answer, KvRelayServerError):
        return Abandon(answer)
    return None


@dataclass(frozen=True, slots=True)
class SendWrites:
    """Command: send the ticket's WriteTicket to every rank with this transfer timeout."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class EndWrites:
    """Command: the write phase is over. Report `outcomes` (one per planned write), drop the
    ranks' KV when nothing was sent, keep collecting while any outcome is in doubt, and answer
    the request with `failure` (None: success, `ok_bytes` written)."""

    outcomes: tuple[WriteOutcome, ...]
    sent: bool
    failure: KvRelayServerError | None
    ok_bytes: int

    @property
    def in_doubt(self) -> bool:
        return any(not o.final for o in self.outcomes)


class WriteProtocol:
    """One armed ticket's write phase on the AR: which writes to send, and what to report and
    answer from what the ranks said. Every path ends in exactly one `EndWrites` whose outcomes
    cover every planned write: NOT_STARTED only if nothing was sent, IN_DOUBT for anything sent
    whose end is unknown (settle_outcomes), never FAILED for an unknown."""

    def __init__(self, ticket_id: str, writes: Sequence[PlannedWrite], min_transfer_s: float) -> None:
        self.ticket_id = ticket_id
        self.writes = tuple(writes)
        self.min_transfer_s = min_transfer_s
        self.timeout_s = 0.0
        self.sent = False

    def _end(self, reported: Iterable[WriteOutcome], failure: KvRelayServerError | None, why: str = "") -> EndWrites:
        outcomes = tuple(settle_outcomes(self.writes, reported, sent=self.sent, why=why))
        return EndWrites(outcomes, self.sent, failure, sum(o.bytes for o in outcomes if o.ok))

    # -- events --------------------------------------------------------------------------------

    def on_armed(
        self, *, plan_mismatch: str, writing: bool, ticket_state: str, transfer_timeout_s: float, deadline_left_s: float
    ) -> SendWrites | EndWrites:
        """The broker armed the ticket (ReserveTicket answered): send, or end with nothing sent.
        `plan_mismatch` ("" when none) says how the plan this replica was handed differs from
        the broker's arming reply (`arming_mismatch`)."""
        if plan_mismatch:
            # The plan is not the broker's authoritative arming reply (forged, stale, or a broker
            # and a replica that disagree): writing would land bytes where nobody expects them,
            # possibly in pages of another ticket. Nothing is sent; every write is NOT_STARTED.
            return self._end((), KvRelayServerError(
                grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH",
                f"ticket {self.ticket_id}: {plan_mismatch}; nothing was written",
            ))  # fmt: skip
        if not writing:
            return self._end((), KvRelayServerError(
                grpc.StatusCode.CANCELLED, "REQUEST_ENDED", f"ticket {self.ticket_id} is {ticket_state}: the request ended"
            ))  # fmt: skip
        timeout_s = min(transfer_timeout_s, deadline_left_s)
        if timeout_s < self.min_transfer_s:
            return self._end((), KvRelayServerError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "no time left for the transfer"
            ))  # fmt: skip
        self.timeout_s = timeout_s
        self.sent = True
        return SendWrites(timeout_s)

    def on_written(self, reported: Iterable[WriteOutcome]) -> EndWrites:
        """Every rank answered the write command with its outcomes."""
        end = self._end(reported, None)
        bad = [o for o in end.outcomes if not o.ok]
        doubtful = [o for o in bad if not o.final]
        failure = None
        if doubtful:
            # The transfer timed out with calls still running (or a rank gave no outcome): the
            # request fails now, the pages stay held (IN_DOUBT) until the call's real end.
            failure = KvRelayServerError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT",
                f"{len(doubtful)} of {len(self.writes)} writes still in flight after {self.timeout_s:.1f}s; "
                f"first: {doubtful[0].message}",
            )  # fmt: skip
        elif bad:
            failure = KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED",
                f"{len(bad)} of {len(self.writes)} writes not OK; first: {bad[0].status} {bad[0].message}",
            )  # fmt: skip
        return EndWrites(end.outcomes, end.sent, failure, end.ok_bytes)

    def on_rank_error(self, reported: Iterable[WriteOutcome], message: str) -> EndWrites:
        """A rank's handler raised (or its answer was lost): the ranks that answered give
        `reported`; the rest are in doubt, not FAILED (their calls may still run)."""
        return self._end(
            reported,
            KvRelayServerError(grpc.StatusCode.INTERNAL, "WRITE_FAILED", message),
            f"rank error, the write may still land: {message}",
        )

    def on_ranks_lost(self, message: str) -> EndWrites:
        """A rank died or hung mid-write (the replica fail-stops): nothing it sent can be
        collected; the broker resolves its writes when it sees this incarnation gone."""
        return self._end(
            (),
            KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", message),
            "a worker rank died or hung during the write; the write may still land",
        )


def arming_mismatch(
    arming: broker_pb2.ReserveTicketResponse,
    plan: broker_pb2.TicketPlan | None,
    expected: Sequence[PlannedWrite],
) -> str:
    """How what this replica would write differs from the broker's authoritative arming reply
    ("" when it does not). The writes, their destinations (DiT replica, rank regions: endpoint,
    address, length, IPC handle), the pages and the geometry always come from `arming`, the
    ReserveTicket answer for this very ticket, this replica and this incarnation; this checks
    (1) that `arming` is self-consistent: its writes are exactly what the pure planner makes of its
    own rows, pages, geometry and parallelism for this replica's ranks (`expected`), and every page
    id lies inside the DiT's pool, so no write can leave the ticket's own pages; and (2) that a
    `plan` handed with Prefill is, field by field, the same plan (a forged, stale or foreign plan is
    refused, never partly followed). Pure: the field named first is what the error names."""
    if writes_from_proto(arming.writes) != tuple(expected):
        return "ReserveTicketResponse.writes differ from the plan of the ticket's own rows and pages"
    num_pages = arming.dit_num_pages
    for r in arming.ticket.rows:
        outside = [p for p in r.page_ids if p >= num_pages]
        if outside:
            return f"ReserveTicketResponse.ticket.rows[{r.row}].page_ids {outside[:4]} outside the DiT pool of {num_pages} pages"
    if plan is None:
        return ""
    mine, theirs = plan.ticket, arming.ticket
    for name in ("ticket_id", "request_id", "ar_replica_id", "dit_replica_id", "sequence"):
        if getattr(mine, name) != getattr(theirs, name):
            return f"plan.ticket.{name} {getattr(mine, name)!r} is not the broker's {getattr(theirs, name)!r}"
    if sorted((r.row, r.num_tokens, tuple(r.page_ids)) for r in mine.rows) != sorted(
        (r.row, r.num_tokens, tuple(r.page_ids)) for r in theirs.rows
    ):
        return "plan.ticket.rows (pages or token counts) are not the broker's"
    for name in ("writes", "destinations", "dit_geometry", "dit_parallelism", "dit_num_pages", "verify_checksums"):
        if getattr(plan, name) != getattr(arming, name):
            return f"plan.{name} is not the broker's (ReserveTicketResponse.{name})"
    return ""


def write_key_proto(wid: WriteId) -> common_pb2.WriteKey:
    return common_pb2.WriteKey(ticket_id=wid[0], row=wid[1], src_rank=wid[2], dst_rank=wid[3])


class WriteReporter:
    """Sends ReportWrite for final outcomes, retried (the RPC is idempotent) with a deadline per try."""

    def __init__(
        self,
        stub: broker_pb2_grpc.BrokerServiceStub,
        ledger: WriteLedger,
        replica_id: str,
        incarnation_id: str,
        *,
        rpc_timeout_s: float = 5.0,
    ) -> None:
        self.stub = stub
        self.ledger = ledger
        self.replica_id = replica_id
        self.incarnation_id = incarnation_id
        self.rpc_timeout_s = rpc_timeout_s

    async def report(self, ticket_id: str, outcome: WriteOutcome, budget_s: float = 30.0) -> bool:
        """Report one outcome (final, or IN_DOUBT); True once the broker acknowledged it. A final
        report still unacknowledged after `budget_s` stays pending: heartbeats retry it. An
        IN_DOUBT report is not retried past its budget: the write stays unresolved at the broker
        either way, and its final report follows."""
        return await self.report_all(ticket_id, [outcome], budget_s)

    async def report_all(
        self, ticket_id: str, outcomes: Iterable[WriteOutcome], budget_s: float = 30.0
    ) -> bool:
        """Report every outcome of one ticket in one ReportWrite (one broker commit; one call per
        write before), as `report` does for one: retried until `budget_s`, acknowledged together."""
        outcomes = [self.ledger.finish(ticket_id, o) for o in outcomes]
        if not outcomes:
            return True
        if len(outcomes) == 1:
            request = outcome_to_report(outcomes[0], ticket_id, self.replica_id, self.incarnation_id)
        else:
            request = outcomes_to_report(outcomes, ticket_id, self.replica_id, self.incarnation_id)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + budget_s
        delay = 0.05
        while True:
            try:
                await self.stub.ReportWrite(request, timeout=self.rpc_timeout_s)
                for o in outcomes:
                    self.ledger.acknowledge(ticket_id, o)
                return True
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code not in RETRYABLE:
                    # The broker refused it for good (released ticket, stale incarnation, fence):
                    # retrying would be refused the same way; nothing more can be proven.
                    log.warning(
                        "report_write_refused", ticket_id=ticket_id,
                        writes=[(o.row, o.src_rank, o.dst_rank) for o in outcomes],
                        code=code.name, details=err.details(),
                    )  # fmt: skip
                    for o in outcomes:
                        self.ledger.acknowledge(ticket_id, o)
                    return False
                if loop.time() + delay >= give_up:
                    log.warning(
                        "report_write_pending", ticket_id=ticket_id, code=code.name, details=err.details()
                    )
                    return False
            await asyncio.sleep(delay * (1 + random.random() * 0.5))
            delay = min(delay * 2, 1.0)

    async def report_pending(self, budget_s: float = 2.0) -> None:
        """Retry every unacknowledged report once more (called on each heartbeat)."""
        pending = self.ledger.pending_reports()
        if pending:
            await asyncio.gather(*(self.report(tid, o, budget_s) for tid, o in pending))


def broker_stub(channel: grpc.aio.Channel) -> broker_pb2_grpc.BrokerServiceStub:
    return broker_pb2_grpc.BrokerServiceStub(channel)


__all__ = ["arming_mismatch", "WriteLedger", "WriteReporter", "WriteProtocol", "Arm", "Abandon", "after_prefill", "after_arming", "SendWrites", "EndWrites", "settle_outcomes", "write_id", "write_key_proto", "broker_stub", "broker_pb2"]
