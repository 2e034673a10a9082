"""Replica registry checks and the journal: write-ahead commits and recovery after a restart."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.metrics import BrokerCollector
from kvrelay.broker.placement import choose_ar_replica, choose_dit_replica
from kvrelay.broker.registry import MAX_PAGES_PER_REPLICA, Registration
from kvrelay.broker.tickets import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TicketOutcome,
    TicketState,
    Unauthenticated,
    Unavailable,
    WriteStatus,
)
from kvrelay.transfer.layout import KvGeometry
from tests.broker.helpers import (
    GEOMETRY,
    ManualClock,
    ar_spec,
    dit_spec,
    load_all,
    new_incarnation,
    write_all,
)

QUIET = 2.0


def make_core(path: Path | None, clock: ManualClock, **kw) -> BrokerCore:
    return BrokerCore(path, clock=clock, drain_quiet_seconds=QUIET, journal_synchronous="NORMAL", **kw)


def pages(core: BrokerCore, replica: str = "dit-0") -> tuple[int, int, int]:
    p = core.pool_status(replica)[0]
    return p.free, p.reserved, p.draining


# ------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", 3), ("num_kv_heads", 8), ("head_dim", 16), ("dtype", "float16")]
)
def test_geometry_mismatch_between_ar_and_dit_names_the_field(field: str, value: object) -> None:
    core = make_core(None, ManualClock())
    core.register_replica(ar_spec())
    other = replace(GEOMETRY, **{field: value})
    with pytest.raises(InvalidArgument) as err:
        core.register_replica(dit_spec(geometry=other))
    assert err.value.reason == "GEOMETRY_MISMATCH"
    assert f"geometry.{field}" in err.value.message
    # It says what to change, not only what differs.
    assert ("set the same model.dtype on both stages" if field == "dtype" else "the same KV shape") in err.value.message
    assert "dit-0" not in {s.spec.replica_id for s in core.list_replicas()}


def test_page_size_is_the_dits_own() -> None:
    core = make_core(None, ManualClock())
    core.register_replica(ar_spec())
    core.register_replica(dit_spec(geometry=KvGeometry(2, 4, 8, "bfloat16", page_size=64)))
    t = core.create_ticket("r", "ar-0", "dit-0", [65])
    assert t is not None and len(t.page_ids) == 2, "65 tokens in pages of 64"


def test_layout_version_and_token_are_checked() -> None:
    core = make_core(None, ManualClock(), registration_token="s3cret")
    with pytest.raises(Unauthenticated):
        core.register_replica(ar_spec(), token="wrong")
    with pytest.raises(InvalidArgument) as err:
        core.register_replica(replace(ar_spec(), layout_version=99), token="s3cret")
    assert err.value.reason == "LAYOUT_VERSION_MISMATCH"
    assert core.register_replica(ar_spec(), token="s3cret").registration is Registration.NEW


def test_heartbeat_renews_the_lease_and_deregister_stops_scheduling() -> None:
    clock = ManualClock()
    core = make_core(None, clock, lease_seconds=5.0)
    ar, dit = ar_spec(), dit_spec()
    core.register_replica(ar)
    core.register_replica(dit)
    for _ in range(4):
        clock.advance(4)
        core.heartbeat("ar-0", ar.incarnation_id)
        core.heartbeat("dit-0", dit.incarnation_id)
    assert core.get_replica("ar-0").up
    assert choose_ar_replica(core) == "ar-0"
    core.deregister_replica("ar-0", ar.incarnation_id)
    assert not core.get_replica("ar-0").up and choose_ar_replica(core) is None
    with pytest.raises(Unavailable):
        core.create_ticket("r", "ar-0", "dit-0", [3])
    with pytest.raises(NotFound):
        core.heartbeat("ar-9", "x")
    with pytest.raises(FailedPrecondition) as err:
        core.heartbeat("dit-0", "not-the-incarnation")
    assert err.value.reason == "STALE_INCARNATION"


def test_choose_dit_prefers_most_free_pages() -> None:
    core = make_core(None, ManualClock())
    ar = ar_spec()
    core.register_replica(ar)
    core.register_replica(dit_spec("dit-0", num_pages=16))
    core.register_replica(dit_spec("dit-1", num_pages=16))
    assert core.create_ticket("a", "ar-0", "dit-0", [16 * 4]) is not None
    assert choose_dit_replica(core, [16]) == "dit-1"
    assert choose_dit_replica(core, [16 * 13]) == "dit-1"
    assert choose_dit_replica(core, [16 * 17]) is None


def test_choose_dit_takes_only_a_replica_whose_model_generates_the_image(tmp_path: Path) -> None:
    """ReplicaSpec.max_image_side (BAGEL's position table: 1024 pixels): a larger image goes only
    to a DiT without that limit; none left is IMAGE_TOO_LARGE naming the side. The side survives a
    broker restart (the journal)."""
    from kvrelay.broker.placement import check_image_fits
    from kvrelay.errors import KvRelayServerError

    core = make_core(tmp_path / "j.sqlite", ManualClock())
    core.register_replica(ar_spec())
    core.register_replica(dit_spec("dit-0", num_pages=32, max_image_side=1024))
    core.register_replica(dit_spec("dit-1", num_pages=16))
    assert choose_dit_replica(core, [16], 1024) == "dit-0"  # the most free pages
    assert choose_dit_replica(core, [16], 2048) == "dit-1"
    check_image_fits(core, 2048, 2048)
    core.deregister_replica("dit-1", core.get_replica("dit-1").spec.incarnation_id)
    assert choose_dit_replica(core, [16], 2048) is None
    with pytest.raises(KvRelayServerError) as err:
        check_image_fits(core, 512, 2048)
    assert (err.value.reason, err.value.metadata["field"]) == ("IMAGE_TOO_LARGE", "height")
    core.close()
    again = make_core(tmp_path / "j.sqlite", ManualClock())
    assert {s.spec.replica_id: s.spec.max_image_side for s in again.list_replicas()}["dit-0"] == 1024
    again.close()


def test_a_replica_restored_from_the_journal_shows_no_lease_until_it_registers(tmp_path: Path) -> None:
    """Its lease is -inf until it registers again: ListReplicas leaves lease_expire_time unset (an
    empty Timestamp read as 1970, and `kvrelay status` showed a lease of -1796424466.8s)."""
    from kvrelay.broker.service import replica_to_proto

    core = make_core(tmp_path / "j.sqlite", ManualClock())
    core.register_replica(dit_spec("dit-0", num_pages=8))
    assert replica_to_proto(core.get_replica("dit-0")).HasField("lease_expire_time")
    core.close()
    again = make_core(tmp_path / "j.sqlite", ManualClock())
    info = replica_to_proto(again.get_replica("dit-0"))
    assert not info.HasField("lease_expire_time") and not info.up
    again.close()


# -------------------------------------------------------------------- journal


def journal_state(path: Path, ticket_id: str) -> str | None:
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT data FROM tickets WHERE ticket_id = ?", (ticket_id,)).fetchone()
    finally:
        db.close()
    return None if row is None else json.loads(row[0])["state"]


def test_every_transition_is_committed_before_it_is_revealed(tmp_path: Path) -> None:
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec()
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r", "ar-0", "dit-0", [20, 5])
    assert t is not None and journal_state(path, t.ticket_id) == "RESERVED"
    assert core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id).ticket.state.value == journal_state(
        path, t.ticket_id
    ) == "WRITING"
    assert core.cancel_ticket(t.ticket_id).state.value == journal_state(path, t.ticket_id) == "DRAINING"
    write_all(core, t, ar)
    clock.advance(QUIET)
    core.tick()
    assert journal_state(path, t.ticket_id) is None, "released tickets leave the journal"
    core.close()


def test_restart_brings_armed_tickets_back_draining_and_never_frees_silently(tmp_path: Path) -> None:
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(tp=2), dit_spec(tp=2, num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)

    unarmed = core.create_ticket("unarmed", "ar-0", "dit-0", [16])
    writing = core.create_ticket("writing", "ar-0", "dit-0", [32])
    ready = core.create_ticket("ready", "ar-0", "dit-0", [16])
    consuming = core.create_ticket("consuming", "ar-0", "dit-0", [16])
    assert unarmed and writing and ready and consuming
    for t in (writing, ready, consuming):
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    for t in (ready, consuming):
        load_all(core, write_all(core, t, ar), dit)
    core.start_consuming(consuming.ticket_id)
    core.report_write(writing.ticket_id, writing.writes[0].key, replica_id="ar-0",
                      incarnation_id=ar.incarnation_id, status=WriteStatus.OK, checksum=5)
    assert pages(core) == (27, 5, 0)
    core.close()

    clock.advance(60)
    core = make_core(path, clock)
    # Unarmed: no AR ever had a destination map, so rollback is proven. Armed WRITING: drains.
    assert core.get_ticket(writing.ticket_id).state is TicketState.DRAINING
    assert core.ticket_for_request("unarmed") is None
    assert pages(core) == (28, 2, 2), "READY + CONSUMING still reserved, WRITING draining"
    # Replicas must register again before anything else.
    with pytest.raises(NotFound):
        core.heartbeat("ar-0", ar.incarnation_id)
    assert choose_ar_replica(core) is None
    # Same DiT incarnation: it still reads `consuming`, not `ready`.
    reply = core.register_replica(dit, held_ticket_ids=[consuming.ticket_id])
    assert reply.registration is Registration.SAME_INCARNATION
    assert core.get_ticket(ready.ticket_id).state is TicketState.RELEASED
    assert core.get_ticket(consuming.ticket_id).state is TicketState.CONSUMING
    core.release_ticket(consuming.ticket_id, TicketOutcome.OK)
    assert pages(core) == (30, 0, 2)
    # Same AR incarnation: its writes are still unresolved; only reports resolve them.
    core.register_replica(ar, unresolved_writes=[(writing.ticket_id, w.key) for w in writing.writes[1:]])
    hb = core.heartbeat("ar-0", ar.incarnation_id)
    assert sorted(k for _, k in hb.poll_writes) == sorted(w.key for w in writing.writes[1:])
    clock.advance(3600)
    core.tick()
    assert core.get_ticket(writing.ticket_id).state is TicketState.DRAINING
    for w in writing.writes[1:]:
        core.report_write(writing.ticket_id, w.key, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                          status=WriteStatus.NOT_STARTED)
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(writing.ticket_id).state is TicketState.RELEASED
    assert pages(core) == (32, 0, 0)
    core.close()


def test_restart_keeps_a_ready_ticket_its_dit_lists_until_it_reads_and_releases_it(tmp_path: Path) -> None:
    """A READY ticket whose Denoise is queued at the DiT (loaded ahead of admission) and listed in
    `held_ticket_ids` keeps its pages across broker restarts; the DiT then marks it CONSUMING and
    releases it. The READY ticket it does not list is released; so is the kept one once read."""
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)
    queued = core.create_ticket("queued", "ar-0", "dit-0", [32])
    dropped = core.create_ticket("dropped", "ar-0", "dit-0", [16])
    assert queued and dropped
    for t in (queued, dropped):
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
        load_all(core, write_all(core, t, ar), dit)
    assert pages(core) == (29, 3, 0)
    core.close()

    clock.advance(60)
    core = make_core(path, clock)
    assert pages(core) == (29, 3, 0), "READY tickets wait for their DiT to re-register"
    reply = core.register_replica(dit, held_ticket_ids=[queued.ticket_id])
    assert reply.registration is Registration.SAME_INCARNATION
    assert core.get_ticket(dropped.ticket_id).state is TicketState.RELEASED
    kept = core.get_ticket(queued.ticket_id)
    assert (kept.state, kept.reason, journal_state(path, queued.ticket_id)) == (
        TicketState.READY, "BROKER_RESTARTED", "READY")
    assert pages(core) == (30, 2, 0)
    core.close()
    # Journaled READY: another restart keeps it for the DiT as well.
    core = make_core(path, clock)
    core.register_replica(dit, held_ticket_ids=[queued.ticket_id])
    assert core.get_ticket(queued.ticket_id).state is TicketState.READY and pages(core) == (30, 2, 0)
    # Admitted: the DiT reads the pages, then releases them.
    assert core.start_consuming(queued.ticket_id, "dit-0", dit.incarnation_id).state is TicketState.CONSUMING
    assert journal_state(path, queued.ticket_id) == "CONSUMING"
    assert core.release_ticket(queued.ticket_id, TicketOutcome.OK, replica_id="dit-0").state is TicketState.RELEASED
    assert pages(core) == (32, 0, 0) and journal_state(path, queued.ticket_id) is None
    core.close()


def test_a_release_retried_across_a_broker_kill_is_idempotent(tmp_path: Path) -> None:
    """The DiT retries a ReleaseTicket it got no answer to until the broker hears it
    (dit_service/releases.py). Killed after committing it: the restarted broker no longer knows
    the ticket (NOT_FOUND, which ends the retries; nothing is held). Killed before: the ticket
    comes back CONSUMING; the DiT's re-registration, which no longer lists it, releases it FAILED,
    and the retry that follows changes nothing (one release, one outcome)."""
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)
    committed = core.create_ticket("committed", "ar-0", "dit-0", [16])
    lost = core.create_ticket("lost", "ar-0", "dit-0", [16])
    assert committed and lost
    for t in (committed, lost):
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
        load_all(core, write_all(core, t, ar), dit)
        core.start_consuming(t.ticket_id, "dit-0", dit.incarnation_id)
    core.release_ticket(committed.ticket_id, TicketOutcome.OK, replica_id="dit-0")
    assert pages(core) == (31, 1, 0)
    core.close()  # kill -9: the journal is all that survives

    core = make_core(path, clock)
    with pytest.raises(NotFound):
        core.release_ticket(committed.ticket_id, TicketOutcome.OK, replica_id="dit-0")
    assert core.get_ticket(lost.ticket_id).state is TicketState.CONSUMING
    # The DiT's re-registration reports the release it still owes, with the call's outcome.
    core.register_replica(dit, held_ticket_ids=[], owed_releases={lost.ticket_id: (TicketOutcome.OK, "")})
    first = core.get_ticket(lost.ticket_id)
    assert (first.state, first.outcome, first.reason) == (TicketState.RELEASED, TicketOutcome.OK, "")
    again = core.release_ticket(lost.ticket_id, TicketOutcome.OK, replica_id="dit-0")
    assert (again.state, again.outcome) == (TicketState.RELEASED, TicketOutcome.OK)
    assert pages(core) == (32, 0, 0)
    assert core.released_total == 1
    core.close()


@pytest.mark.parametrize("killed", ["before the reconciliation", "after the reconciliation", "twice before"])
def test_a_release_the_dit_owes_across_a_broker_restart_records_the_dits_outcome(tmp_path: Path, killed: str) -> None:
    """Tickets T1 (the call made its image, release OK owed) and T2 (the caller cancelled,
    release CANCELLED owed) are CONSUMING when the broker is killed; T3 is READY and no call
    holds it any more (not listed, not owed). The restarted broker orphans all three (FAILED
    BROKER_RESTARTED: the requests died with it); then the DiT re-registers, reporting T1 and T2
    as owed. T1 and T2 are recorded with the DiT's outcomes, T3 FAILED BROKER_RESTARTED (nobody
    knows better). Each is released once: the owed ReleaseTickets that follow change nothing,
    and after a kill -9 at any point the journal replays to the same end (before: T1 and T2 were
    recorded FAILED BROKER_RESTARTED)."""
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)
    tickets = []
    for name in ("t1", "t2", "t3"):
        t = core.create_ticket(name, "ar-0", "dit-0", [16])
        assert t
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
        load_all(core, write_all(core, t, ar), dit)
        if name != "t3":
            core.start_consuming(t.ticket_id, "dit-0", dit.incarnation_id)
        tickets.append(t.ticket_id)
    t1, t2, t3 = tickets
    core.close()  # kill -9
    owed = {t1: (TicketOutcome.OK, ""), t2: (TicketOutcome.CANCELLED, "denoise cancelled by the caller")}
    core = make_core(path, clock)
    if killed == "twice before":
        core.close()
        core = make_core(path, clock)
    assert core.get_ticket(t1).outcome is TicketOutcome.FAILED  # orphaned, for now
    core.register_replica(dit, held_ticket_ids=[], owed_releases=owed)
    if killed == "after the reconciliation":
        core.close()
        core = make_core(path, clock)
        for t in tickets:  # committed: released tickets left the journal
            with pytest.raises(NotFound):
                core.release_ticket(t, TicketOutcome.OK, replica_id="dit-0", incarnation_id=dit.incarnation_id)
        assert pages(core) == (32, 0, 0)
        core.close()
        return
    got = {t: (core.get_ticket(t).state, core.get_ticket(t).outcome, core.get_ticket(t).reason) for t in tickets}
    assert got == {
        t1: (TicketState.RELEASED, TicketOutcome.OK, ""),
        t2: (TicketState.RELEASED, TicketOutcome.CANCELLED, "denoise cancelled by the caller"),
        t3: (TicketState.RELEASED, TicketOutcome.FAILED, "BROKER_RESTARTED"),
    }
    for t, (outcome, reason) in owed.items():  # the owed ReleaseTickets arrive: no change
        again = core.release_ticket(t, outcome, reason, replica_id="dit-0", incarnation_id=dit.incarnation_id)
        assert (again.state, again.outcome) == (TicketState.RELEASED, outcome)
    assert core.released_total == 3
    assert pages(core) == (32, 0, 0)
    core.close()


def test_an_owed_release_that_reaches_a_restarted_broker_first_records_the_dits_outcome(tmp_path: Path) -> None:
    """The owed ReleaseTicket may reach the restarted broker before the DiT re-registers: the
    orphaned CONSUMING ticket takes the DiT's outcome then too, and the registration that
    follows (still reporting it owed: the answer was lost) changes nothing."""
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("t", "ar-0", "dit-0", [16])
    assert t
    core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    load_all(core, write_all(core, t, ar), dit)
    core.start_consuming(t.ticket_id, "dit-0", dit.incarnation_id)
    core.close()
    core = make_core(path, clock)
    done = core.release_ticket(t.ticket_id, TicketOutcome.OK, replica_id="dit-0", incarnation_id=dit.incarnation_id)
    assert (done.state, done.outcome, done.reason) == (TicketState.RELEASED, TicketOutcome.OK, "")
    core.register_replica(dit, held_ticket_ids=[], owed_releases={t.ticket_id: (TicketOutcome.OK, "")})
    assert core.get_ticket(t.ticket_id).outcome is TicketOutcome.OK
    assert core.released_total == 1
    assert pages(core) == (32, 0, 0)
    core.close()


def test_restart_then_new_ar_incarnation_resolves_as_writer_gone(tmp_path: Path) -> None:
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock)
    ar, dit = ar_spec(), dit_spec()
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r", "ar-0", "dit-0", [40])
    assert t is not None
    core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    core.fence_replica("dit-0", "test fence survives restart")
    core.close()

    core = make_core(path, clock)
    assert core.get_replica("dit-0").fenced
    core.register_replica(new_incarnation(ar))
    assert {w.status for w in core.get_ticket(t.ticket_id).writes} == {WriteStatus.WRITER_GONE}
    clock.advance(QUIET)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
    core.close()
    # And the ticket stays released across another restart.
    core = make_core(path, clock)
    assert pages(core) == (64, 0, 0)
    core.close()


def test_a_deregistered_writer_is_still_polled_for_its_draining_writes() -> None:
    clock = ManualClock()
    core = make_core(None, clock)
    ar, dit = ar_spec(), dit_spec()
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r", "ar-0", "dit-0", [40])
    assert t is not None
    core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)
    core.cancel_ticket(t.ticket_id)
    core.deregister_replica("ar-0", ar.incarnation_id)
    hb = core.heartbeat("ar-0", ar.incarnation_id)
    assert [k for _, k in hb.poll_writes] == [w.key for w in t.writes]
    assert not core.get_replica("ar-0").up, "deregistering is not proof, and not schedulable either"
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING


# ------------------------------------------------------------ registration floods


def test_a_dit_claiming_billions_of_pages_is_refused_before_the_broker_allocates_them() -> None:
    # Found black-box: one RegisterReplica with num_pages 4e9 (a uint32 field) grew the broker
    # by 4 GB (one byte of state per page) and blocked its event loop for 10 s.
    core = make_core(None, ManualClock())
    with pytest.raises(InvalidArgument) as err:
        core.register_replica(dit_spec("dit-9", num_pages=MAX_PAGES_PER_REPLICA + 1))
    assert err.value.reason == "TOO_MANY_PAGES"
    assert "replica.num_pages" in err.value.message
    assert "dit-9" not in core.registry and core.pool_status() == []
    core.register_replica(dit_spec("dit-0", num_pages=MAX_PAGES_PER_REPLICA))  # the bound itself is fine


def test_a_flood_of_made_up_replica_ids_is_capped_and_idle_ones_make_room(tmp_path: Path) -> None:
    # Found black-box: 2000 RegisterReplica calls with the replica token and made-up ids
    # (ar-1000...) were all kept, in memory, in the journal and as metric labels, for good.
    clock = ManualClock()
    core = make_core(tmp_path / "j.sqlite", clock)
    core.registry.max_replicas = 8
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0")
    core.register_replica(ar)
    core.register_replica(dit)
    ticket = core.create_ticket("req-1", ar.replica_id, dit.replica_id, [20])
    assert ticket is not None
    fakes = [ar_spec(f"ar-{100 + i}") for i in range(6)]
    for spec in fakes:
        core.register_replica(spec)
    with pytest.raises(ResourceExhausted) as err:
        core.register_replica(ar_spec("ar-999"))
    assert err.value.reason == "TOO_MANY_REPLICAS"
    assert "at most 8" in err.value.message
    # The fakes never heartbeat: once their leases lapse they are forgotten to make room. ar-0 and
    # dit-0 lapse too but are kept: a live ticket names them (its writes need proof of their end).
    clock.advance(core.lease_seconds + 1)
    core.register_replica(ar_spec("ar-999"))
    assert sorted(r.spec.replica_id for r in core.registry) == ["ar-0", "ar-999", "dit-0"]
    assert [p.replica_id for p in core.pool_status()] == ["dit-0"]
    core.journal.close()
    restored = make_core(tmp_path / "j.sqlite", clock)
    assert sorted(r.spec.replica_id for r in restored.registry) == ["ar-0", "ar-999", "dit-0"]
    # A forgotten replica that was only partitioned away registers again as new.
    restored.register_replica(fakes[0])
    assert fakes[0].replica_id in restored.registry


def test_a_full_registry_of_live_replicas_refuses_a_new_id_and_keeps_a_fence() -> None:
    clock = ManualClock()
    core = make_core(None, clock)
    core.registry.max_replicas = 2
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0")
    core.register_replica(ar)
    core.register_replica(dit)
    with pytest.raises(ResourceExhausted):
        core.register_replica(ar_spec("ar-1"))
    core.fence_replica("ar-0", "test")
    clock.advance(core.lease_seconds + 1)
    core.register_replica(ar_spec("ar-1"))  # dit-0 (lapsed, idle) made room; the fenced ar-0 stays
    assert sorted(r.spec.replica_id for r in core.registry) == ["ar-0", "ar-1"]
    assert core.registry.get("ar-0").fenced
    # Re-registering a known id never needs room.
    core.register_replica(new_incarnation(ar))


def test_a_lost_journal_numbers_tickets_above_the_old_ones(tmp_path: Path) -> None:
    """DiT page fences order claims by ticket sequence (a page only goes to later tickets), and a
    DiT may outlive the broker's journal: a broker on a new journal must not number from 1 again,
    or the DiT would refuse every new ticket of a page that an old one claimed."""
    clock = ManualClock()
    old = make_core(tmp_path / "old.sqlite", clock)
    old.register_replica(ar_spec())
    old.register_replica(dit_spec())
    firsts = [old.create_ticket(f"r{i}", "ar-0", "dit-0", [16]) for i in range(3)]
    old.close()
    clock.advance(1.0)
    lost = make_core(tmp_path / "new.sqlite", clock)  # the journal is gone
    lost.register_replica(ar_spec())
    lost.register_replica(dit_spec())
    t = lost.create_ticket("after", "ar-0", "dit-0", [16])
    assert t and all(f and t.sequence > f.sequence for f in firsts)
    lost.close()
    again = make_core(tmp_path / "new.sqlite", clock)  # a kept journal numbers on
    again.register_replica(ar_spec())
    again.register_replica(dit_spec())
    nxt = again.create_ticket("next", "ar-0", "dit-0", [16])
    assert nxt and nxt.sequence == t.sequence + 1
    again.close()


def test_pools_of_journaled_replicas_that_are_not_live_are_no_capacity(tmp_path: Path) -> None:
    # Found black-box: `kvrelay status` listed the DiT replicas of an earlier config that shared
    # the journal, their pools 4096 FREE. They are kept (an in-doubt ticket's pages stay held
    # until the replica comes back or is proven gone) but no request can get their pages.
    path = tmp_path / "broker.sqlite"
    clock = ManualClock()
    core = make_core(path, clock, lease_seconds=10.0)
    old_ar, old_dit = ar_spec("old-ar"), dit_spec("old-dit", num_pages=32)
    core.register_replica(old_ar)
    core.register_replica(old_dit)
    held = core.create_ticket("held", "old-ar", "old-dit", [16])
    assert held is not None
    core.arm_ticket(held.ticket_id, "old-ar", old_ar.incarnation_id)
    core.close()

    clock.advance(60.0)
    again = make_core(path, clock, lease_seconds=10.0)
    again.register_replica(ar_spec("ar-0"))
    again.register_replica(dit_spec("dit-0", num_pages=64))
    by_id = {p.replica_id: p for p in again.pool_status()}
    old, new = by_id["old-dit"], by_id["dit-0"]
    # Accounting stays exact and the armed ticket's pages stay held ...
    assert (old.total, old.free + old.reserved + old.draining) == (32, 32)
    assert old.draining == len(held.page_ids) > 0
    # ... but the pool is reported not live, with nothing available.
    assert (old.up, old.available) == (False, 0)
    assert (new.up, new.available) == (True, 64)
    assert choose_dit_replica(again, [16]) == "dit-0"
    registry = CollectorRegistry()
    registry.register(BrokerCollector(again))
    assert registry.get_sample_value("kvrelay_pages_available", {"replica": "old-dit"}) == 0
    assert registry.get_sample_value("kvrelay_pages_available", {"replica": "dit-0"}) == 64
    assert registry.get_sample_value("kvrelay_pages", {"replica": "old-dit", "state": "free"}) == old.free

    # A live replica whose lease lapses is reported down the same way.
    clock.advance(11.0)
    (lapsed,) = again.pool_status("dit-0")
    assert (lapsed.up, lapsed.available, lapsed.free) == (False, 0, 64)
    again.close()
