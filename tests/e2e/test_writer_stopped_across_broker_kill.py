"""A writer stopped mid-write, then the broker killed (`kill -9`) and restarted on its journal, with
real processes (Mooncake TCP, two AR replicas, a DiT pool that holds one long request at a time).

Under test (DESIGN.md sections 6 and 11): the stopped AR's writes are unresolved, so its ticket
drains and keeps every page; the broker's restart brings it back DRAINING, never freed (a lease
lapsing proves nothing, and neither does the restart). A second request that needs those pages
waits in the queue, served by the other AR once it can, and no live ticket ever shares a page with
the stopped writer's (checked continuously, across the restart). After SIGCONT the late writes
land in the pages the first ticket still holds, the AR reports them, and the second request's image
is bit for bit the image of the same request run before the fault.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvrelay.client import KvRelayClient, Ticket, TicketState
from tests.e2e.node import running_node, wait_broker, wait_pools_full
from tests.e2e.stopped_writer import (
    LONG_B,
    TicketWatcher,
    generate_long,
    pages_of,
    signal_all,
    stop_the_writer_of_a_long_request,
    two_ars_one_long_request_at_a_time,
)

pytestmark = pytest.mark.slow


class OverlapWatcher(TicketWatcher):
    """While the writer is stopped its ticket stays live, and no other live ticket holds a page of
    it while it is live."""

    def __init__(self, address: str, ticket_id: str, pages: set[tuple[int, int]]) -> None:
        super().__init__(address)
        self.ticket_id, self.pages = ticket_id, pages
        self.writer_stopped = threading.Event()
        self.writer_stopped.set()

    def check(self, live: list[Ticket]) -> list[str]:
        violations = []
        mine = any(t.ticket_id == self.ticket_id for t in live)
        if self.writer_stopped.is_set() and not mine:
            violations.append("the stopped writer's ticket was released")
        for t in live:
            if mine and t.ticket_id != self.ticket_id and pages_of(t) & self.pages:
                violations.append(
                    f"ticket {t.ticket_id} ({t.state.name}) holds pages of the stopped writer's"
                )
        return violations


def test_a_writer_stopped_mid_write_across_a_broker_kill_keeps_its_pages_from_the_next_request(
    tmp_path: Path,
) -> None:
    with (
        running_node(tmp_path, "killed", two_ars_one_long_request_at_a_time) as node,
        KvRelayClient(node.address(), timeout=30) as client,
    ):
        total = wait_pools_full(client)[0].total_pages
        reference = generate_long(client, LONG_B, 11).result().png
        stopped = stop_the_writer_of_a_long_request(node, client)
        failure, ticket = stopped.failure, stopped.ticket
        held = pages_of(ticket)
        overlap = OverlapWatcher(node.address(), ticket.ticket_id, held)
        overlap.start()
        try:
            assert (failure.code, failure.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), failure
            broker_pid = node.process("broker").pid
            os.kill(broker_pid, signal.SIGKILL)
            wait_broker(client)
            assert node.process("broker").pid != broker_pid
            # Restored from the journal: still draining, every page held.
            time.sleep(2.5)  # > lease_seconds: the stopped AR is down, which proves nothing
            restored = [t for t in client.list_tickets() if t.ticket_id == ticket.ticket_id]
            assert [t.state for t in restored] == [TicketState.DRAINING], (
                f"the stopped writer's ticket: {restored}"
            )
            (pool,) = client.get_pools()
            assert pool.draining_pages == len(held) and pool.free_pages == total - len(held), pool
            # The second request needs some of those pages: it waits (the other AR is up).
            second = generate_long(client, LONG_B, 11)
            time.sleep(3.0)
            assert [t.ticket_id for t in client.list_tickets()] == [ticket.ticket_id]
        finally:
            overlap.writer_stopped.clear()
            signal_all(stopped.procs, signal.SIGCONT)
        try:
            assert second.result().png == reference, (
                "the second request's pages were written by the first's writer"
            )
            wait_pools_full(client, timeout=30)
        finally:
            overlap.stop.set()
            overlap.join(10)
        assert overlap.checks > 10 and overlap.violations == [], overlap.violations[:3]
