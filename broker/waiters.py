"""The event-loop side of BrokerCore: tasks parked until the core changes, and its maintenance task.

Owns the futures of everyone waiting for a ticket's next version (`WatchTicket`, the
orchestrator's transfer watch) or for the next freed pages or registered replica (the
orchestrator's queue), and `run_maintenance`, the loop that lets the core's quiet periods pass.
BrokerCore wakes them after each journal commit (`notify_ticket`, `notify_change`), so a waiter
never sees a change that is not yet durable. Must never change the core's state or hold a
ticket: a waiter only reads snapshots, and a cancelled one leaves no future behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import structlog

from kvrelay.broker.tickets import Ticket, TicketId, TicketState

if TYPE_CHECKING:
    from kvrelay.broker.core import BrokerCore

log = structlog.get_logger("kvrelay.broker")


class ChangeWaiters:
    """Waiters on one BrokerCore. Single-threaded: the core's event loop is its only caller.

    `snapshot(ticket_id)` is the core's current view of a ticket (RELEASED ones included);
    it raises NotFound for a ticket it never knew.
    """

    def __init__(self, snapshot: Callable[[TicketId], Ticket]) -> None:
        self._snapshot = snapshot
        self._tickets: dict[TicketId, list[asyncio.Future[None]]] = {}
        self._change: list[asyncio.Future[None]] = []

    async def wait_ticket_change(
        self, ticket_id: TicketId, version: int, timeout: float | None = None
    ) -> Ticket:
        """The ticket once its version differs from `version` (or now, after `timeout`)."""
        snap = self._snapshot(ticket_id)
        if snap.version != version or snap.state is TicketState.RELEASED:
            return snap
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tickets.setdefault(ticket_id, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            waiters = self._tickets.get(ticket_id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._tickets[ticket_id]
        return self._snapshot(ticket_id)

    async def watch_ticket(self, ticket_id: TicketId) -> AsyncIterator[Ticket]:
        """The ticket now, then every change, ending after RELEASED."""
        snap = self._snapshot(ticket_id)
        yield snap
        while snap.state is not TicketState.RELEASED:
            nxt = await self.wait_ticket_change(ticket_id, snap.version)
            if nxt.version != snap.version:
                yield nxt
            snap = nxt

    async def wait_for_change(self, timeout: float | None = None) -> None:
        """Return when pages were freed or a replica registered (the orchestrator's queue retries)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._change.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if fut in self._change:
                self._change.remove(fut)

    def notify_ticket(self, ticket_id: TicketId) -> None:
        """The ticket changed (and the change is journaled): wake its waiters."""
        for fut in self._tickets.pop(ticket_id, []):
            if not fut.done():
                fut.set_result(None)

    def notify_change(self) -> None:
        """Pages were freed or a replica registered: wake every `wait_for_change`."""
        waiters, self._change = self._change, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


async def run_maintenance(core: BrokerCore, interval: float = 0.25) -> None:
    """The broker process's background task: drain quiet periods and lease-based liveness.

    Runs until cancelled. Lease expiry needs no action here (liveness is computed from the
    lease on read, and an expired lease is never proof that a writer is gone); draining
    tickets are released once resolved and quiet.
    """
    while True:
        try:
            if core.journal.keep_on_disk():
                log.error("journal_restored", path=core.journal.path,
                          detail="the journal file was deleted or replaced while the broker ran; written back")
            core.tick()
        except Exception:
            # A journal failure leaves memory ahead of disk: the process must stop and recover.
            log.exception("broker_maintenance_failed")
            raise
        await asyncio.sleep(interval)
