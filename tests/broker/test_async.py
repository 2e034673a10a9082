"""BrokerCore's async waiting: watchers see every change, wake on release, and clean up when cancelled."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import NotFound, TicketOutcome, TicketState
from kvrelay.broker.waiters import run_maintenance
from tests.broker.helpers import ar_spec, dit_spec, load_all, write_all

TIMEOUT = 5.0


def make() -> tuple[BrokerCore, object, object]:
    core = BrokerCore(None, drain_quiet_seconds=0.01, journal_synchronous="OFF")
    ar, dit = ar_spec(), dit_spec(num_pages=4)
    core.register_replica(ar)
    core.register_replica(dit)
    return core, ar, dit


def test_watch_sees_each_state_through_released() -> None:
    async def scenario() -> list[TicketState]:
        core, ar, dit = make()
        t = core.create_ticket("r", "ar-0", "dit-0", [20])
        assert t is not None
        states: list[TicketState] = []

        async def watch() -> None:
            async for snap in core.waiters.watch_ticket(t.ticket_id):
                states.append(snap.state)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)  # type: ignore[attr-defined]
        await asyncio.sleep(0)
        done = load_all(core, write_all(core, t, ar), dit)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        core.start_consuming(done.ticket_id)
        await asyncio.sleep(0)
        core.release_ticket(done.ticket_id, TicketOutcome.OK)
        await asyncio.wait_for(watcher, TIMEOUT)
        assert core.waiters._tickets == {}  # noqa: SLF001
        return states

    states = asyncio.run(scenario())
    assert states[0] is TicketState.RESERVED and states[-1] is TicketState.RELEASED
    for s in (TicketState.WRITING, TicketState.READY, TicketState.CONSUMING):
        assert s in states


def test_a_cancelled_watch_leaves_no_waiter_and_unknown_tickets_raise() -> None:
    async def scenario() -> None:
        core, _, _ = make()
        t = core.create_ticket("r", "ar-0", "dit-0", [20])
        assert t is not None
        task = asyncio.create_task(core.waiters.wait_ticket_change(t.ticket_id, t.version))
        await asyncio.sleep(0.01)
        assert core.waiters._tickets  # noqa: SLF001
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert core.waiters._tickets == {}  # noqa: SLF001
        with pytest.raises(NotFound):
            async for _ in core.waiters.watch_ticket("nope"):
                pass

    asyncio.run(scenario())


def test_queue_wakes_when_draining_pages_free() -> None:
    async def scenario() -> None:
        core, ar, dit = make()
        t = core.create_ticket("a", "ar-0", "dit-0", [64])
        assert t is not None
        core.arm_ticket(t.ticket_id, "ar-0", ar.incarnation_id)  # type: ignore[attr-defined]
        core.cancel_ticket(t.ticket_id)
        assert core.create_ticket("b", "ar-0", "dit-0", [16]) is None
        maintenance = asyncio.create_task(run_maintenance(core, 0.005))
        waiter = asyncio.create_task(core.waiters.wait_for_change(TIMEOUT))
        await asyncio.sleep(0.05)
        assert not waiter.done(), "draining pages must not wake the queue before the writes resolve"
        write_all(core, t, ar)  # type: ignore[arg-type]
        await asyncio.wait_for(waiter, TIMEOUT)
        assert core.create_ticket("b", "ar-0", "dit-0", [16]) is not None
        maintenance.cancel()

    asyncio.run(scenario())
