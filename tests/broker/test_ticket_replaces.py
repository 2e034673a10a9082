"""A retried generation's new ticket beside its earlier attempt's (BrokerCore.create_ticket
`replaces`): own pages, never the old ones while a write may still land in them, and a broker
restart with both in the journal restores both as they were: the ended one keeps draining, the
unarmed one is rolled back, and no page is freed twice or early."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import FailedPrecondition, TicketOutcome, TicketState, WriteStatus

from .helpers import ManualClock, ar_spec, dit_spec, write_all

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
