"""The DiT's receiving protocol for one ticket, as a pure state object (events in, commands out).

Owns the decisions of the load phase (docs/internals.md, "The request protocol"): which
`(row, dst_rank)` loads are ready to verify (every planned write into them reported OK), when the
wait fails (a write FAILED / NOT_STARTED / WRITER_GONE: TRANSFER_FAILED; IN_DOUBT: its sender
timed out, TRANSFER_TIMEOUT; the ticket ended under us; the budget ran out) and when every load
is reported. The servicer feeds it ticket snapshots (from WatchTicket), verification results and
the clock, and carries out what it answers: verify on the ranks, ReportLoad, wait, or fail.
Must never do I/O, sleep, or read a clock it is not given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvrelay.v1 import broker_pb2, common_pb2

WriteId = tuple[int, int, int]  # (row, src_rank, dst_rank)
LoadId = tuple[int, int]  # (row, dst_rank)

_FINAL_FAILURES: dict[int, str] = {
    common_pb2.WRITE_STATUS_FAILED: "FAILED",
    common_pb2.WRITE_STATUS_NOT_STARTED: "NOT_STARTED",
    common_pb2.WRITE_STATUS_WRITER_GONE: "WRITER_GONE",
}
_LOADED_STATES = (broker_pb2.TICKET_STATE_READY, broker_pb2.TICKET_STATE_CONSUMING)
_OVER_STATES = (broker_pb2.TICKET_STATE_DRAINING, broker_pb2.TICKET_STATE_RELEASED)


# ------------------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Verify:
    """Check the destination bytes of these loads on the ranks, then report each that matches."""

    loads: tuple[LoadId, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until the ticket changes, or `seconds` pass (a re-check of landing bytes)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Loaded:
    """Every load is reported and the ticket is READY: start consuming."""


@dataclass(frozen=True, slots=True)
class Fail:
    """End the request: gRPC status code name, reason, message. `budget_spent`: the load's time
    ran out with no word that ends it (no write failed or in doubt): the service asks the broker
    once more before it blames the transfer (a broker that does not answer sends no word either)."""

    code: str
    reason: str
    message: str
    budget_spent: bool = False


Command = Verify | Wait | Loaded | Fail


@dataclass(frozen=True, slots=True)
class WriteReport:
    status: int  # common_pb2.WriteStatus
    checksum: int


# ------------------------------------------------------------------------------------- protocol


class LoadProtocol:
    """One ticket's load phase. Call `next_command(now)` after every event."""

    def __init__(
        self,
        ticket_id: str,
        planned: Iterable[WriteId],
        budget_end: float,
        recheck_first_s: float = 0.01,
        recheck_max_s: float = 0.2,
    ) -> None:
        self.ticket_id = ticket_id
        self.planned: frozenset[WriteId] = frozenset(planned)
        # One load per (row, dst_rank) the plan writes into: every rank for every row, or on a
        # CFG-parallel replica each row's group only (as the broker's ticket counts them).
        self.pending: set[LoadId] = {(r, d) for r, _, d in self.planned}
        self.budget_end = budget_end
        self.recheck_first_s = recheck_first_s
        self.recheck_max_s = recheck_max_s
        self._recheck = recheck_first_s
        self._state: int = broker_pb2.TICKET_STATE_RESERVED
        self._reports: dict[WriteId, WriteReport] = {}
        self._mismatched = False
        self._verifying: frozenset[LoadId] = frozenset()
        # When each load's bytes first failed their checksums (cleared when they match): what the
        # timeout's message and the service's "still mismatching" warning tell an operator.
        self.mismatching_since: dict[LoadId, float] = {}

    # -- events ----------------------------------------------------------------------------------

    def on_ticket(self, state: int, writes: Mapping[WriteId, WriteReport], loaded: Iterable[LoadId]) -> None:
        """A ticket snapshot from the broker (WatchTicket, or a ReportLoad reply)."""
        self._state = state
        self._reports = dict(writes)
        self.pending.difference_update(loaded)

    def on_verified(self, load: LoadId, matched: bool, now: float = 0.0) -> None:
        """The ranks checked `load`'s bytes at `now` (and, when they matched, the broker took the
        report)."""
        if matched:
            self.pending.discard(load)
            self.mismatching_since.pop(load, None)
            self._recheck = self.recheck_first_s
        else:
            # Bytes may still be landing (a sender's OK is no proof): look again soon.
            self._mismatched = True
            self.mismatching_since.setdefault(load, now)

    # -- the decision ----------------------------------------------------------------------------

    def next_command(self, now: float) -> Command:
        if self._state in _LOADED_STATES and not self.pending:
            return Loaded()
        if self._state in _OVER_STATES:
            return Fail("ABORTED", "TICKET_ENDED",
                        f"ticket {self.ticket_id} ended ({broker_pb2.TicketState.Name(self._state)}) while loading")
        for key in sorted(self._reports):
            status = self._reports[key].status
            if status == common_pb2.WRITE_STATUS_IN_DOUBT:
                # The sender stopped waiting (its transfer timeout): the request fails; the pages
                # stay with the ticket until the write's real end is reported.
                return Fail("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT",
                            f"ticket {self.ticket_id}: write row={key[0]} src={key[1]} dst={key[2]} is in doubt: "
                            "its sender timed out")
            if status in _FINAL_FAILURES:
                return Fail("UNAVAILABLE", "TRANSFER_FAILED",
                            f"ticket {self.ticket_id}: write row={key[0]} src={key[1]} dst={key[2]} ended "
                            f"{_FINAL_FAILURES[status]}")
        ready = tuple(sorted(
            load for load in self.pending
            if all(self._status(k) == common_pb2.WRITE_STATUS_OK for k in self.planned if (k[0], k[2]) == load)
        ))  # fmt: skip
        if ready and (not self._mismatched or frozenset(ready) != self._verifying):
            self._verifying = frozenset(ready)
            self._mismatched = False
            return Verify(ready)
        if now >= self.budget_end:
            message = f"ticket {self.ticket_id}: rows/ranks {sorted(self.pending)} not loaded in time"
            mismatching = sorted(set(self.mismatching_since) & self.pending)
            if mismatching:
                # Not a slow sender: its bytes were reported written and are not what it reported.
                message += (f"; the bytes of rows/ranks {mismatching} were reported written but never matched "
                            f"their checksums (since {now - min(self.mismatching_since[m] for m in mismatching):.2f}s)")
            return Fail("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT", message, budget_spent=True)
        wait = self.budget_end - now
        if self._mismatched:
            wait = min(wait, self._recheck)
            self._recheck = min(self.recheck_max_s, self._recheck * 2)
            self._mismatched = False
            self._verifying = frozenset()
        return Wait(wait)

    def _status(self, key: WriteId) -> int:
        report = self._reports.get(key)
        return common_pb2.WRITE_STATUS_UNSPECIFIED if report is None else report.status


__all__ = ["Command", "Fail", "LoadProtocol", "Loaded", "Verify", "Wait", "WriteReport"]
