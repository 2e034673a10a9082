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
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, Ticket, TicketState
from tests.e2e.node import running_node, wait_pools_full
from tests.e2e.test_writer_stopped_across_broker_kill import (
    LONG_A,
    LONG_B,
    _config,
    _generate,
    _pages,
    _processes,
    _signal,
    _wait_broker,
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


class StaleMemoryWatcher(threading.Thread):
    """While the writer is stopped, no live ticket may hold one of its pages in the memory of the
    DiT process it wrote to (while any process of that incarnation still lives)."""

    def __init__(self, address: str, dit_id: str, dit_procs: list[psutil.Process], pages: set[tuple[int, int]]) -> None:
        super().__init__(daemon=True)
        self.client = KvRelayClient(address, timeout=5)
        self.dit_id, self.dit_procs, self.pages = dit_id, dit_procs, pages
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.checks = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    live = self.client.list_tickets()
                except KvRelayError:  # the broker is restarting
                    time.sleep(0.05)
                    continue
                for t in live:
                    if t.dit_replica_id == self.dit_id and _pages(t) & self.pages and _alive(self.dit_procs):
                        self.violations.append(
                            f"ticket {t.ticket_id} ({t.state.name}) holds {len(_pages(t) & self.pages)} pages the stopped "
                            "writer may still write, in the DiT process it writes to"
                        )
                self.checks += 1
                time.sleep(0.01)
        finally:
            self.client.close()


def test_a_broker_restarted_without_its_journal_never_gives_a_stopped_writers_pages_to_a_new_ticket(
    tmp_path: Path,
) -> None:
    with running_node(tmp_path, "lost", _config) as node, KvRelayClient(node.address(), timeout=30) as client:
        wait_pools_full(client)
        reference = _generate(client, LONG_B, 11).result().png
        stopped: dict[str, Any] = {}
        for attempt in range(6):
            armed = threading.Event()

            def watch(armed: threading.Event = armed) -> None:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not armed.is_set():
                    for t in client.list_tickets():
                        if t.state == TicketState.WRITING:
                            procs = _processes(node, t.ar_replica_id)
                            _signal(procs, signal.SIGSTOP)
                            stopped.update(ticket=t, procs=procs)
                            armed.set()
                            return
                    time.sleep(0.0005)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            first = _generate(client, LONG_A + str(attempt), attempt)
            try:
                first.result()
                failure: KvRelayError | None = None
            except KvRelayError as err:
                failure = err
            armed.set()
            watcher.join(5)
            if stopped and failure is not None:
                break
            if stopped:  # stopped just after its last report: nothing to test, again
                _signal(stopped["procs"], signal.SIGCONT)
                stopped.clear()
            wait_pools_full(client, timeout=30)
        else:
            pytest.fail("never stopped the writer between arming and its reports")
        ticket: Ticket = stopped["ticket"]
        held = _pages(ticket)
        dit_procs = _processes(node, ticket.dit_replica_id)
        guard = StaleMemoryWatcher(node.address(), ticket.dit_replica_id, dit_procs, held)
        try:
            assert (failure.code, failure.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), failure
            assert [t.state for t in client.list_tickets() if t.ticket_id == ticket.ticket_id] == [TicketState.DRAINING]
            # Lose the journal: the broker stopped first, so that it cannot write it back.
            broker_pid = node.process("broker").pid
            os.kill(broker_pid, signal.SIGSTOP)
            journal = [p for p in tmp_path.iterdir() if p.name.startswith("lost.sqlite")]
            assert journal, list(tmp_path.iterdir())
            for path in journal:
                path.unlink()
            os.kill(broker_pid, signal.SIGKILL)
            _wait_broker(client)
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
            second = _generate(client, LONG_B, 11)
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
            _signal(stopped["procs"], signal.SIGCONT)
            time.sleep(0.2)
            guard.stop.set()
        guard.join(10)
        # The canary first: the stale writer's bytes in the second request's pages change its image.
        assert second.result().png == reference, "the second request's pages were written by the first's writer"
        assert guard.checks > 10 and guard.violations == [], guard.violations[:3]
        wait_pools_full(client, timeout=30)
