"""The ticket lifecycle, one test per sentence of the seed's lifecycle paragraph, plus the rest of
DESIGN.md section 6 (outcomes, idempotency, fencing, incarnations)."""

from __future__ import annotations

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.placement import choose_ar_replica, choose_dit_replica
from kvrelay.broker.tickets import (
    TRANSITIONS,
    AlreadyExists,
    BrokenInvariant,
    FailedPrecondition,
    IllegalTransition,
    InvalidArgument,
    TicketEvent,
    TicketOutcome,
    TicketState,
    Unavailable,
    WriteKey,
    WriteStatus,
)
from tests.broker.helpers import (
    ManualClock,
    ar_spec,
    checksum_of,
    dit_spec,
    full_lifecycle,
    load_all,
    new_incarnation,
    write_all,
)

QUIET = 2.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def core(clock: ManualClock) -> BrokerCore:
    c = BrokerCore(None, clock=clock, lease_seconds=10.0, drain_quiet_seconds=QUIET, journal_synchronous="OFF")
    yield c
    c.close()


@pytest.fixture
def ar(core: BrokerCore):
    spec = ar_spec(tp=2)
    core.register_replica(spec)
    return spec


@pytest.fixture
def dit(core: BrokerCore):
    spec = dit_spec(tp=2, num_pages=32)
    core.register_replica(spec)
    return spec


def pages(core: BrokerCore, replica: str = "dit-0") -> tuple[int, int, int]:
    p = core.pool_status(replica)[0]
    assert p.free + p.reserved + p.draining == p.total
    return p.free, p.reserved, p.draining


def armed(core, ar, dit, request_id="req-1", rows=(40, 3)):
    t = core.create_ticket(request_id, ar.replica_id, dit.replica_id, list(rows))
    assert t is not None
    return core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket


# --- "The orchestrator creates one transfer ticket per request ..."


def test_one_ticket_per_request_and_create_is_idempotent(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [40, 3])
    again = core.create_ticket("req-1", "ar-0", "dit-0", [40, 3])
    assert t is not None and again is not None and again.ticket_id == t.ticket_id
    assert pages(core) == (32 - 4, 4, 0), "3 pages for 40 tokens + 1 for 3 tokens, reserved once"
    with pytest.raises(AlreadyExists):
        core.create_ticket("req-1", "ar-0", "dit-0", [41, 3])
    assert [r.page_ids for r in t.rows] == [(0, 1, 2), (3,)], "one contiguous run for both CFG rows"


def test_plan_decides_the_expected_writes(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [40, 3])
    assert t is not None
    # TP=2 -> TP=2 with 4 heads: rank s sends only to rank s, for both rows.
    assert [w.key for w in t.writes] == [
        WriteKey(0, 0, 0), WriteKey(0, 1, 1), WriteKey(1, 0, 0), WriteKey(1, 1, 1)
    ]
    arming = core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    assert {(w.row, w.src_rank, w.dst_rank) for w in arming.writes} == {
        (k.row, k.src_rank, k.dst_rank) for k in (w.key for w in t.writes)
    }
    assert [d.rank for d in arming.destinations] == [0, 1]
    assert [ld.key for ld in t.loads] == sorted(ld.key for ld in t.loads) and len(t.loads) == 4


def test_request_that_can_never_fit_is_invalid_argument(core, ar, dit) -> None:
    with pytest.raises(InvalidArgument) as err:
        core.create_ticket("big", "ar-0", "dit-0", [16 * 20, 16 * 13])
    assert err.value.reason == "NEVER_FITS"
    assert pages(core) == (32, 0, 0)


def test_request_that_does_not_fit_now_returns_none(core, ar, dit) -> None:
    assert core.create_ticket("a", "ar-0", "dit-0", [16 * 30]) is not None
    assert core.create_ticket("b", "ar-0", "dit-0", [16 * 3]) is None
    assert pages(core) == (2, 30, 0)
    assert choose_dit_replica(core, [16 * 3]) is None
    assert choose_dit_replica(core, [16 * 2]) == "dit-0"


# --- "DiT allocates the destination pages, waits for every worker rank to finish loading, and
#      releases the source and destination pages only after the connector lifecycle completes."


def test_ready_only_after_every_row_is_loaded_on_every_rank(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    t = write_all(core, t, ar)
    assert t.state is TicketState.WRITING
    last = t.loads[-1]
    for ld in t.loads[:-1]:
        key = ld.key
        verified = {w.key: checksum_of(t.ticket_id, w.key) for w in t.writes
                    if w.key.row == key.row and w.key.dst_rank == key.dst_rank}
        t = core.report_load(t.ticket_id, key.row, key.dst_rank, replica_id="dit-0",
                             incarnation_id=dit.incarnation_id, verified=verified)
        assert t.state is TicketState.WRITING, "READY needs every (row, dst_rank)"
    verified = {w.key: checksum_of(t.ticket_id, w.key) for w in t.writes
                if w.key.row == last.key.row and w.key.dst_rank == last.key.dst_rank}
    t = core.report_load(t.ticket_id, last.key.row, last.key.dst_rank, replica_id="dit-0",
                         incarnation_id=dit.incarnation_id, verified=verified)
    assert t.state is TicketState.READY


def test_pages_free_only_when_the_dit_releases(core, ar, dit) -> None:
    t = load_all(core, write_all(core, armed(core, ar, dit), ar), dit)
    core.start_consuming(t.ticket_id)
    assert pages(core) == (28, 4, 0)
    t = core.release_ticket(t.ticket_id, TicketOutcome.OK, replica_id="dit-0")
    assert (t.state, t.outcome) == (TicketState.RELEASED, TicketOutcome.OK)
    assert pages(core) == (32, 0, 0)


def test_load_needs_the_writers_report_and_a_matching_checksum(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    key = t.writes[0].key
    verified = {key: checksum_of(t.ticket_id, key)}
    with pytest.raises(FailedPrecondition) as err:
        core.report_load(t.ticket_id, key.row, key.dst_rank, replica_id="dit-0",
                         incarnation_id=dit.incarnation_id, verified=verified)
    assert err.value.reason == "WRITE_NOT_REPORTED"
    write_all(core, t, ar)
    with pytest.raises(FailedPrecondition) as err:
        core.report_load(t.ticket_id, key.row, key.dst_rank, replica_id="dit-0",
                         incarnation_id=dit.incarnation_id, verified={key: 12345})
    assert err.value.reason == "CHECKSUM_MISMATCH"
    assert not core.get_ticket(t.ticket_id).loads[0].loaded
    assert not core.get_replica("dit-0").fenced, "a mismatch may be bytes in flight: retry, not fence"


# --- "Request registration failures are rolled back before Worker dispatch."


def test_rollback_before_arming_frees_at_once_and_blocks_arming(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [40])
    assert t is not None
    t = core.cancel_ticket(t.ticket_id, TicketOutcome.FAILED, "registration failed")
    assert (t.state, t.outcome, t.armed) == (TicketState.RELEASED, TicketOutcome.FAILED, False)
    assert pages(core) == (32, 0, 0)
    with pytest.raises(FailedPrecondition):
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)


def test_no_rollback_once_armed(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    t = core.cancel_ticket(t.ticket_id)
    assert t.state is TicketState.DRAINING, "armed: the AR may be writing, so the pages drain"
    assert pages(core) == (28, 0, 4)


# --- "Receive timeouts and cancellation terminate the request without recycling in-flight pages:
#      the scheduler retains them until every CFG row has completed on every rank."


def test_receive_timeout_drains_until_every_write_resolves_then_quiet(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    first, *rest = t.writes
    core.report_write(t.ticket_id, first.key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                      status=WriteStatus.OK, checksum=1)
    t = core.release_ticket(t.ticket_id, TicketOutcome.TIMED_OUT, "TRANSFER_TIMEOUT", replica_id="dit-0")
    assert (t.state, t.outcome, t.request_over) == (TicketState.DRAINING, TicketOutcome.TIMED_OUT, True)
    for w in rest[:-1]:
        core.report_write(t.ticket_id, w.key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.FAILED)
    clock.advance(100)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    assert pages(core) == (28, 0, 4), "one write unresolved: no page may be freed"
    core.report_write(t.ticket_id, rest[-1].key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                      status=WriteStatus.NOT_STARTED)
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING, "quiet period not over"
    clock.advance(QUIET - 0.01)
    core.tick()
    assert pages(core) == (28, 0, 4)
    clock.advance(0.02)
    assert core.tick() == 1
    t = core.get_ticket(t.ticket_id)
    assert (t.state, t.outcome) == (TicketState.RELEASED, TicketOutcome.TIMED_OUT)
    assert pages(core) == (32, 0, 0)


def test_ending_with_every_write_resolved_still_waits_the_quiet_period(core, ar, dit, clock) -> None:
    t = write_all(core, armed(core, ar, dit), ar)
    t = core.cancel_ticket(t.ticket_id)
    assert t.state is TicketState.DRAINING
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
    t2 = write_all(core, armed(core, ar, dit, "req-2"), ar)
    clock.advance(QUIET + 1)
    assert core.cancel_ticket(t2.ticket_id).state is TicketState.RELEASED, "quiet already passed"


# --- "Late completion is polled only while such requests remain."


def test_late_completion_polled_only_while_draining(core, ar, dit, clock) -> None:
    hb = core.heartbeat("ar-0", ar.incarnation_id)
    assert hb.poll_writes == ()
    t = armed(core, ar, dit)
    assert core.heartbeat("ar-0", ar.incarnation_id).poll_writes == (), "WRITING is not DRAINING"
    core.cancel_ticket(t.ticket_id)
    polled = core.heartbeat("ar-0", ar.incarnation_id).poll_writes
    assert sorted(k for _, k in polled) == sorted(w.key for w in t.writes)
    assert {tid for tid, _ in polled} == {t.ticket_id}
    assert core.heartbeat("dit-0", dit.incarnation_id).poll_writes == (), "only the writer is asked"
    write_all(core, t, ar)
    assert core.heartbeat("ar-0", ar.incarnation_id).poll_writes == ()
    clock.advance(QUIET)
    core.tick()
    assert core.heartbeat("ar-0", ar.incarnation_id).poll_writes == ()


# --- "If a peer never completes, its pages remain reserved until shutdown; other requests can
#      continue using the remaining capacity."


def test_unresolved_writer_keeps_its_pages_while_others_continue(core, ar, dit, clock) -> None:
    stuck = armed(core, ar, dit, "stuck", rows=(16 * 10,))
    core.cancel_ticket(stuck.ticket_id)
    for i in range(5):
        clock.advance(3600)
        core.heartbeat("dit-0", dit.incarnation_id)
        core.heartbeat("ar-0", ar.incarnation_id)
        core.tick()
        t = full_lifecycle(core, ar, dit, f"other-{i}", [16 * 20, 16 * 2])
        assert t.outcome is TicketOutcome.OK
        assert not (set(t.page_ids) & set(stuck.page_ids))
    assert core.get_ticket(stuck.ticket_id).state is TicketState.DRAINING
    assert pages(core) == (22, 0, 10)
    assert core.draining_oldest_seconds() == pytest.approx(5 * 3600)
    # Only 22 pages left: a request needing 23 never fits now, but is not "never fits".
    assert core.create_ticket("too-big-now", "ar-0", "dit-0", [16 * 23]) is None


def test_an_expired_lease_is_not_proof(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    core.cancel_ticket(t.ticket_id)
    clock.advance(1000)
    core.heartbeat("dit-0", dit.incarnation_id)
    core.tick()
    assert not core.get_replica("ar-0").up
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    with pytest.raises(Unavailable):
        core.create_ticket("next", "ar-0", "dit-0", [3])


def test_a_new_incarnation_proves_the_writer_gone(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    core.cancel_ticket(t.ticket_id)
    ar2 = new_incarnation(ar)
    core.register_replica(ar2)
    t = core.get_ticket(t.ticket_id)
    assert {w.status for w in t.writes} == {WriteStatus.WRITER_GONE}
    assert t.state is TicketState.DRAINING, "still waits the quiet period for bytes in a socket"
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
    assert pages(core) == (32, 0, 0)


def test_stale_incarnation_reports_are_ignored(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    core.register_replica(new_incarnation(ar))
    with pytest.raises(FailedPrecondition) as err:
        core.report_write(t.ticket_id, t.writes[0].key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.OK, checksum=1)
    assert err.value.reason == "STALE_INCARNATION"
    assert core.get_ticket(t.ticket_id).writes[0].status is WriteStatus.WRITER_GONE
    assert not core.get_replica("ar-0").fenced


def test_a_restarted_dit_releases_its_tickets(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    core.register_replica(new_incarnation(dit))
    t = core.get_ticket(t.ticket_id)
    # The old memory is gone and the new process listens on fresh ports: no old write can land.
    assert (t.state, t.outcome, t.reason) == (TicketState.RELEASED, TicketOutcome.FAILED, "DIT_REPLICA_RESTARTED")
    assert pages(core) == (32, 0, 0)


def test_a_restarted_dit_frees_a_draining_ticket_keeping_the_clients_outcome(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    core.cancel_ticket(t.ticket_id)
    core.register_replica(new_incarnation(dit))
    t = core.get_ticket(t.ticket_id)
    assert (t.state, t.outcome, t.reason) == (TicketState.RELEASED, TicketOutcome.CANCELLED, "DIT_REPLICA_RESTARTED")
    assert pages(core) == (32, 0, 0)


# --- "Invalid pages, missing Worker ranks, and failures without a proven rollback still stop the
#      replica before teardown."


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        (WriteKey(0, 5, 0), "UNKNOWN_RANK"),
        (WriteKey(0, 0, 9), "UNKNOWN_RANK"),
        (WriteKey(0, 0, 1), "WRITE_NOT_IN_PLAN"),  # rank 0 holds heads 0-1, DiT rank 1 needs 2-3
        (WriteKey(7, 0, 0), "WRITE_NOT_IN_PLAN"),
    ],
)
def test_reports_outside_the_plan_fence_the_writer(core, ar, dit, key, reason) -> None:
    t = armed(core, ar, dit)
    with pytest.raises(BrokenInvariant) as err:
        core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.OK)
    assert err.value.reason == reason
    hb = core.heartbeat("ar-0", ar.incarnation_id)
    assert hb.fenced and reason in hb.fence_reason
    with pytest.raises(Unavailable) as unavailable:
        core.create_ticket("next", "ar-0", "dit-0", [3])
    assert unavailable.value.reason == "REPLICA_FENCED"
    assert choose_ar_replica(core) is None


def test_a_contradicting_report_is_a_failure_without_proven_rollback(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    key = t.writes[0].key
    core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                      status=WriteStatus.OK, checksum=7)
    with pytest.raises(BrokenInvariant):
        core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.NOT_STARTED)
    assert core.get_replica("ar-0").fenced


def test_a_write_before_arming_fences(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3])
    assert t is not None
    with pytest.raises(BrokenInvariant) as err:
        core.report_write(t.ticket_id, t.writes[0].key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.OK)
    assert err.value.reason == "WRITE_BEFORE_ARM"
    assert core.get_replica("ar-0").fenced


def test_a_load_from_an_unknown_rank_fences_the_dit(core, ar, dit) -> None:
    t = write_all(core, armed(core, ar, dit), ar)
    with pytest.raises(BrokenInvariant):
        core.report_load(t.ticket_id, 0, 4, replica_id="dit-0", incarnation_id=dit.incarnation_id, verified={})
    assert core.heartbeat("dit-0", dit.incarnation_id).fenced
    assert core.pool_status("dit-0")[0].fenced


def test_a_dit_with_a_missing_rank_cannot_register(core) -> None:
    spec = dit_spec("dit-9", tp=2)
    from dataclasses import replace

    with pytest.raises(InvalidArgument) as err:
        core.register_replica(replace(spec, regions=spec.regions[:1]))
    assert err.value.reason == "MISSING_RANK"


def test_a_fence_is_lifted_only_by_a_new_incarnation(core, ar, dit) -> None:
    core.fence_replica("ar-0", "test")
    core.register_replica(ar)
    assert core.get_replica("ar-0").fenced, "the same process re-registering stays fenced"
    core.register_replica(new_incarnation(ar))
    assert not core.get_replica("ar-0").fenced


# --- "Cancellation queued during a synchronous receive is processed when that receive completes
#      or times out; it does not interrupt the remote write."


def test_cancel_never_interrupts_a_write(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    t = core.cancel_ticket(t.ticket_id)
    assert (t.state, t.outcome) == (TicketState.DRAINING, TicketOutcome.CANCELLED)
    t = write_all(core, t, ar)  # the writes complete after the cancel and are still accepted
    assert {w.status for w in t.writes} == {WriteStatus.OK}
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED


def test_cancel_while_consuming_waits_for_the_dit(core, ar, dit) -> None:
    t = load_all(core, write_all(core, armed(core, ar, dit), ar), dit)
    core.start_consuming(t.ticket_id)
    t = core.cancel_ticket(t.ticket_id)
    assert (t.state, t.outcome, t.request_over) == (TicketState.CONSUMING, TicketOutcome.CANCELLED, True)
    assert pages(core) == (28, 4, 0), "the DiT is still reading them"
    t = core.release_ticket(t.ticket_id, TicketOutcome.CANCELLED)
    assert t.state is TicketState.RELEASED and pages(core) == (32, 0, 0)


def test_cancel_when_ready_releases_at_once(core, ar, dit) -> None:
    t = load_all(core, write_all(core, armed(core, ar, dit), ar), dit)
    assert core.cancel_ticket(t.ticket_id).state is TicketState.RELEASED, "READY never drains"


# --- idempotency and the transition table


def test_reports_and_release_are_idempotent(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    once = write_all(core, t, ar)
    twice = write_all(core, t, ar)
    assert once.version == twice.version, "a retried report changes nothing"
    loaded = load_all(core, once, dit)
    assert load_all(core, once, dit).version == loaded.version
    assert core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id).ticket.version == loaded.version
    r1 = core.release_ticket(t.ticket_id, TicketOutcome.OK)
    r2 = core.release_ticket(t.ticket_id, TicketOutcome.OK)
    assert r1 == r2 and r1.state is TicketState.RELEASED
    assert write_all(core, t, ar).state is TicketState.RELEASED
    assert pages(core) == (32, 0, 0)


def test_rearming_by_the_arming_incarnation_returns_the_same_answer_even_when_draining(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    core.cancel_ticket(t.ticket_id)
    again = core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    assert again.ticket.state is TicketState.DRAINING
    assert len(again.writes) == len(t.writes), "the writer learns which writes to report NOT_STARTED"


def test_illegal_transitions_raise_failed_precondition(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3])
    assert t is not None
    with pytest.raises(IllegalTransition) as err:
        core.start_consuming(t.ticket_id)
    assert err.value.code == "FAILED_PRECONDITION"
    assert (TicketState.READY, TicketEvent.END_UNRESOLVED) not in TRANSITIONS, "READY never drains"
    assert (TicketState.CONSUMING, TicketEvent.END_UNRESOLVED) not in TRANSITIONS
    assert {s for (s, e) in TRANSITIONS if e is TicketEvent.ROLLBACK} == {TicketState.RESERVED}


# --- Three kinds of write outcome: final OK, final failure, and in doubt (DESIGN.md section 6:
#     "A sender that stops waiting while its transport call is still running reports IN_DOUBT").


def _report(core, t, key, ar, status, checksum=0):
    return core.report_write(t.ticket_id, key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                             status=status, checksum=checksum)


def test_in_doubt_write_holds_its_pages_past_any_quiet_period_until_the_final_report(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    first, *rest = t.writes
    for w in rest:
        _report(core, t, w.key, ar, WriteStatus.OK, checksum_of(t.ticket_id, w.key))
    t = _report(core, t, first.key, ar, WriteStatus.IN_DOUBT)
    assert t.state is TicketState.WRITING and t.unresolved_writes() == (first.key,)
    assert t.in_doubt_writes() == (first.key,)
    t = core.release_ticket(t.ticket_id, TicketOutcome.TIMED_OUT, "TRANSFER_TIMEOUT", replica_id="dit-0")
    assert t.state is TicketState.DRAINING
    for _ in range(5):
        clock.advance(3600)
        core.heartbeat("ar-0", ar.incarnation_id)
        core.heartbeat("dit-0", dit.incarnation_id)
        core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    assert pages(core) == (28, 0, 4), "an in-doubt write's pages are never freed"
    # The second request must not get those pages.
    other = core.create_ticket("req-2", "ar-0", "dit-0", [16 * 28])
    assert other is not None and not set(other.page_ids) & set(t.page_ids)
    assert core.create_ticket("req-3", "ar-0", "dit-0", [1]) is None, "the pool is full: no page of the in-doubt ticket"
    # Still polled (late completion), and a retry of IN_DOUBT changes nothing.
    assert (t.ticket_id, first.key) in core.heartbeat("ar-0", ar.incarnation_id).poll_writes
    _report(core, t, first.key, ar, WriteStatus.IN_DOUBT)
    # The engine call returned (here: with an error); only now the quiet period starts.
    t = _report(core, t, first.key, ar, WriteStatus.FAILED)
    assert t.state is TicketState.DRAINING and not t.unresolved_writes()
    clock.advance(QUIET - 0.01)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    clock.advance(0.02)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED


def test_in_doubt_then_ok_is_final_and_a_late_in_doubt_retry_is_harmless(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    key = t.writes[0].key
    _report(core, t, key, ar, WriteStatus.IN_DOUBT)
    t = _report(core, t, key, ar, WriteStatus.OK, checksum_of(t.ticket_id, key))
    assert t.writes[0].status is WriteStatus.OK
    t = _report(core, t, key, ar, WriteStatus.IN_DOUBT)  # the in-doubt report's retry arrives late
    assert t.writes[0].status is WriteStatus.OK
    assert not core.get_replica("ar-0").fenced


def test_not_started_after_in_doubt_contradicts_and_fences(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    key = t.writes[0].key
    _report(core, t, key, ar, WriteStatus.IN_DOUBT)
    with pytest.raises(BrokenInvariant):
        _report(core, t, key, ar, WriteStatus.NOT_STARTED)
    assert core.get_replica("ar-0").fenced
    assert core.get_ticket(t.ticket_id).writes[0].status is WriteStatus.IN_DOUBT


def test_in_doubt_write_blocks_the_load_of_its_row(core, ar, dit) -> None:
    t = armed(core, ar, dit)
    for w in t.writes:
        _report(core, t, w.key, ar, WriteStatus.IN_DOUBT)
    ld = t.loads[0]
    with pytest.raises(FailedPrecondition) as info:
        core.report_load(t.ticket_id, ld.key.row, ld.key.dst_rank, replica_id="dit-0",
                         incarnation_id=dit.incarnation_id, verified={})
    assert info.value.reason == "WRITE_IN_DOUBT"


def test_in_doubt_write_resolves_when_its_writer_is_proven_gone(core, ar, dit, clock) -> None:
    t = armed(core, ar, dit)
    for w in t.writes:
        _report(core, t, w.key, ar, WriteStatus.IN_DOUBT)
    core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT)
    clock.advance(3600)  # a lease expiring is no proof
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    core.register_replica(new_incarnation(ar))
    t = core.get_ticket(t.ticket_id)
    assert {w.status for w in t.writes} == {WriteStatus.WRITER_GONE}
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
    assert pages(core) == (32, 0, 0)


def test_pages_of_a_gone_writer_wait_until_a_stopped_receiver_drained_or_was_killed(clock) -> None:
    """A new AR incarnation proves no sender is alive, not that the DiT rank drained its socket:
    one stopped at that moment holds the dead sender's bytes until it runs again (then drains
    them) or its watchdog kills it (within `receiver_settle_seconds`). So the pages wait that
    long after the proof, and never free while the DiT is down (a stopped service runs no
    watchdog). A writer's own NOT_STARTED (nothing sent) keeps the plain quiet period."""
    settle = 30.0
    core = BrokerCore(None, clock=clock, lease_seconds=10.0, drain_quiet_seconds=QUIET,
                      receiver_settle_seconds=settle, journal_synchronous="OFF")
    try:
        ar, dit = ar_spec(tp=2), dit_spec(tp=2, num_pages=32)
        core.register_replica(ar)
        core.register_replica(dit)
        t = armed(core, ar, dit)
        for w in t.writes:
            _report(core, t, w.key, ar, WriteStatus.IN_DOUBT)
        core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT)
        ar2 = new_incarnation(ar)
        core.register_replica(ar2)
        assert {w.status for w in core.get_ticket(t.ticket_id).writes} == {WriteStatus.WRITER_GONE}
        clock.advance(QUIET)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        for _ in range(3):  # the DiT heartbeats; the settle time has not passed
            clock.advance(8.0)
            core.heartbeat(dit.replica_id, dit.incarnation_id)
            core.tick()
            assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        clock.advance(11.0)  # past the settle time, but the DiT's lease lapsed: it may be stopped
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        assert pages(core)[2] > 0
        core.heartbeat(dit.replica_id, dit.incarnation_id)  # it runs again (its ranks drained)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
        assert pages(core) == (32, 0, 0)

        core.heartbeat(ar2.replica_id, ar2.incarnation_id)
        t2 = armed(core, ar2, dit, request_id="req-2")
        for w in t2.writes:
            _report(core, t2, w.key, ar2, WriteStatus.NOT_STARTED)
        core.cancel_ticket(t2.ticket_id, TicketOutcome.TIMED_OUT)
        clock.advance(QUIET)
        core.tick()
        assert core.get_ticket(t2.ticket_id).state is TicketState.RELEASED
    finally:
        core.close()


@pytest.mark.parametrize("ends", ["after_the_report", "with_the_report"])
def test_pages_of_a_failed_write_wait_until_a_stopped_receiver_drained_or_was_killed(clock, ends: str) -> None:
    """FAILED ends the sending, not the receiving. Found black-box (Mooncake TCP, a DiT rank
    SIGSTOPped mid-write): the engine failed the batch after its own MC_TRANSFER_TIMEOUT, the AR
    reported FAILED (final), the pages were freed `drain_quiet_seconds` later while the rank was
    still stopped, and when it ran again it wrote 26 pages of the old request into pages no ticket
    held (any next request's). So a FAILED write's pages wait like a gone writer's: the
    receiver's settle time, and never while the DiT is down; also when the request ends after
    the quiet period (a write that failed inside the DiT's wait: no IN_DOUBT, no DRAINING yet)."""
    settle = 30.0
    core = BrokerCore(None, clock=clock, lease_seconds=10.0, drain_quiet_seconds=QUIET,
                      receiver_settle_seconds=settle, journal_synchronous="OFF")
    try:
        ar, dit = ar_spec(), dit_spec(num_pages=16)
        core.register_replica(ar)
        core.register_replica(dit)
        t = armed(core, ar, dit)
        if ends == "after_the_report":
            for w in t.writes:
                _report(core, t, w.key, ar, WriteStatus.IN_DOUBT)
            core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT)
        for w in t.writes:
            _report(core, t, w.key, ar, WriteStatus.FAILED)
        clock.advance(QUIET * 2)
        if ends == "with_the_report":
            core.cancel_ticket(t.ticket_id, TicketOutcome.FAILED)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        assert pages(core)[0] < 16
        for _ in range(3):  # the DiT heartbeats; the settle time has not passed
            clock.advance(8.0)
            core.heartbeat(dit.replica_id, dit.incarnation_id)
            core.heartbeat(ar.replica_id, ar.incarnation_id)
            core.tick()
            assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        clock.advance(11.0)  # past the settle time, but the DiT's lease lapsed: it may be stopped
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
        core.heartbeat(dit.replica_id, dit.incarnation_id)  # it runs again (its ranks drained)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
        assert pages(core) == (16, 0, 0)
    finally:
        core.close()


def test_in_doubt_survives_a_broker_restart(tmp_path, clock) -> None:
    path = tmp_path / "journal.sqlite"
    core = BrokerCore(path, clock=clock, drain_quiet_seconds=QUIET, journal_synchronous="OFF")
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    t = armed(core, ar, dit, rows=(20,))
    _report(core, t, t.writes[0].key, ar, WriteStatus.IN_DOUBT)
    core.close()
    core = BrokerCore(path, clock=clock, drain_quiet_seconds=QUIET, journal_synchronous="OFF")
    try:
        clock.advance(3600)
        core.tick()
        again = core.get_ticket(t.ticket_id)
        assert again.state is TicketState.DRAINING and again.in_doubt_writes() == (t.writes[0].key,)
        assert core.pool_status("dit-0")[0].draining == 2
        core.register_replica(ar, unresolved_writes=[(t.ticket_id, t.writes[0].key)])
        _report(core, again, t.writes[0].key, ar, WriteStatus.OK, 5)
        clock.advance(QUIET)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
    finally:
        core.close()


# --- The broker plans once (DESIGN.md section 7): the plan is handed down, the DiT consumes itself.


def test_plan_for_is_the_arming_plan_without_arming(core, ar, dit) -> None:
    t = core.create_ticket("req-1", "ar-0", "dit-0", [40, 3])
    plan = core.plan_for(t.ticket_id)
    assert plan.ticket.state is TicketState.RESERVED and not plan.ticket.armed
    assert plan.src_shards == 2 and plan.dit_tensor_parallel_size == 2
    assert {(w.row, w.src_rank, w.dst_rank) for w in plan.writes} == {
        (w.key.row, w.key.src_rank, w.key.dst_rank) for w in t.writes
    }
    armed_plan = core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    assert armed_plan.writes == plan.writes and armed_plan.destinations == plan.destinations
    # Not armed by plan_for: rollback was still legal until ReserveTicket.
    t2 = core.create_ticket("req-2", "ar-0", "dit-0", [5])
    core.plan_for(t2.ticket_id)
    assert core.cancel_ticket(t2.ticket_id).state is TicketState.RELEASED


def test_the_dit_marks_consuming_itself_and_only_its_own_ticket(core, ar, dit) -> None:
    t = load_all(core, write_all(core, armed(core, ar, dit), ar), dit)
    assert t.state is TicketState.READY
    with pytest.raises(FailedPrecondition) as info:
        core.start_consuming(t.ticket_id, "dit-9", dit.incarnation_id)
    assert info.value.reason == "WRONG_REPLICA"
    with pytest.raises(FailedPrecondition) as info:
        core.start_consuming(t.ticket_id, "dit-0", "an-old-incarnation")
    assert info.value.reason == "STALE_INCARNATION"
    assert core.start_consuming(t.ticket_id, "dit-0", dit.incarnation_id).state is TicketState.CONSUMING
    assert core.start_consuming(t.ticket_id, "dit-0", dit.incarnation_id).state is TicketState.CONSUMING


def test_cfg_parallel_dit_ticket_reserves_moves_and_loads_each_row_only_on_its_group(
    core: BrokerCore, ar
) -> None:
    """A CFG=2 x TP=2 DiT (4 ranks): row r is planned, reserved and loaded only on group r's ranks
    (2r, 2r+1); a load from the other group is a broken invariant; the lifecycle needs nothing else."""
    from kvrelay.broker.placement import check_ever_fits
    from kvrelay.errors import KvRelayServerError

    dit = dit_spec("dit-cfg", tp=2, num_pages=4, cfg_parallel_size=2)
    core.register_replica(dit)
    geometry = dit.geometry
    rows = [4 * geometry.page_size, 3 * geometry.page_size]  # 4 + 3 pages: 7 > 4, yet each row fits its group
    check_ever_fits(core, rows)  # no NEVER_FITS: each group holds its own row
    ticket = core.create_ticket("req-cfg", ar.replica_id, dit.replica_id, rows)
    assert ticket is not None
    assert [r.page_ids for r in ticket.rows] == [(0, 1, 2, 3), (0, 1, 2)]  # one id space per group
    assert {(w.key.row, w.key.dst_rank) for w in ticket.writes} == {(0, 0), (0, 1), (1, 2), (1, 3)}
    assert {(ld.key.row, ld.key.dst_rank) for ld in ticket.loads} == {(0, 0), (0, 1), (1, 2), (1, 3)}
    armed = core.arm_ticket(ticket.ticket_id, ar.replica_id, ar.incarnation_id)
    assert armed.dit_cfg_parallel_size == 2 and all(w.dst_rank // 2 == w.row for w in armed.writes)
    ticket = write_all(core, ticket, ar)
    ticket = load_all(core, ticket, dit)
    assert ticket.state is TicketState.READY
    core.start_consuming(ticket.ticket_id)
    core.release_ticket(ticket.ticket_id, TicketOutcome.OK, replica_id=dit.replica_id)
    (pool,) = core.pool_status(dit.replica_id)
    assert (pool.total, pool.free) == (8, 8)
    with pytest.raises(KvRelayServerError, match="need 5 KV pages; the largest DiT replica has 4"):
        check_ever_fits(core, [5 * geometry.page_size, geometry.page_size])  # row 0 alone exceeds group 0
    # Group 1's rank reporting row 0 (which it never holds) is a broken invariant: fenced.
    second = core.create_ticket("req-cfg-2", ar.replica_id, dit.replica_id, rows)
    assert second is not None
    core.arm_ticket(second.ticket_id, ar.replica_id, ar.incarnation_id)
    write_all(core, second, ar)
    with pytest.raises(BrokenInvariant, match="not in the plan"):
        core.report_load(second.ticket_id, 0, 2, replica_id=dit.replica_id, incarnation_id=dit.incarnation_id,
                         verified={})
    assert core.get_replica(dit.replica_id).fenced


def test_an_unreachable_replica_leaves_placement_until_its_next_heartbeat(core, ar, dit) -> None:
    """`mark_unreachable` (a broker call failed to connect) is placement only: no lease, fence,
    ticket or page changes; the replica's next heartbeat, or a new incarnation, lifts it."""
    ticket = core.create_ticket("r1", ar.replica_id, dit.replica_id, [16])
    assert not core.mark_unreachable(dit.replica_id, "another-incarnation", "refused")  # stale: ignored
    assert core.get_replica(dit.replica_id).reachable
    assert core.mark_unreachable(dit.replica_id, dit.incarnation_id, "connection refused")
    assert not core.mark_unreachable(dit.replica_id, dit.incarnation_id, "again")  # once
    status = core.get_replica(dit.replica_id)
    assert status.up and not status.fenced and not status.reachable
    assert choose_dit_replica(core, [16]) is None
    assert core.get_ticket(ticket.ticket_id).state is TicketState.RESERVED
    core.heartbeat(dit.replica_id, dit.incarnation_id)
    assert choose_dit_replica(core, [16]) == dit.replica_id

    assert core.mark_unreachable(ar.replica_id, ar.incarnation_id, "connection reset")
    assert choose_ar_replica(core) is None
    restarted = new_incarnation(ar)
    core.register_replica(restarted)
    assert choose_ar_replica(core) == ar.replica_id
