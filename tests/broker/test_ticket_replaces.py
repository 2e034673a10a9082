"""A retried generation's new ticket beside its earlier attempt's (BrokerCore.create_ticket
`replaces`): own pages, never the old ones while a write may still land in them, and a broker
restart with both in the journal restores both as they were: the ended one keeps draining, the
unarmed one is rolled back, and no page is freed twice or early."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import FailedPrecondition, TicketOutcome, TicketState, WriteStatus

from .helpers import ManualClock, ar_spec, dit_spec, load_all, write_all

QUIET = 2.0


def _core(path: Path, clock: ManualClock) -> BrokerCore:
    return BrokerCore(path, clock=clock, drain_quiet_seconds=QUIET, journal_synchronous="OFF")


def _accounting(core: BrokerCore, replica_id: str) -> tuple[int, int, int]:
    (p,) = core.pool_status(replica_id)
    assert p.free + p.reserved + p.draining == p.total, p
    return p.free, p.reserved, p.draining


def test_a_retry_ticket_sits_beside_the_draining_one_and_both_survive_a_restart(tmp_path: Path) -> None:
    clock = ManualClock()
    path = tmp_path / "journal.sqlite"
    core = _core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    first = core.create_ticket("r", "ar-0", "dit-0", [20])
    assert first is not None
    # Idempotent as ever without `replaces`; and a live ticket is never replaced.
    assert core.create_ticket("r", "ar-0", "dit-0", [20]) == first
    with pytest.raises(FailedPrecondition) as live:
        core.create_ticket("r", "ar-0", "dit-0", [20], replaces=first.ticket_id)
    assert live.value.reason == "TICKET_LIVE"
    core.arm_ticket(first.ticket_id, "ar-0", ar.incarnation_id)
    ended = core.cancel_ticket(first.ticket_id, TicketOutcome.FAILED, "REPLICA_UNAVAILABLE")
    assert ended.state is TicketState.DRAINING  # armed, writes unresolved: its pages wait
    second = core.create_ticket("r", "ar-0", "dit-0", [20], replaces=first.ticket_id)
    assert second is not None and second.ticket_id != first.ticket_id
    assert not set(second.page_ids) & set(first.page_ids)
    ticket = core.ticket_for_request("r")
    assert ticket is not None and ticket.ticket_id == second.ticket_id
    assert _accounting(core, "dit-0") == (8 - 4, 2, 2)
    core.close()

    core = _core(path, clock)
    try:
        old, new = core.get_ticket(first.ticket_id), core.get_ticket(second.ticket_id)
        assert (old.state, old.outcome, old.reason) == (
            TicketState.DRAINING, TicketOutcome.FAILED, "REPLICA_UNAVAILABLE"
        )
        assert new.state is TicketState.RELEASED  # unarmed, its request gone with the broker: rolled back
        assert _accounting(core, "dit-0") == (8 - 2, 0, 2)
        clock.advance(3600)
        core.tick()
        assert _accounting(core, "dit-0") == (8 - 2, 0, 2)  # no write of the first is resolved yet
        write_all(core, old, ar, WriteStatus.FAILED)
        clock.advance(QUIET)
        core.tick()
        assert core.get_ticket(first.ticket_id).state is TicketState.RELEASED
        assert _accounting(core, "dit-0") == (8, 0, 0)
        assert core.ticket_for_request("r") is None
    finally:
        core.close()


def test_a_later_generations_ticket_sits_beside_an_earlier_generations_and_the_id_names_the_newest_held(
    tmp_path: Path,
) -> None:
    """`beside`: a new generation under the id of an earlier one whose ticket is still held (in any
    state; here armed, then draining) gets pages of its own and takes the id; once it is released
    the id names the earlier ticket again, live exactly as after a restart (journal replay)."""
    clock = ManualClock()
    path = tmp_path / "journal.sqlite"
    core = _core(path, clock)
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    old = core.create_ticket("r", "ar-0", "dit-0", [20])
    assert old is not None
    core.arm_ticket(old.ticket_id, "ar-0", ar.incarnation_id)
    new = core.create_ticket("r", "ar-0", "dit-0", [20], beside=old.ticket_id)
    assert new is not None and new.ticket_id != old.ticket_id
    assert not set(new.page_ids) & set(old.page_ids)
    named = core.ticket_for_request("r")
    assert named is not None and named.ticket_id == new.ticket_id
    # Idempotent on the new one (it holds the id now), as without `beside`.
    assert core.create_ticket("r", "ar-0", "dit-0", [20]) == new
    assert core.cancel_ticket(old.ticket_id, TicketOutcome.FAILED, "WRITE_FAILED").state is TicketState.DRAINING
    core.arm_ticket(new.ticket_id, "ar-0", ar.incarnation_id)
    write_all(core, core.get_ticket(new.ticket_id), ar)
    load_all(core, core.get_ticket(new.ticket_id), dit)
    core.start_consuming(new.ticket_id)
    core.release_ticket(new.ticket_id, TicketOutcome.OK, replica_id="dit-0")
    assert _accounting(core, "dit-0") == (8 - 2, 0, 2)
    named = core.ticket_for_request("r")
    assert named is not None and named.ticket_id == old.ticket_id  # the newest still held
    core.close()

    core = _core(path, clock)
    try:
        named = core.ticket_for_request("r")
        assert named is not None and named.ticket_id == old.ticket_id  # the same after the replay
        assert core.get_ticket(old.ticket_id).state is TicketState.DRAINING
        assert _accounting(core, "dit-0") == (8 - 2, 0, 2)
    finally:
        core.close()
