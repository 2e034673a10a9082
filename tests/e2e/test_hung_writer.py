"""Fault tests with real processes: a hung AR writer simulated with SIGSTOP/SIGCONT.

The seed's rules under test: a receive timeout (or the stopped writer's connection failing its
keepalive) ends the request without recycling in-flight pages (the ticket drains until every
write has a final report; a lease expiring is not proof), and a late completion frees them;
before the ticket is armed, rollback is legal and frees at once.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError, TicketState
from tests.e2e.node import running_node, wait_pools_full
from tests.e2e.stopped_writer import processes_of, signal_all, stop_a_writer_mid_write

pytestmark = pytest.mark.slow

LONG = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens: a long write


def _small(cfg: dict[str, Any]) -> None:
    # `small` KV (4 KiB/token) over the gRPC fallback: a write of a few MiB per row, long enough
    # to stop the writer in the middle of it.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage.pop("kv_transfer_config", None)
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 32 << 20
    # One attempt per request: this test is about the failed attempt's ticket and pages (the broker
    # would otherwise run the request again after its transfer failed, holding a second ticket;
    # that retry has tests of its own).
    cfg["broker"]["max_replica_retries"] = 0


# The test's own keepalive (security.keepalive_*_seconds, 15 s + 15 s by default): the stopped AR's
# connections close within time + timeout, so the mid-write test waits ~10 s for it, not 30 s. Still
# generous on a loaded 2-core machine: a running process's gRPC acks a ping without needing Python.
KEEPALIVE_S = 5.0


# The DiT's rank stall limit (default max(10 s, 3 x lease) = 10 s). The stopped AR's own PutKv
# stream may end in a ping timeout when it runs again (its write then reports FAILED, not OK: seen
# under two CPU hogs), and a FAILED write's pages wait the receiver's settle time, this + 2 s
# (docs/broker.md, Draining). No DiT rank is stopped here; 4 s is 8 liveness beats.
DIT_STALL_S = 4.0


def _small_keepalive(cfg: dict[str, Any]) -> None:
    _small(cfg)
    cfg.setdefault("security", {}).update(
        keepalive_time_seconds=KEEPALIVE_S, keepalive_timeout_seconds=KEEPALIVE_S
    )
    cfg["stages"][1]["rank_stall_seconds"] = DIT_STALL_S


def _wait_replicas_up(client: KvRelayClient, timeout: float = 30.0) -> None:
    """A stopped replica misses heartbeats: its lease lapses (it is down, not gone) until it
    heartbeats again after SIGCONT. New requests need it up."""
    deadline = time.monotonic() + timeout
    while not all(r.up and not r.fenced for r in client.list_replicas()):
        assert time.monotonic() < deadline, f"replicas not up again: {client.list_replicas()}"
        time.sleep(0.05)


def _ticket_states(client: KvRelayClient) -> dict[str, TicketState]:
    return {t.ticket_id: t.state for t in client.list_tickets()}


def test_writer_stopped_mid_write_drains_then_late_completion_frees(tmp_path: Path) -> None:
    with (
        running_node(tmp_path, "hung", _small_keepalive) as node,
        KvRelayClient(node.address(), timeout=30) as client,
    ):
        total = wait_pools_full(client)[0].total_pages
        stopped = stop_a_writer_mid_write(
            node,
            client,
            lambda attempt: client.generate(
                LONG + str(attempt), negative_prompt=LONG, seed=attempt, width=64, height=64, timeout=60
            ),
            before_attempt=lambda: _wait_replicas_up(client),
        )
        outcome = stopped.failure
        try:
            ticket_id = stopped.ticket.ticket_id
            # The whole AR process is stopped, so it answers no keepalive pings either: the broker's
            # Prefill call ends UNAVAILABLE within 2 x KEEPALIVE_S (docs/operations.md, Keepalive),
            # before the DiT's 60 s receive timeout would. Either ends the request; neither proves the write over.
            assert (outcome.code, outcome.reason) in {
                ("UNAVAILABLE", "REPLICA_UNAVAILABLE"),
                ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"),
            }, outcome
            # The request is over, the pages are not: DRAINING, and a lease expiring proves nothing.
            time.sleep(2.5)  # > lease_seconds of the test config
            assert _ticket_states(client).get(ticket_id) == TicketState.DRAINING
            (pool,) = client.get_pools()
            assert pool.draining_pages > 0 and pool.free_pages < total
            assert pool.free_pages + pool.reserved_pages + pool.draining_pages == total
        finally:
            signal_all(stopped.procs, signal.SIGCONT)
        # The late completion resolves every write; after the quiet period the pages come back.
        wait_pools_full(client, timeout=30)
        assert ticket_id not in _ticket_states(client)
        # And the node keeps serving.
        _wait_replicas_up(client)
        assert client.generate("after the fault", seed=1, width=64, height=64, timeout=60).result().png


def _mooncake_patient(cfg: dict[str, Any]) -> None:
    # Nothing is written before arming, so the transport is not under test: Mooncake TCP, whose
    # transfer_timeout (5 s, tests/configs/test-fast.yaml) ends the request, where the gRPC
    # fallback's receive timeout is a fixed 60 s (a minute of this test, waited for nothing).
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 32 << 20
    cfg["broker"]["max_replica_retries"] = 0  # one attempt: this test is about its ticket (see _small)
    # Ranks stopped for the whole request are a hang to wait out here, not a rank to kill (that
    # is tests/e2e/test_stopped_rank.py): past rank_stall_seconds the AR fail-stops.
    cfg["stages"][0]["rank_stall_seconds"] = 300.0


def test_writer_stopped_before_arming_rolls_back_at_once(tmp_path: Path) -> None:
    with (
        running_node(tmp_path, "unarmed", _mooncake_patient) as node,
        KvRelayClient(node.address(), timeout=30) as client,
    ):
        total = wait_pools_full(client)[0].total_pages
        main, *ranks = processes_of(node, "ar-0")
        assert ranks, "the AR replica runs its model in rank worker processes"
        # Rank workers stopped: the prefill never finishes, ReserveTicket is never called.
        signal_all(ranks, signal.SIGSTOP)
        try:
            handle = client.generate("never armed", seed=3, width=64, height=64, timeout=60)
            with pytest.raises(KvRelayError) as info:
                handle.result()
            assert info.value.code == "DEADLINE_EXCEEDED" and info.value.reason == "TRANSFER_TIMEOUT"
            # Not armed: rollback is legal, nothing can be in flight, pages are free at once.
            (pool,) = client.get_pools()
            assert pool.free_pages == total and pool.draining_pages == 0
        finally:
            signal_all(ranks, signal.SIGCONT)
        # The AR wakes up, finds its ticket over, writes nothing; the node keeps serving.
        _wait_replicas_up(client)
        result = client.generate("after the fault", seed=2, width=64, height=64, timeout=60).result()
        assert result.png
        assert wait_pools_full(client)[0].free_pages == total
        assert client.get_generation(handle.request_id).state == GenerationState.FAILED
