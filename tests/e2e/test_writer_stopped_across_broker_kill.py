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
from typing import Any

import psutil
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, Ticket, TicketState
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

LONG_A = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens: 57 pages a row
LONG_B = "a harbour full of boats in the morning fog, watercolour, " * 16


def _config(cfg: dict[str, Any]) -> None:
    # `small` KV is 4 KiB/token, 64 KiB a page of 16 tokens: each request below takes ~70 of the
    # DiT's 128 pages, so the second one fits only in pages the first one gave back.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = 3.0
    cfg["stages"][0]["num_replicas"] = 2
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 8 << 20
    # One attempt per request: this test is about the failed attempt's ticket and pages (the broker
    # would otherwise run the request again after its transfer failed, holding a second ticket;
    # that retry has tests of its own).
    cfg["broker"]["max_replica_retries"] = 0


def _generate(client: KvRelayClient, prompt: str, seed: int) -> Any:
    return client.generate(prompt, negative_prompt=prompt[::-1][:200], seed=seed, width=64, height=64, timeout=90)


def _pages(ticket: Ticket) -> set[tuple[int, int]]:
    return {(r.row, p) for r in ticket.rows for p in r.page_ids}


def _processes(node: Any, name: str) -> list[psutil.Process]:
    main = psutil.Process(node.process(name).pid)
    return [main, *main.children(recursive=True)]


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        os.kill(proc.pid, sig)


class OverlapWatcher(threading.Thread):
    """While the writer is stopped its ticket stays live, and no other live ticket holds a page of
    it while it is live; polled from a client of its own, which rides out the broker's restart."""

    def __init__(self, address: str, ticket_id: str, pages: set[tuple[int, int]]) -> None:
        super().__init__(daemon=True)
        self.client = KvRelayClient(address, timeout=5)
        self.ticket_id, self.pages = ticket_id, pages
        self.writer_stopped = threading.Event()
        self.writer_stopped.set()
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
                stopped = self.writer_stopped.is_set()
                mine = any(t.ticket_id == self.ticket_id for t in live)
                if stopped and not mine:
                    self.violations.append("the stopped writer's ticket was released")
                for t in live:
                    if mine and t.ticket_id != self.ticket_id and _pages(t) & self.pages:
                        self.violations.append(f"ticket {t.ticket_id} ({t.state.name}) holds pages of the stopped writer's")
                self.checks += 1
                time.sleep(0.01)
        finally:
            self.client.close()


def _wait_broker(client: KvRelayClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.get_pools()
            return
        except KvRelayError:
            assert time.monotonic() < deadline, "the broker did not come back"
            time.sleep(0.1)


def test_a_writer_stopped_mid_write_across_a_broker_kill_keeps_its_pages_from_the_next_request(tmp_path: Path) -> None:
    with running_node(tmp_path, "killed", _config) as node, KvRelayClient(node.address(), timeout=30) as client:
        total = wait_pools_full(client)[0].total_pages
        reference = _generate(client, LONG_B, 11).result().png
        stopped: dict[str, Any] = {}
        for attempt in range(6):
            # Stop the AR replica (service and ranks) that writes the first request, once armed.
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
        overlap = OverlapWatcher(node.address(), ticket.ticket_id, held)
        overlap.start()
        try:
            assert (failure.code, failure.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), failure
            broker_pid = node.process("broker").pid
            os.kill(broker_pid, signal.SIGKILL)
            _wait_broker(client)
            assert node.process("broker").pid != broker_pid
            # Restored from the journal: still draining, every page held.
            time.sleep(2.5)  # > lease_seconds: the stopped AR is down, which proves nothing
            restored = [t for t in client.list_tickets() if t.ticket_id == ticket.ticket_id]
            assert [t.state for t in restored] == [TicketState.DRAINING], f"the stopped writer's ticket: {restored}"
            (pool,) = client.get_pools()
            assert pool.draining_pages == len(held) and pool.free_pages == total - len(held), pool
            # The second request needs some of those pages: it waits (the other AR is up).
            second = _generate(client, LONG_B, 11)
            time.sleep(3.0)
            assert [t.ticket_id for t in client.list_tickets()] == [ticket.ticket_id]
        finally:
            overlap.writer_stopped.clear()
            _signal(stopped["procs"], signal.SIGCONT)
        try:
            assert second.result().png == reference, "the second request's pages were written by the first's writer"
            wait_pools_full(client, timeout=30)
        finally:
            overlap.stop.set()
            overlap.join(10)
        assert overlap.checks > 10 and overlap.violations == [], overlap.violations[:3]
