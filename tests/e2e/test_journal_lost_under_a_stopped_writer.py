"""A broker restarted WITHOUT its journal while an AR's write is in doubt, with real processes
(Mooncake TCP, two AR replicas, a DiT pool that holds one long request at a time).

The writer (an AR replica: service and ranks) is SIGSTOPped once its ticket is armed, so its
Mooncake writes into the DiT's pages stay in doubt; then the broker is stopped, its journal deleted
and the broker killed: `kvrelay up` starts a new one on an empty journal, which knows neither the
ticket nor the DiT. Before, the DiT registered again with its same incarnation and came back with
every page free, and the next request got pages the stopped writer still wrote into (its bytes
landed in them at SIGCONT). Now a DiT incarnation registered before that the broker holds no record
of is answered fenced: it fails stop, the supervisor starts a new incarnation (new memory, new
transport ports) and the next request runs there. Checked continuously while the writer is stopped:
no live ticket holds a page of the stopped writer's in the memory of the DiT process it wrote to;
after SIGCONT the second request's image is bit for bit the image of the same request run before.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from kvrelay.client import KvRelayClient, Ticket, TicketState
from tests.e2e.node import running_node, wait_broker, wait_pools_full
from tests.e2e.stopped_writer import (
    LONG_B,
    TicketWatcher,
    generate_long,
    pages_of,
    processes_of,
    signal_all,
    stop_the_writer_of_a_long_request,
    two_ars_one_long_request_at_a_time,
)

pytestmark = pytest.mark.slow


def _alive(procs: list[psutil.Process]) -> bool:
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


class StaleMemoryWatcher(TicketWatcher):
    """While the writer is stopped, no live ticket may hold one of its pages in the memory of the
    DiT process it wrote to (while any process of that incarnation still lives)."""

    def __init__(
        self, address: str, dit_id: str, dit_procs: list[psutil.Process], pages: set[tuple[int, int]]
    ) -> None:
        super().__init__(address)
        self.dit_id, self.dit_procs, self.pages = dit_id, dit_procs, pages

    def check(self, live: list[Ticket]) -> list[str]:
        return [
            f"ticket {t.ticket_id} ({t.state.name}) holds {len(pages_of(t) & self.pages)} pages the stopped "
            "writer may still write, in the DiT process it writes to"
            for t in live
            if t.dit_replica_id == self.dit_id and pages_of(t) & self.pages and _alive(self.dit_procs)
        ]


def test_a_broker_restarted_without_its_journal_never_gives_a_stopped_writers_pages_to_a_new_ticket(
    tmp_path: Path,
) -> None:
    with (
        running_node(tmp_path, "lost", two_ars_one_long_request_at_a_time) as node,
        KvRelayClient(node.address(), timeout=30) as client,
    ):
        wait_pools_full(client)
        reference = generate_long(client, LONG_B, 11).result().png
        stopped = stop_the_writer_of_a_long_request(node, client)
        failure, ticket = stopped.failure, stopped.ticket
        held = pages_of(ticket)
        dit_procs = processes_of(node, ticket.dit_replica_id)
        guard = StaleMemoryWatcher(node.address(), ticket.dit_replica_id, dit_procs, held)
        try:
            assert (failure.code, failure.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), failure
            assert [t.state for t in client.list_tickets() if t.ticket_id == ticket.ticket_id] == [
                TicketState.DRAINING
            ]
            # Lose the journal: the broker stopped first, so that it cannot write it back.
            broker_pid = node.process("broker").pid
            os.kill(broker_pid, signal.SIGSTOP)
            journal = [p for p in tmp_path.iterdir() if p.name.startswith("lost.sqlite")]
            assert journal, list(tmp_path.iterdir())
            for path in journal:
                path.unlink()
            os.kill(broker_pid, signal.SIGKILL)
            wait_broker(client)
            assert node.process("broker").pid != broker_pid
            guard.start()
            assert ticket.ticket_id not in {t.ticket_id for t in client.list_tickets()}  # the journal is gone
            # Once the DiT has a pool again (its same process before the fix; its next incarnation
            # now), the second request needs pages the stopped writer writes (70 + 70 of 128).
            deadline = time.monotonic() + 90
            while not (
                {r.role.name for r in client.list_replicas() if r.up} >= {"AR", "DIT"}
                and [p for p in client.get_pools() if p.free_pages == p.total_pages]
            ):
                assert time.monotonic() < deadline, "no AR and DiT registered with the new broker"
                time.sleep(0.05)
            second = generate_long(client, LONG_B, 11)
            deadline = time.monotonic() + 30
            while not [t for t in client.list_tickets() if t.dit_replica_id == ticket.dit_replica_id]:
                assert time.monotonic() < deadline, "the second request never got a ticket"
                time.sleep(0.02)
            # The canary: the writer runs again once the second ticket's writes are verified and
            # the DiT reads its pages (READY, CONSUMING) if that comes within 5 s, so bytes of the
            # stale write that land then change the image (before the fix: in the same process;
            # now: in one that is gone). Seen on Mooncake TCP before the fix: it did not come (the
            # second ticket waited for its writes while the first writer was stopped).
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not [
                t for t in client.list_tickets()
                if t.dit_replica_id == ticket.dit_replica_id and t.state in (TicketState.READY, TicketState.CONSUMING)
            ]:  # fmt: skip
                time.sleep(0.005)
        finally:
            signal_all(stopped.procs, signal.SIGCONT)
            time.sleep(0.2)
            guard.stop.set()
        guard.join(10)
        # The canary first: the stale writer's bytes in the second request's pages change its image.
        assert second.result().png == reference, (
            "the second request's pages were written by the first's writer"
        )
        assert guard.checks > 10 and guard.violations == [], guard.violations[:3]
        wait_pools_full(client, timeout=30)
