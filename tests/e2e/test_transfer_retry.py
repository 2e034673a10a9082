"""A transfer that really fails once, with real processes: the broker runs the generation again
with a fresh ticket (broker.max_replica_retries, default 1) and it succeeds with the very PNG bytes
an undisturbed run of the same seed makes.

The fault: the DiT's rank processes (its Mooncake receiver) are stopped with SIGSTOP before the
request, so the AR's write (several MiB: more than the loopback socket buffers take) blocks in the
engine and the DiT's wait for the rows ends TRANSFER_TIMEOUT. The failed attempt's ticket drains:
its write is in flight, so its pages stay held. As soon as the client sees attempt 2 the ranks run
again; the late bytes land in the old ticket's pages, the retry's in pages of its own on the same
AR/DiT pair (the only one), and every page comes back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import GenerationState, KvRelayClient, TicketState
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

LONG = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens per row
SEED = 1
# The DiT's wait for the rows: long enough for an undisturbed `small` prefill of LONG on a loaded
# 2-core machine, short enough that the stopped ranks stay far from the DiT's own watchdog limits.
TRANSFER_TIMEOUT_S = 8.0


def _config(cfg: dict[str, Any]) -> None:
    # `small` KV is 4 KiB/token: each request writes ~7 MiB, far more than the loopback socket
    # buffers of a receiver that does not read, so the engine call blocks while it is stopped.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = TRANSFER_TIMEOUT_S
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 32 << 20  # room for both attempts' tickets
    # The receiver's stop is a short hang here, not a rank to kill (tests/e2e/test_stopped_rank.py).
    cfg["stages"][1]["rank_stall_seconds"] = 120.0


def _generate(client: KvRelayClient, request_id: str) -> Any:
    return client.generate(LONG, negative_prompt=LONG, seed=SEED, width=64, height=64, timeout=180,
                           request_id=request_id)  # fmt: skip


def _broker_counter(node: Any, name: str, labels: str) -> float:
    metrics = node.process("broker").metrics
    assert metrics, "the broker serves no metrics"
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not served")


def _ticket(client: KvRelayClient, ticket_id: str) -> Any:
    every = [TicketState.RESERVED, TicketState.WRITING, TicketState.READY, TicketState.CONSUMING,
             TicketState.DRAINING, TicketState.RELEASED]  # fmt: skip
    return next((t for t in client.list_tickets(every) if t.ticket_id == ticket_id), None)


def test_a_transfer_that_fails_once_is_retried_and_the_image_is_the_undisturbed_one(tmp_path: Path) -> None:
    with running_node(tmp_path, "xretry", _config) as node, KvRelayClient(node.address(), timeout=60) as client:
        total = wait_pools_full(client)[0].total_pages
        # The reference, and a warm connection (the receiver's segment is cached by the engine).
        undisturbed = _generate(client, "undisturbed").result()
        wait_pools_full(client)

        ranks = psutil.Process(node.process("dit-0").pid).children(recursive=True)
        assert ranks, "the DiT replica runs its pool (and its Mooncake receiver) in rank worker processes"
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        events: list[Any] = []
        try:
            handle = _generate(client, "retried")
            for event in handle.events():
                events.append(event)
                assert not event.state.is_terminal, event
                if event.attempt >= 2:
                    break
        finally:
            for proc in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            stopped = False
        assert not stopped
        first_ticket = next(e.ticket_id for e in events if e.ticket_id)
        first = _ticket(client, first_ticket)
        # The failed attempt's ticket ended as any timed-out transfer's: over for the request, its
        # write unresolved or just resolved, its pages held until nothing can land in them.
        assert first is not None and first.state in (TicketState.DRAINING, TicketState.RELEASED), first

        events += list(handle.events())  # the rest of the same stream, through the retry
        result = handle.result()
        assert result.png == undisturbed.png, "the retry made another image than the undisturbed run"
        assert result.seed == SEED
        done = client.get_generation("retried")
        assert done.state == GenerationState.SUCCEEDED and done.attempt == 2
        assert done.ticket_id != first_ticket
        assert events[-1].state == GenerationState.SUCCEEDED
        seen = [(e.state, e.step) for e in events]
        assert seen == sorted(seen), seen  # never back, across the retry
        assert [e.attempt for e in events] == sorted(e.attempt for e in events)
        assert _broker_counter(node, "kvrelay_generation_retries_total", 'reason="TRANSFER_TIMEOUT"') == 1
        assert _broker_counter(node, "kvrelay_generations_total", 'outcome="failed"') == 0

        # Fresh pages: none of the failed attempt's while its write could still land in them.
        second = _ticket(client, done.ticket_id)
        first = _ticket(client, first_ticket)
        assert first is not None and second is not None
        first_pages = {(r.row, p) for r in first.rows for p in r.page_ids}
        second_pages = {(r.row, p) for r in second.rows for p in r.page_ids}
        if first_pages & second_pages:
            assert first.state == TicketState.RELEASED and first.update_time <= second.create_time, (first, second)

        # The late bytes landed, the engine returned, every write is final: every page comes back.
        deadline = time.monotonic() + 60
        while (t := _ticket(client, first_ticket)) is not None and t.state != TicketState.RELEASED:
            assert time.monotonic() < deadline, f"the failed attempt's ticket never drained: {t}"
            time.sleep(0.1)
        assert wait_pools_full(client, timeout=30)[0].total_pages == total
        assert client.list_tickets() == []
