"""What a replica may list and report about tickets, in the core (docs/broker.md, Bounds on what a
replica lists). tests/security/test_replica_listings.py replays the same over gRPC against a real
broker process.

The bounds come from what the replica could hold, so the tests fill a DiT pool to the last page
with the smallest tickets the broker makes, for several AR/DiT shapes, and check that the AR's
every write in flight is within the bound (and one past it is not)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvrelay.broker.core import BrokerCore, ReportedWrite
from kvrelay.broker.tickets import (
    BrokenInvariant,
    FailedPrecondition,
    InvalidArgument,
    LoadKey,
    TicketOutcome,
    TicketState,
    WriteKey,
    WriteStatus,
)
from tests.broker.helpers import ManualClock, ar_spec, dit_spec


def _core() -> BrokerCore:
    return BrokerCore(None, clock=ManualClock(), drain_quiet_seconds=0.0, journal_synchronous="OFF")


@pytest.mark.parametrize(
    ("ar_tp", "dit_tp", "sp", "cfg", "rows"),
    [(1, 1, 1, 1, [3]), (2, 2, 1, 1, [3, 3]), (2, 1, 1, 1, [3]), (1, 2, 1, 1, [3, 3]),
     (2, 2, 1, 2, [3, 3]), (1, 1, 2, 1, [3]), (2, 4, 1, 1, [3])],
)  # fmt: skip
def test_every_write_a_full_pool_can_have_in_flight_is_within_the_bound(
    ar_tp: int, dit_tp: int, sp: int, cfg: int, rows: list[int]
) -> None:
    core = _core()
    ar = ar_spec(tp=ar_tp)
    dit = dit_spec(tp=dit_tp, sp=sp, num_pages=12, cfg_parallel_size=cfg)
    core.register_replica(ar)
    core.register_replica(dit)
    in_flight: list[tuple[str, WriteKey]] = []
    tickets = []
    n = 0
    while (t := core.create_ticket(f"req-{n}", ar.replica_id, dit.replica_id, rows)) is not None:
        n += 1
        core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
        in_flight.extend((t.ticket_id, w.key) for w in t.writes)
        tickets.append(t.ticket_id)
    assert core.free_pages(dit.replica_id) == 0
    max_writes, max_tickets = core.listing_bounds(ar)[0], core.listing_bounds(dit)[1]
    assert len(in_flight) <= max_writes and len(tickets) <= max_tickets
    # The same processes register again with all of it: never refused.
    core.register_replica(ar, unresolved_writes=in_flight)
    core.register_replica(dit, held_ticket_ids=tickets)
    core.heartbeat(ar.replica_id, ar.incarnation_id, in_flight)
    # One past the bound is, whatever it names.
    made_up = [(f"made-up-{i}", WriteKey(0, 0, 0)) for i in range(max_writes + 1 - len(in_flight))]
    with pytest.raises(InvalidArgument) as err:
        core.register_replica(ar, unresolved_writes=[*in_flight, *made_up])
    assert err.value.reason == "TOO_MANY_ENTRIES" and "unresolved_writes" in err.value.message
    with pytest.raises(InvalidArgument):
        core.heartbeat(ar.replica_id, ar.incarnation_id, [*in_flight, *made_up])
    with pytest.raises(InvalidArgument):
        core.register_replica(dit, held_ticket_ids=[*tickets, *(f"x{i}" for i in range(max_tickets + 1))])
    # A DiT lists no writes, an AR no tickets.
    with pytest.raises(InvalidArgument):
        core.register_replica(dit, unresolved_writes=in_flight[:1])
    with pytest.raises(InvalidArgument):
        core.register_replica(ar, held_ticket_ids=tickets[:1])
    assert not core.get_replica(ar.replica_id).fenced and core.free_pages(dit.replica_id) == 0


def test_the_ar_bound_grows_with_the_dit_pages_the_broker_keeps() -> None:
    core = _core()
    ar = ar_spec(tp=2)
    core.register_replica(ar)
    assert core.listing_bounds(ar) == (0, 0)  # no DiT page to write into
    core.register_replica(dit_spec("dit-0", tp=2, num_pages=10))
    core.register_replica(dit_spec("dit-1", tp=1, num_pages=7, cfg_parallel_size=2))
    # AR ranks x (pages per rank x ranks) of every DiT replica.
    assert core.listing_bounds(ar) == (2 * (10 * 2 + 7 * 2), 0)
    # A DiT: its pages (x CFG groups), and the calls it runs whose ticket may be released already.
    assert core.listing_bounds(dit_spec("dit-1", tp=1, num_pages=7, cfg_parallel_size=2, max_num_seqs=3)) == (0, 17)


def test_a_report_about_another_replicas_ticket_is_refused_and_fences_no_one() -> None:
    """Before, ReportWrite/ReportLoad naming a ticket of another replica fenced the replica it
    named: in-process, or without the ownership check, one caller could stop another replica."""
    core = _core()
    ar0, ar1, dit0, dit1 = ar_spec("ar-0"), ar_spec("ar-1"), dit_spec("dit-0"), dit_spec("dit-1")
    for spec in (ar0, ar1, dit0, dit1):
        core.register_replica(spec)
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3])
    assert t is not None
    core.arm_ticket(t.ticket_id, "ar-0", ar0.incarnation_id)
    core.cancel_ticket(t.ticket_id)  # DRAINING: ar-0's write may still land
    key = t.writes[0].key
    for status in (WriteStatus.NOT_STARTED, WriteStatus.FAILED, WriteStatus.OK):
        with pytest.raises(FailedPrecondition) as err:
            core.report_write(t.ticket_id, key, replica_id="ar-1", incarnation_id=ar1.incarnation_id, status=status)
        assert err.value.reason == "WRONG_REPLICA" and not isinstance(err.value, BrokenInvariant)
    with pytest.raises(FailedPrecondition) as err:
        core.report_load(t.ticket_id, 0, 0, replica_id="dit-1", incarnation_id=dit1.incarnation_id, verified={})
    assert err.value.reason == "WRONG_REPLICA" and not isinstance(err.value, BrokenInvariant)
    assert not any(core.get_replica(r).fenced for r in ("ar-0", "ar-1", "dit-0", "dit-1"))
    core.tick()
    after = core.get_ticket(t.ticket_id)
    assert after.state is TicketState.DRAINING and after.unresolved_writes() == (key,)
    assert core.pool_status("dit-0")[0].draining == 1


def test_never_started_before_arming_is_refused_without_a_fence_but_a_claimed_write_fences() -> None:
    core = _core()
    ar, dit = ar_spec(), dit_spec()
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3])
    assert t is not None
    key = t.writes[0].key
    with pytest.raises(FailedPrecondition) as err:
        core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.NOT_STARTED)  # fmt: skip
    assert err.value.reason == "NOT_ARMED" and not core.get_replica("ar-0").fenced
    # Nothing was recorded: the ticket arms and its write reports as usual.
    core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    assert core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                             status=WriteStatus.OK, checksum=1).writes[0].status is WriteStatus.OK  # fmt: skip
    # A write claimed before arming could land after a rollback: its writer is still fenced.
    t2 = core.create_ticket("req-2", "ar-0", "dit-0", [3])
    assert t2 is not None
    with pytest.raises(BrokenInvariant) as broken:
        core.report_write(t2.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.IN_DOUBT)  # fmt: skip
    assert broken.value.reason == "WRITE_BEFORE_ARM" and core.get_replica("ar-0").fenced


def test_a_batch_longer_than_the_tickets_plan_is_refused_before_any_of_it_applies() -> None:
    core = _core()
    ar, dit = ar_spec(tp=2), dit_spec(tp=2)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3, 3])
    assert t is not None
    core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    reports = [ReportedWrite(w.key, WriteStatus.OK, 1) for w in t.writes]
    with pytest.raises(InvalidArgument) as err:
        core.report_writes(t.ticket_id, [*reports, reports[0]], replica_id="ar-0", incarnation_id=ar.incarnation_id)
    assert err.value.reason == "TOO_MANY_ENTRIES"
    assert core.get_ticket(t.ticket_id).unresolved_writes() == tuple(w.key for w in t.writes)
    core.report_writes(t.ticket_id, reports, replica_id="ar-0", incarnation_id=ar.incarnation_id)
    loads = [(ld.key, {w.key: 1 for w in t.writes if (w.key.row, w.key.dst_rank) == (ld.key.row, ld.key.dst_rank)})
             for ld in t.loads]  # fmt: skip
    with pytest.raises(InvalidArgument) as err:
        core.report_loads(t.ticket_id, [*loads, (LoadKey(0, 0), {})], replica_id="dit-0",
                          incarnation_id=dit.incarnation_id)  # fmt: skip
    assert err.value.reason == "TOO_MANY_ENTRIES" and core.get_ticket(t.ticket_id).state is TicketState.WRITING
    assert core.report_loads(t.ticket_id, loads, replica_id="dit-0",
                             incarnation_id=dit.incarnation_id).state is TicketState.READY  # fmt: skip


def test_unknown_entries_of_a_listing_are_logged_once_with_a_count() -> None:
    """Each unknown write or held ticket was a warning line of its own: a listing at the bound
    (thousands of made-up entries) was thousands of lines per registration."""
    core = _core()
    ar, dit = ar_spec(), dit_spec(num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("req-1", "ar-0", "dit-0", [3])
    assert t is not None
    other = core.create_ticket("req-2", "ar-0", "dit-0", [3])
    assert other is not None
    listed = [(f"made-up-{i}", WriteKey(0, 0, 0)) for i in range(40)] + [(t.ticket_id, t.writes[0].key)]
    with capture_logs() as logs:
        core.register_replica(ar, unresolved_writes=listed)
        core.register_replica(dit, held_ticket_ids=[f"made-up-{i}" for i in range(30)] + [other.ticket_id])
    unknown = [e for e in logs if e["event"].startswith("reconcile_unknown")]
    assert [(e["event"], e["count"], len(e.get("writes", e.get("ticket_ids", [])))) for e in unknown] == [
        ("reconcile_unknown_writes", 40, 8), ("reconcile_unknown_held_tickets", 30, 8)]


def test_a_dit_running_a_call_on_a_ticket_released_under_it_lists_one_more_than_its_pages() -> None:
    """A call reads a READY ticket that an operator's cancel released; its page went to a new ticket
    the DiT queued. The DiT holds every ticket of its full pool and that one: never refused."""
    core = _core()
    ar, dit = ar_spec(), dit_spec(num_pages=8, max_num_seqs=1)
    core.register_replica(ar)
    core.register_replica(dit)
    tickets = []
    while (t := core.create_ticket(f"req-{len(tickets)}", "ar-0", "dit-0", [3])) is not None:
        tickets.append(t.ticket_id)
    first = core.get_ticket(tickets[0])
    core.arm_ticket(first.ticket_id, "ar-0", ar.incarnation_id)
    key = first.writes[0].key
    core.report_write(first.ticket_id, key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                      status=WriteStatus.OK, checksum=1)  # fmt: skip
    core.report_load(first.ticket_id, 0, 0, replica_id="dit-0", incarnation_id=dit.incarnation_id, verified={key: 1})
    assert core.cancel_ticket(first.ticket_id).state is TicketState.RELEASED  # READY never drains
    again = core.create_ticket("req-again", "ar-0", "dit-0", [3])
    assert again is not None and core.free_pages("dit-0") == 0
    held = [*tickets, again.ticket_id]
    assert len(held) == 8 + 1
    core.register_replica(dit, held_ticket_ids=held, owed_releases={t: (TicketOutcome.FAILED, "") for t in held})


def test_an_ar_refused_after_its_dit_restarted_smaller_converges_without_lost_or_leaked_pages(tmp_path) -> None:  # noqa: ANN001
    """An honest AR outgrows its bound: eight writes still in flight into a DiT incarnation that is
    gone (its tickets released DIT_REPLICA_RESTARTED) and four into the new one, of four pages.
    Its heartbeat listing the eight it was polled about is refused (the AR then beats again without
    them: tests/ar_service/test_ar_heartbeat.py), and so, after a broker restart, is its
    re-registration listing all twelve. Once the old calls return it registers, reports, and every
    page comes back: nothing lost (the live tickets drained, not freed under their writes), nothing
    leaked."""
    from dataclasses import replace

    from tests.broker.helpers import new_incarnation

    path, clock = tmp_path / "j.sqlite", ManualClock()
    core = BrokerCore(path, clock=clock, drain_quiet_seconds=0.0, journal_synchronous="OFF", lease_seconds=30.0)
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    old: list[tuple[str, WriteKey]] = []
    for n in range(8):
        t = core.create_ticket(f"old-{n}", ar.replica_id, dit.replica_id, [16])
        assert t is not None
        core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
        core.cancel_ticket(t.ticket_id)  # ended mid-write: DRAINING, its write polled
        old.extend((t.ticket_id, w.key) for w in t.writes)
    polled = list(core.heartbeat(ar.replica_id, ar.incarnation_id).poll_writes)
    assert sorted(polled) == sorted(old)
    dit = replace(new_incarnation(dit), num_pages=4)
    core.register_replica(dit)
    assert core.list_tickets() == [] and core.free_pages(dit.replica_id) == 4
    new: list[tuple[str, WriteKey]] = []
    live = []
    for n in range(4):
        t = core.create_ticket(f"new-{n}", ar.replica_id, dit.replica_id, [16])
        assert t is not None
        core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
        new.extend((t.ticket_id, w.key) for w in t.writes)
        live.append(t)
    with pytest.raises(InvalidArgument) as err:
        core.heartbeat(ar.replica_id, ar.incarnation_id, polled)
    assert err.value.reason == "TOO_MANY_ENTRIES"
    core.heartbeat(ar.replica_id, ar.incarnation_id, [])  # what the AR sends next: accepted
    core.close()

    core = BrokerCore(path, clock=clock, drain_quiet_seconds=0.0, journal_synchronous="OFF", lease_seconds=30.0)
    try:
        with pytest.raises(InvalidArgument) as err:
            core.register_replica(ar, unresolved_writes=[*old, *new])
        assert err.value.reason == "TOO_MANY_ENTRIES"
        core.register_replica(dit)
        # Restored WRITING with the writes unresolved: drained, its pages held, never freed.
        assert {t.state for t in core.list_tickets()} == {TicketState.DRAINING}
        assert core.pool_status(dit.replica_id)[0].draining == 4
        # The old calls returned (into a process that is gone): the AR registers with the rest.
        core.register_replica(ar, unresolved_writes=new)
        poll = core.heartbeat(ar.replica_id, ar.incarnation_id, []).poll_writes
        assert sorted(poll) == sorted(new)
        for t in live:
            core.report_writes(t.ticket_id, [ReportedWrite(w.key, WriteStatus.FAILED, message="cancelled")
                                             for w in t.writes], replica_id=ar.replica_id, incarnation_id=ar.incarnation_id)  # fmt: skip
        core.tick()
        (pool,) = core.pool_status(dit.replica_id)
        assert core.list_tickets() == [] and (pool.free, pool.total) == (4, 4)
        assert not core.get_replica(ar.replica_id).fenced
    finally:
        core.close()
