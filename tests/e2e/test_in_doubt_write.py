"""The ownership hand-off with real processes: a DiT rank (its Mooncake receiver) is stopped with
SIGSTOP mid-write, so the AR's engine call blocks past `transfer_timeout`.

Under test (issue 13, DESIGN.md section 6): the request fails at once, but the write is IN_DOUBT,
not final: its ticket drains and keeps every page, past any quiet period and lease. A second
request submitted meanwhile never gets those pages (checked continuously by a watcher), and the
AR packs it into another staging region instead of waiting. After SIGCONT the late bytes land in
pages the first ticket still holds, the AR reports the call's real end, the pages come back, and
the second request's image is bit for bit the image of the same request run before the fault
(the canary: no late byte reached its pages or its staging bytes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, TicketState, WriteStatus
from tests.e2e.node import REPO, running_node, wait_pools_full

pytestmark = pytest.mark.slow

LONG = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens per row
SHORT = "a red fox in the snow"
TIMEOUT_S = 3.0


def _config(cfg: dict[str, Any]) -> None:
    # `small` KV is 4 KiB/token: the long request writes ~7 MiB, far more than the loopback
    # socket buffers of a receiver that does not read, so the engine call blocks while stopped.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = TIMEOUT_S
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 32 << 20
    # The receiver's stop is a temporary hang here: past rank_stall_seconds its replica would
    # kill it and fail-stop (tests/e2e/test_stopped_rank.py).
    cfg["stages"][1]["rank_stall_seconds"] = 120.0


def _dit_ranks(node: Any) -> list[psutil.Process]:
    ranks = psutil.Process(node.process("dit-0").pid).children(recursive=True)
    assert ranks, "the DiT replica runs its pool (and its Mooncake receiver) in rank worker processes"
    return ranks


def _ticket_of(client: KvRelayClient, request_id: str) -> Any:
    for t in client.list_tickets([TicketState.RESERVED, TicketState.WRITING, TicketState.READY,
                                  TicketState.CONSUMING, TicketState.DRAINING, TicketState.RELEASED]):
        if t.request_id == request_id:
            return t
    return None


def _wait(what: str, predicate: Any, timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class PageWatcher(threading.Thread):
    """While the writer's call is blocked, the in-doubt ticket must stay live and no other live
    ticket may hold any of its pages. Checked every few milliseconds, from a second client."""

    def __init__(self, address: str, ticket_id: str, pages: set[int]) -> None:
        super().__init__(daemon=True)
        self.client = KvRelayClient(address, timeout=10)
        self.ticket_id, self.pages = ticket_id, pages
        self.writer_blocked = threading.Event()
        self.writer_blocked.set()
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.checks = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                blocked = self.writer_blocked.is_set()
                live = self.client.list_tickets()
                mine = [t for t in live if t.ticket_id == self.ticket_id]
                if blocked and not mine:
                    self.violations.append("the in-doubt ticket was released while its writer's call was blocked")
                for t in live:
                    shared = self.pages & {p for r in t.rows for p in r.page_ids}
                    if t.ticket_id != self.ticket_id and shared and mine:
                        self.violations.append(f"ticket {t.ticket_id} holds pages {sorted(shared)} of the in-doubt ticket")
                self.checks += 1
                time.sleep(0.005)
        finally:
            self.client.close()


def test_a_stopped_receiver_leaves_the_write_in_doubt_and_its_pages_held(tmp_path: Path) -> None:
    with running_node(tmp_path, "indoubt", _config) as node, KvRelayClient(node.address(), timeout=30) as client:
        total = wait_pools_full(client)[0].total_pages
        # The canary's reference, and a warm connection (the receiver's segment is cached).
        reference = client.generate(SHORT, seed=7, width=64, height=64, timeout=60).result()
        ranks = _dit_ranks(node)
        stopped = False
        watcher: PageWatcher | None = None
        try:
            for p in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGSTOP)
            stopped = True
            first = client.generate(LONG, negative_prompt=LONG, seed=1, width=64, height=64, timeout=60,
                                    request_id="in-doubt-first")
            with pytest.raises(KvRelayError) as info:
                first.result()
            assert (info.value.code, info.value.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), info.value
            # The AR stopped waiting while its engine call still runs: IN_DOUBT, not FAILED.
            ticket = _wait("the AR's IN_DOUBT report", lambda: (
                t if (t := _ticket_of(client, first.request_id)) is not None
                and any(w.status == WriteStatus.IN_DOUBT for w in t.writes) else None))
            held = {p for r in ticket.rows for p in r.page_ids}
            watcher = PageWatcher(node.address(), ticket.ticket_id, held)
            watcher.start()
            assert ticket.state == TicketState.DRAINING
            assert not any(w.status == WriteStatus.FAILED for w in ticket.writes), "a blocked call is not FAILED"
            # Past the quiet period and the lease: still held (a lease lapsing proves nothing).
            time.sleep(2.5)
            (pool,) = client.get_pools()
            assert pool.draining_pages == len(held) and pool.free_pages == total - len(held), pool
            assert _ticket_of(client, first.request_id).state == TicketState.DRAINING
            status = subprocess.run(
                [sys.executable, "-m", "kvrelay", "status", "--target", node.address()],
                capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert status.returncode == 0, status.stderr
            doubt_lines = [line for line in status.stdout.splitlines() if line.startswith(ticket.ticket_id)]
            assert any("DRAINING" in line and "dit-0" in line for line in doubt_lines), status.stdout
            assert "IN-DOUBT WRITE OF" in status.stdout and "HELD PAGES" in status.stdout, status.stdout

            # A second request while the write is in doubt: other pages (the watcher checks them
            # until the first ticket is released), and other staging bytes at the AR.
            second = client.generate(SHORT, seed=7, width=64, height=64, timeout=60, request_id="in-doubt-second")
            other = _wait("the second ticket", lambda: _ticket_of(client, second.request_id))
            assert not held & {p for r in other.rows for p in r.page_ids}
        finally:
            if stopped:
                for p in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
            if watcher is not None:
                watcher.writer_blocked.clear()
        try:
            # The engine call returns, the AR reports its final outcome, the quiet period passes.
            wait_pools_full(client, timeout=30)
            gone = _ticket_of(client, first.request_id)
            assert gone.state == TicketState.RELEASED
            assert {w.status for w in gone.writes} <= {WriteStatus.OK, WriteStatus.FAILED}, gone.writes
            result = second.result()
            assert result.png == reference.png, "the second request's pages or staging bytes were overwritten"
        finally:
            if watcher is not None:
                watcher.stop.set()
                watcher.join(10)
        assert watcher.checks > 10 and watcher.violations == [], watcher.violations[:3]
