"""A writer stopped mid-write, the harness of the e2e tests that need one: an AR replica (its
service and rank workers) SIGSTOPped the moment a ticket is armed (WRITING), so its writes into the
DiT's pages stay in doubt until SIGCONT. Also the long requests and the node config that make the
write last long enough to be caught in the middle (two AR replicas, one DiT that holds one long
request at a time).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, Ticket, TicketState
from tests.e2e.node import wait_pools_full

LONG_A = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens: 57 pages a row
LONG_B = "a harbour full of boats in the morning fog, watercolour, " * 16


def two_ars_one_long_request_at_a_time(cfg: dict[str, Any]) -> None:
    # `small` KV is 4 KiB/token, 64 KiB a page of 16 tokens: each request below takes ~70 of the
    # DiT's 128 pages, so the second one fits only in pages the first one gave back.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = 3.0
    cfg["stages"][0]["num_replicas"] = 2
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 8 << 20
    # One attempt per request: these tests are about the failed attempt's ticket and pages (the
    # broker would otherwise run the request again after its transfer failed, holding a second
    # ticket; that retry has tests of its own).
    cfg["broker"]["max_replica_retries"] = 0


def generate_long(client: KvRelayClient, prompt: str, seed: int) -> Any:
    return client.generate(
        prompt, negative_prompt=prompt[::-1][:200], seed=seed, width=64, height=64, timeout=90
    )


def pages_of(ticket: Ticket) -> set[tuple[int, int]]:
    return {(r.row, p) for r in ticket.rows for p in r.page_ids}


def processes_of(node: Any, name: str) -> list[psutil.Process]:
    """A replica's service process and every process below it (its rank workers)."""
    main = psutil.Process(node.process(name).pid)
    return [main, *main.children(recursive=True)]


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        os.kill(proc.pid, sig)


class TicketWatcher(threading.Thread):
    """Lists the live tickets over and over from a client of its own (which rides out a broker
    restart) until `stop` is set; each listing's violations, as `check` finds them, are kept."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.client = KvRelayClient(address, timeout=5)
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.checks = 0

    def check(self, live: list[Ticket]) -> list[str]:
        raise NotImplementedError

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    live = self.client.list_tickets()
                except KvRelayError:  # the broker is restarting
                    time.sleep(0.05)
                    continue
                self.violations.extend(self.check(live))
                self.checks += 1
                time.sleep(0.01)
        finally:
            self.client.close()


@dataclass
class StoppedWriter:
    ticket: Ticket  # as listed the moment it was WRITING
    procs: list[psutil.Process]  # the writer's processes, all SIGSTOPped (SIGCONT them when done)
    failure: KvRelayError  # how the request ended while its writer was stopped


def stop_a_writer_mid_write(
    node: Any,
    client: KvRelayClient,
    start: Callable[[int], Any],
    *,
    before_attempt: Callable[[], None] | None = None,
    attempts: int = 6,
) -> StoppedWriter:
    """Start a request (`start(attempt)` returns its handle) and SIGSTOP the AR replica that writes
    it as soon as its ticket is WRITING; waits for the request to end. A writer stopped just after
    its last report (the request then succeeds) tests nothing: it is let go and tried again."""
    stopped: dict[str, Any] = {}
    for attempt in range(attempts):
        if before_attempt is not None:
            before_attempt()
        armed = threading.Event()

        def watch(armed: threading.Event = armed) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not armed.is_set():
                for t in client.list_tickets():
                    if t.state == TicketState.WRITING:
                        procs = processes_of(node, t.ar_replica_id)
                        signal_all(procs, signal.SIGSTOP)
                        stopped.update(ticket=t, procs=procs)
                        armed.set()
                        return
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        handle = start(attempt)
        try:
            handle.result()
            failure: KvRelayError | None = None
        except KvRelayError as err:
            failure = err
        armed.set()
        watcher.join(5)
        if stopped and failure is not None:
            return StoppedWriter(stopped["ticket"], stopped["procs"], failure)
        if stopped:  # stopped just after its last report: nothing to test, again
            signal_all(stopped["procs"], signal.SIGCONT)
            stopped.clear()
        wait_pools_full(client, timeout=30)
    pytest.fail("never stopped the writer between arming and its reports")


def stop_the_writer_of_a_long_request(node: Any, client: KvRelayClient) -> StoppedWriter:
    """A request of LONG_A whose writer is stopped mid-write (on a node of
    two_ars_one_long_request_at_a_time, its transfer then times out)."""
    return stop_a_writer_mid_write(
        node, client, lambda attempt: generate_long(client, LONG_A + str(attempt), attempt)
    )
