"""A hypothesis state machine over BrokerCore: random interleavings of the whole lifecycle.

Several AR and DiT replicas (TP 1 and 2), and rules for create / arm / write reports (OK,
FAILED, NOT_STARTED, IN_DOUBT, retries, reports outside the plan) / late final reports of
in-doubt writes / loads / consuming / release / timeout / cancel / new incarnations / lease
expiry / broker restart from the journal / an operator's forced forget (`forget_replica(force=True)`)
of a replica that is down, followed by a new incarnation under its id. After every step: no page in two tickets, accounting
exact, no page of a ticket with an unresolved write is free, no page of an in-doubt write (as
this test itself recorded it, not as the broker says) is free or in another ticket's
reservation, and no resolved, quiet DRAINING ticket survives a tick. At the end every writer is
resolved and every ticket must reach RELEASED with every page free.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.pool import PageState
from kvrelay.broker.registry import ReplicaRole, ReplicaSpec
from kvrelay.broker.tickets import (
    HOLDING_STATES,
    BrokenInvariant,
    BrokerError,
    FailedPrecondition,
    Ticket,
    TicketOutcome,
    TicketState,
    WriteKey,
    WriteStatus,
)
from tests.broker.helpers import ManualClock, ar_spec, checksum_of, dit_spec, new_incarnation

QUIET = 2.0
LEASE = 30.0


class BrokerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvrelay-broker-"))
        self.clock = ManualClock()
        self.core = self._open()
        self.specs: dict[str, ReplicaSpec] = {}
        # dit-2 is CFG-parallel: two groups of one rank, a page pool each (row r in group r % 2).
        for spec in (ar_spec("ar-0", tp=1), ar_spec("ar-1", tp=2), dit_spec("dit-0", tp=1, num_pages=12),
                     dit_spec("dit-1", tp=2, num_pages=20), dit_spec("dit-2", tp=1, num_pages=6, cfg_parallel_size=2)):
            self.core.register_replica(spec)
            self.specs[spec.replica_id] = spec
        self.ticket_ids: list[str] = []
        self.counter = 0
        # The test's own record of writes reported IN_DOUBT and not finally resolved since:
        # (ticket_id, key) -> (dit replica, dit incarnation, pages, ar replica, ar incarnation).
        # Pages are (CFG group, page id): a CFG-parallel DiT's groups each have their own ids.
        self.in_doubt: dict[tuple[str, WriteKey], tuple[str, str, frozenset[tuple[int, int]], str, str]] = {}
        # Tickets a forced forget of their DiT released: their memory is as good as gone.
        self.destination_forgotten: set[str] = set()

    def _open(self) -> BrokerCore:
        return BrokerCore(self.dir / "journal.sqlite", clock=self.clock, lease_seconds=LEASE,
                          drain_quiet_seconds=QUIET, journal_synchronous="OFF")

    def teardown(self) -> None:
        try:
            self._resolve_everything()
        finally:
            self.core.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _live(self) -> list[Ticket]:
        return self.core.list_tickets()

    def _pick(self, data: st.DataObject) -> Ticket | None:
        live = self._live()
        return data.draw(st.sampled_from(live)) if live else None

    def _try(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - test plumbing
        try:
            return fn(*args, **kwargs)
        except BrokerError as err:
            return err

    # -------------------------------------------------------------------- rules

    def _pages(self, t: Ticket) -> list[tuple[int, int]]:
        groups = self.specs[t.dit_replica_id].cfg_parallel_size
        return [(r.row % groups, p) for r in t.rows for p in r.page_ids]

    @precondition(lambda self: len(self._live()) < 6)
    @rule(ar=st.sampled_from(["ar-0", "ar-1"]), dit=st.sampled_from(["dit-0", "dit-1", "dit-2"]),
          rows=st.lists(st.integers(1, 80), min_size=1, max_size=2))
    def create(self, ar: str, dit: str, rows: list[int]) -> None:
        self.counter += 1
        result = self._try(self.core.create_ticket, f"req-{self.counter}", ar, dit, rows)
        if isinstance(result, Ticket):
            self.ticket_ids.append(result.ticket_id)
            assert result.state is TicketState.RESERVED
        elif isinstance(result, BrokerError):
            groups = self.specs[dit].cfg_parallel_size
            need = [sum(-(-n // 16) for r, n in enumerate(rows) if r % groups == g) for g in range(groups)]
            total = self.specs[dit].num_pages
            assert result.reason in ("NEVER_FITS", "REPLICA_FENCED", "REPLICA_DOWN"), result
            assert (result.reason == "NEVER_FITS") == (max(need) > total)

    @rule(data=st.data())
    def arm(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is not None:
            self._arm(t)

    def _arm(self, t: Ticket) -> None:
        ar = self.specs[t.ar_replica_id]
        result = self._try(self.core.arm_ticket, t.ticket_id, ar.replica_id, ar.incarnation_id)
        if not isinstance(result, BrokerError):
            assert result.ticket.armed

    @rule(data=st.data(), status=st.sampled_from([WriteStatus.OK, WriteStatus.OK, WriteStatus.FAILED,
                                                  WriteStatus.NOT_STARTED, WriteStatus.IN_DOUBT,
                                                  WriteStatus.IN_DOUBT]))
    def report_write(self, data: st.DataObject, status: WriteStatus) -> None:
        t = self._pick(data)
        if t is None or not t.armed:
            return
        w = data.draw(st.sampled_from(t.writes))
        ar = self.specs[t.ar_replica_id]
        before = self.core.get_ticket(t.ticket_id)
        result = self._try(self.core.report_write, t.ticket_id, w.key, replica_id=ar.replica_id,
                           incarnation_id=ar.incarnation_id, status=status,
                           checksum=checksum_of(t.ticket_id, w.key), nbytes=64)
        if isinstance(result, BrokenInvariant):
            assert result.reason == "CONFLICTING_REPORT"
            assert self.core.get_replica(ar.replica_id).fenced
        elif isinstance(result, BrokerError):
            assert result.reason in ("STALE_INCARNATION",), result
        else:
            prior = next(x for x in before.writes if x.key == w.key)
            now_status = next(x for x in result.writes if x.key == w.key).status
            if prior.status is WriteStatus.PENDING and before.state is not TicketState.RELEASED:
                assert now_status is status
            if prior.status is WriteStatus.IN_DOUBT and status in (WriteStatus.OK, WriteStatus.FAILED) \
                    and before.state is not TicketState.RELEASED:
                assert now_status is status, "the final report of an in-doubt write resolves it"
            self._record(t, w.key, status, now_status)

    def _record(self, t: Ticket, key: WriteKey, reported: WriteStatus, now_status: WriteStatus) -> None:
        """Track in-doubt writes from what the writer said, independently of the broker's view."""
        ar = self.specs[t.ar_replica_id]
        if reported is WriteStatus.IN_DOUBT and now_status is WriteStatus.IN_DOUBT:
            self.in_doubt[(t.ticket_id, key)] = (
                t.dit_replica_id, self.specs[t.dit_replica_id].incarnation_id, frozenset(self._pages(t)),
                ar.replica_id, ar.incarnation_id,
            )
        elif reported in (WriteStatus.OK, WriteStatus.FAILED) and now_status is reported:
            self.in_doubt.pop((t.ticket_id, key), None)

    @rule(data=st.data())
    def sender_times_out(self, data: st.DataObject) -> None:
        """The seed's hazard in one step: the sender stops waiting on some writes (IN_DOUBT), the
        rest end, and the DiT's receive times out and releases the ticket."""
        t = self._pick(data)
        if t is None or t.state is not TicketState.RESERVED:
            return
        self._arm(t)
        t = self.core.get_ticket(t.ticket_id)
        if t.state is not TicketState.WRITING:
            return
        ar = self.specs[t.ar_replica_id]
        doubtful = data.draw(st.sets(st.sampled_from([w.key for w in t.writes]), min_size=1))
        for w in t.writes:
            status = WriteStatus.IN_DOUBT if w.key in doubtful else WriteStatus.OK
            result = self._try(self.core.report_write, t.ticket_id, w.key, replica_id=ar.replica_id,
                               incarnation_id=ar.incarnation_id, status=status,
                               checksum=checksum_of(t.ticket_id, w.key), nbytes=64)
            if isinstance(result, Ticket):
                self._record(t, w.key, status, next(x for x in result.writes if x.key == w.key).status)
        after = self.core.release_ticket(t.ticket_id, TicketOutcome.TIMED_OUT, "TRANSFER_TIMEOUT",
                                         replica_id=t.dit_replica_id)
        assert after.state is TicketState.DRAINING, "a timed-out ticket with in-doubt writes drains"

    @rule(data=st.data(), status=st.sampled_from([WriteStatus.OK, WriteStatus.FAILED]))
    def in_doubt_call_returns(self, data: st.DataObject, status: WriteStatus) -> None:
        """The transport call of an in-doubt write really returns (late): its final report."""
        if not self.in_doubt:
            return
        tid, key = data.draw(st.sampled_from(sorted(self.in_doubt, key=lambda x: (x[0], x[1]))))
        _, _, _, ar_id, ar_inc = self.in_doubt[(tid, key)]
        result = self._try(self.core.report_write, tid, key, replica_id=ar_id, incarnation_id=ar_inc,
                           status=status, checksum=checksum_of(tid, key), nbytes=64)
        if isinstance(result, Ticket):
            now_status = next(x for x in result.writes if x.key == key).status
            if result.state is not TicketState.RELEASED:
                assert now_status is status
            self.in_doubt.pop((tid, key), None)
        else:
            # The writer restarted meanwhile (stale incarnation): the write is WRITER_GONE.
            assert isinstance(result, FailedPrecondition) and result.reason == "STALE_INCARNATION", result

    @rule(data=st.data())
    def happy_step(self, data: st.DataObject) -> None:
        """Move one ticket 1-5 steps along the happy path, so READY and CONSUMING are reached often."""
        t = self._pick(data)
        for _ in range(data.draw(st.integers(1, 5))):
            if t is None or t.state is TicketState.RELEASED:
                return
            if t.state is TicketState.RESERVED:
                self._arm(t)
            elif t.state is TicketState.WRITING and t.unresolved_writes():
                self._write_ok(t)
            elif t.state is TicketState.WRITING:
                self._load(t)
            elif t.state is TicketState.READY:
                self._try(self.core.start_consuming, t.ticket_id)
            elif t.state is TicketState.CONSUMING:
                self.core.release_ticket(t.ticket_id, TicketOutcome.OK, replica_id=t.dit_replica_id)
            t = self.core.get_ticket(t.ticket_id)

    @rule(data=st.data())
    def every_write_ok(self, data: st.DataObject) -> None:
        """The common path: the writer finishes every write (so READY and CONSUMING are reached)."""
        t = self._pick(data)
        if t is not None and t.armed:
            self._write_ok(t)

    def _write_ok(self, t: Ticket) -> None:
        ar = self.specs[t.ar_replica_id]
        for k in t.unresolved_writes():
            result = self._try(self.core.report_write, t.ticket_id, k, replica_id=ar.replica_id,
                               incarnation_id=ar.incarnation_id, status=WriteStatus.OK,
                               checksum=checksum_of(t.ticket_id, k))
            if isinstance(result, Ticket):
                self._record(t, k, WriteStatus.OK, next(x for x in result.writes if x.key == k).status)

    @rule(data=st.data())
    def every_load(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is not None:
            self._load(t)

    def _load(self, t: Ticket) -> None:
        for ld in t.loads:
            dit = self.specs[t.dit_replica_id]
            verified = {w.key: checksum_of(t.ticket_id, w.key) for w in t.writes
                        if w.key.row == ld.key.row and w.key.dst_rank == ld.key.dst_rank}
            self._try(self.core.report_load, t.ticket_id, ld.key.row, ld.key.dst_rank,
                      replica_id=dit.replica_id, incarnation_id=dit.incarnation_id, verified=verified)

    @rule(data=st.data())
    def report_outside_plan(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is None or not t.armed:
            return
        ar = self.specs[t.ar_replica_id]
        if t.armed and self.core.get_ticket(t.ticket_id).writes and ar.incarnation_id:
            bad = WriteKey(9, 0, 0)
            result = self._try(self.core.report_write, t.ticket_id, bad, replica_id=ar.replica_id,
                               incarnation_id=ar.incarnation_id, status=WriteStatus.OK)
            assert isinstance(result, BrokerError)
            if isinstance(result, BrokenInvariant):
                assert self.core.heartbeat(ar.replica_id, ar.incarnation_id).fenced

    @rule(data=st.data())
    def report_load(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is None:
            return
        ld = data.draw(st.sampled_from(t.loads))
        dit = self.specs[t.dit_replica_id]
        verified = {w.key: checksum_of(t.ticket_id, w.key) for w in t.writes
                    if w.key.row == ld.key.row and w.key.dst_rank == ld.key.dst_rank}
        result = self._try(self.core.report_load, t.ticket_id, ld.key.row, ld.key.dst_rank,
                           replica_id=dit.replica_id, incarnation_id=dit.incarnation_id, verified=verified)
        if isinstance(result, BrokerError):
            assert isinstance(result, FailedPrecondition) and result.reason in (
                "WRITE_NOT_REPORTED", "WRITE_FAILED", "STALE_INCARNATION"
            ), result
        elif result.state is TicketState.READY:
            assert all(w.status is WriteStatus.OK for w in result.writes), "READY means every write final and OK"

    @rule(data=st.data())
    def start_consuming(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is not None:
            self._try(self.core.start_consuming, t.ticket_id)

    @rule(data=st.data(), outcome=st.sampled_from(list(TicketOutcome)))
    def release(self, data: st.DataObject, outcome: TicketOutcome) -> None:
        t = self._pick(data)
        if t is None:
            return
        after = self.core.release_ticket(t.ticket_id, outcome, replica_id=t.dit_replica_id)
        if t.armed and after.unresolved_writes():
            assert after.state is TicketState.DRAINING

    @rule(data=st.data(), outcome=st.sampled_from([TicketOutcome.CANCELLED, TicketOutcome.TIMED_OUT,
                                                   TicketOutcome.FAILED]))
    def cancel(self, data: st.DataObject, outcome: TicketOutcome) -> None:
        t = self._pick(data)
        if t is None:
            return
        after = self.core.cancel_ticket(t.ticket_id, outcome)
        if not t.armed:
            assert after.state is TicketState.RELEASED, "rollback before arming frees at once"

    @rule(replica=st.sampled_from(["ar-0", "ar-1", "dit-0", "dit-1", "dit-2"]))
    def new_incarnation(self, replica: str) -> None:
        spec = new_incarnation(self.specs[replica])
        self.core.register_replica(spec)
        self.specs[replica] = spec
        # Proof: the old writer's process is gone (AR), or the destination memory is (DiT).
        self.in_doubt = {k: v for k, v in self.in_doubt.items() if replica not in (v[0], v[3])}
        assert not self.core.get_replica(replica).fenced
        for t in self._live():
            if spec.role is ReplicaRole.DIT:
                assert t.dit_replica_id != replica, "a restarted DiT's tickets are released"
            elif t.ar_replica_id == replica and t.armed:
                assert not t.unresolved_writes()

    @rule(replica=st.sampled_from(["ar-0", "ar-1", "dit-0", "dit-1", "dit-2"]), stopped=st.booleans())
    def forget_by_force(self, replica: str, stopped: bool) -> None:
        spec = self.specs[replica]
        if stopped:
            self._try(self.core.deregister_replica, replica, spec.incarnation_id)  # down from now
        up, fenced = self.core.get_replica(replica).up, self.core.get_replica(replica).fenced
        before = self._live()
        named = any(replica in (t.ar_replica_id, t.dit_replica_id) for t in before)
        writes_in_doubt = any(t.ar_replica_id == replica and t.armed and t.unresolved_writes() for t in before)
        result = self._try(self.core.forget_replica, replica, force=True)
        if up or (spec.role is ReplicaRole.AR and writes_in_doubt):
            assert isinstance(result, FailedPrecondition), result
            assert result.reason == ("REPLICA_UP" if up else "REPLICA_WRITES_IN_DOUBT")
            assert self._live() == before, "a refused forget changes nothing"
            return
        assert isinstance(result, list), result
        event(f"forgotten by force, {len(result)} tickets ended")
        if spec.role is ReplicaRole.DIT:
            self.destination_forgotten.update(t.ticket_id for t in result)
            self.in_doubt = {k: v for k, v in self.in_doubt.items() if v[0] != replica}
        assert not any(v[3] == replica for v in self.in_doubt.values()), "a forgotten AR's write was in doubt"
        for t in self._live():
            assert t.dit_replica_id != replica, "a forgotten DiT's tickets are released"
            if t.ar_replica_id == replica:
                assert t.state not in (TicketState.RESERVED, TicketState.WRITING)
        # That incarnation, if it was only cut off, is refused when the forget needed force (else it
        # simply registers as new); a new one takes the id.
        assert self.core.register_replica(spec).fenced is (fenced or named)
        assert (replica in self.core.registry) is not (fenced or named)
        fresh = new_incarnation(spec)
        assert not self.core.register_replica(fresh).fenced
        self.specs[replica] = fresh

    @rule(seconds=st.sampled_from([0.5, QUIET, 10.0, LEASE * 2]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for spec in self.specs.values():
            if self.core.get_replica(spec.replica_id).up or seconds < LEASE:
                self._try(self.core.heartbeat, spec.replica_id, spec.incarnation_id)
        self.core.tick()
        now = self.clock()
        for t in self._live():
            if t.state is TicketState.DRAINING and not t.unresolved_writes():
                # Resolved yet still DRAINING after a tick: only the quiet period may hold it.
                assert self._quiet_until(t) > now, f"ticket {t.ticket_id} resolved and quiet, not released"

    @rule(replica=st.sampled_from(["ar-0", "ar-1", "dit-0", "dit-1", "dit-2"]))
    def renew_after_expiry(self, replica: str) -> None:
        spec = self.specs[replica]
        self._try(self.core.heartbeat, spec.replica_id, spec.incarnation_id)

    @rule(data=st.data())
    def restart_broker(self, data: st.DataObject) -> None:
        before = {t.ticket_id: t for t in self._live()}
        self.core.close()
        self.core = self._open()
        for tid, t in before.items():
            if t.armed and t.unresolved_writes():
                assert self.core.get_ticket(tid).state is TicketState.DRAINING, "never silently freed"
        # Replicas come back with the same incarnation; the DiT still reads what it consumes.
        for spec in self.specs.values():
            held = [t.ticket_id for t in self._live()
                    if t.dit_replica_id == spec.replica_id and t.state is TicketState.CONSUMING]
            if data.draw(st.booleans()):
                self.core.register_replica(spec, held_ticket_ids=held)
            else:
                self.core.register_replica(spec, unresolved_writes=[
                    (t.ticket_id, k) for t in self._live() if t.ar_replica_id == spec.replica_id
                    for k in t.unresolved_writes()
                ], held_ticket_ids=held)

    # --------------------------------------------------------------- invariants

    def _quiet_until(self, t: Ticket) -> float:
        return self.core._tickets[t.ticket_id].quiet_until(QUIET)  # noqa: SLF001 - white-box check

    @invariant()
    def pages_are_exactly_accounted(self) -> None:
        live = self._live()
        for t in live:
            event(f"state {t.state.value}")
        for pool in self.core.pool_status():
            assert pool.free + pool.reserved + pool.draining == pool.total
            mine = [t for t in live if t.dit_replica_id == pool.replica_id]
            owned = [p for t in mine for p in self._pages(t)]
            assert len(owned) == len(set(owned)), "a page is in two tickets"
            assert pool.reserved == sum(len(t.page_ids) for t in mine if t.state in HOLDING_STATES)
            assert pool.draining == sum(len(t.page_ids) for t in mine if t.state is TicketState.DRAINING)
            raw = self.core._pools[pool.replica_id]  # noqa: SLF001 - white-box check
            for t in mine:
                for r in t.rows:
                    for p in r.page_ids:
                        assert raw.state_of(p, r.row) is not PageState.FREE, (
                            f"page {p} (row {r.row}) of live ticket {t.ticket_id} is free"
                        )

    @invariant()
    def no_page_of_an_in_doubt_write_is_free_or_reserved_by_another_ticket(self) -> None:
        live = self._live()
        for (tid, key), (dit_id, dit_inc, pages, _, _) in self.in_doubt.items():
            assert self.specs[dit_id].incarnation_id == dit_inc
            raw = self.core._pools[dit_id]  # noqa: SLF001 - white-box check
            for group, p in pages:
                assert raw.groups[group].state_of(p) is not PageState.FREE, (
                    f"page {p} (group {group}) of in-doubt write {tid}/{key} is free"
                )
            for t in live:
                if t.ticket_id != tid and t.dit_replica_id == dit_id:
                    shared = pages & set(self._pages(t))
                    assert not shared, f"ticket {t.ticket_id} holds pages of in-doubt write {tid}/{key}: {sorted(shared)}"
            mine = [t for t in live if t.ticket_id == tid]
            assert mine and mine[0].state in (TicketState.WRITING, TicketState.DRAINING), "in doubt, yet not held"

    @invariant()
    def released_tickets_had_no_write_in_flight(self) -> None:
        for t in self.core.list_tickets([TicketState.RELEASED]):
            if t.reason == "DIT_REPLICA_RESTARTED" or t.ticket_id in self.destination_forgotten:
                continue  # the destination memory itself is gone: nothing left to protect
            if t.armed:
                assert not t.unresolved_writes(), f"ticket {t.ticket_id} released with writes in flight"
            else:
                # Rolled back before arming: no writer had the map, so no write ever started.
                assert all(w.status is WriteStatus.PENDING for w in t.writes), "rolled back after a write"

    @invariant()
    def armed_tickets_with_unresolved_writes_hold_their_pages(self) -> None:
        for t in self._live():
            assert t.state is not TicketState.RELEASED
            if t.armed and t.unresolved_writes():
                assert t.state in (TicketState.WRITING, TicketState.DRAINING)

    # ------------------------------------------------------------------ the end

    def _resolve_everything(self) -> None:
        """Every writer resolves (some by a new incarnation); then every ticket must be RELEASED."""
        for i, t in enumerate(self._live()):
            self.core.cancel_ticket(t.ticket_id)
            t = self.core.get_ticket(t.ticket_id)
            ar = self.specs[t.ar_replica_id]
            if i % 2 and t.unresolved_writes():
                ar = replace(new_incarnation(ar))
                self.core.register_replica(ar)
                self.specs[ar.replica_id] = ar
            in_doubt = set(t.in_doubt_writes())
            for k in t.unresolved_writes():
                # An in-doubt write's call returns; a write never reported never began.
                self._try(self.core.report_write, t.ticket_id, k, replica_id=ar.replica_id,
                          incarnation_id=ar.incarnation_id,
                          status=WriteStatus.FAILED if k in in_doubt else WriteStatus.NOT_STARTED)
            if self.core.get_ticket(t.ticket_id).state is TicketState.CONSUMING:
                self.core.release_ticket(t.ticket_id, TicketOutcome.CANCELLED)
        self.clock.advance(QUIET)
        self.core.tick()
        assert self._live() == [], [(t.state, t.unresolved_writes()) for t in self._live()]
        for pool in self.core.pool_status():
            assert pool.free == pool.total, pool
        for tid in self.ticket_ids:
            t = self.core.get_ticket(tid) if tid in self.core._released else None  # noqa: SLF001
            assert t is None or t.state is TicketState.RELEASED


# max_examples comes from the loaded profile (tests/conftest.py: 40 in CI, 200 with HYPOTHESIS_PROFILE=dev).
BrokerMachine.TestCase.settings = settings(BrokerMachine.TestCase.settings, stateful_step_count=50)
TestBrokerLifecycle = BrokerMachine.TestCase
