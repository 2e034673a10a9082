"""Fault tests with real processes: a rank stopped forever (SIGSTOP, never SIGCONT).

A stopped rank neither answers nor dies, and its service keeps heartbeating, so nothing but the
rank's own liveness beat can tell: the replica must kill its ranks and fail stop (exit 3), the
supervisor starts a new incarnation (proof that the old ranks, and any transfer into or out of
them, are gone), the request in flight ends with a clear error, no page is left held, and the
node serves again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError, TicketState
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

STALL_S = 3.0


def _stall(cfg: dict[str, Any]) -> None:
    for stage in cfg["stages"]:
        stage["rank_stall_seconds"] = STALL_S


def _ranks(node: Any, name: str) -> list[psutil.Process]:
    return psutil.Process(node.process(name).pid).children(recursive=True)


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _incarnation(client: KvRelayClient, replica_id: str) -> str:
    return next(r.incarnation_id for r in client.list_replicas() if r.replica_id == replica_id and r.up)


def _wait_new_incarnation(client: KvRelayClient, replica_id: str, old: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(StopIteration, KvRelayError):
            new = _incarnation(client, replica_id)
            if new != old:
                return new
        assert time.monotonic() < deadline, f"{replica_id} was not replaced: {client.list_replicas()}"
        time.sleep(0.1)


def _ticket_states(client: KvRelayClient) -> dict[str, TicketState]:
    return {t.ticket_id: t.state for t in client.list_tickets()}


def _resume(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def stall_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One node for the three tests of a rank stopped forever: each ends with the node recovered
    (a new incarnation of the replica it stopped, pools whole, an image served), so the next one
    starts from a serving node; a node each cost a start and a stop (seconds on 2 cores)."""
    with running_node(tmp_path_factory.mktemp("stall"), "stall", _stall) as node:
        yield node


def _serving(node: Any) -> tuple[Any, KvRelayClient]:
    """The shared node, ready: every replica up (an earlier test's restart done)."""
    client = KvRelayClient(node.address(), timeout=30)
    deadline = time.monotonic() + 60
    while {r.replica_id for r in client.list_replicas() if r.up} != {"ar-0", "dit-0"}:
        assert time.monotonic() < deadline, f"the node did not serve again: {client.list_replicas()}"
        time.sleep(0.1)
    return node, client


def test_a_dit_rank_stopped_mid_denoise_fail_stops_the_replica_and_the_node_recovers(stall_node: Any) -> None:
    node, client = _serving(stall_node)
    with client:
        total = wait_pools_full(client)[0].total_pages
        first = _incarnation(client, "dit-0")
        ranks = _ranks(node, "dit-0")
        assert ranks, "the DiT replica runs its model in rank worker processes"
        handle = client.generate("stopped in the middle of a denoise", seed=1, width=64, height=64,
                                 num_inference_steps=1000, timeout=90)
        try:
            for event in handle.events():
                if event.state == GenerationState.DENOISING and event.step >= 1:
                    for proc in ranks:
                        os.kill(proc.pid, signal.SIGSTOP)
                    break
            else:
                pytest.fail("the generation ended before the ranks could be stopped")
            stopped = time.monotonic()
            # A denoise command may run an hour and a ping waits behind it: only the beat finds it.
            _wait_new_incarnation(client, "dit-0", first, timeout=STALL_S + 30)
            assert time.monotonic() - stopped < STALL_S + 30
            assert all(_gone(p) for p in ranks), "the stopped ranks were not killed"
            assert node.process("dit-0").restarts >= 1
            with pytest.raises(KvRelayError) as info:
                handle.result()
            assert info.value.code in ("UNAVAILABLE", "INTERNAL", "ABORTED"), info.value
        finally:
            _resume(ranks)
        # Nothing held: the old incarnation's tickets ended with its memory, the new pool is whole.
        pools = wait_pools_full(client, timeout=30)
        assert pools[0].total_pages == total
        assert client.generate("after the fault", seed=2, width=64, height=64, timeout=60).result().png


def test_an_idle_stopped_dit_rank_is_found_before_requests_pile_up(stall_node: Any) -> None:
    """The black-box finding: ranks stopped between requests, every request to the replica failed
    TRANSFER_TIMEOUT and drained while its service kept heartbeating."""
    node, client = _serving(stall_node)
    with client:
        wait_pools_full(client)
        first = _incarnation(client, "dit-0")
        ranks = _ranks(node, "dit-0")
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            # (The shared node's dit-0 failed once before: its restart waits 2 s, not 1.)
            _wait_new_incarnation(client, "dit-0", first, timeout=STALL_S + 30)
            assert all(_gone(p) for p in ranks)
        finally:
            _resume(ranks)
        wait_pools_full(client, timeout=30)
        assert client.generate("after the fault", seed=3, width=64, height=64, timeout=60).result().png


def test_an_ar_rank_stopped_forever_fail_stops_the_ar_replica(stall_node: Any) -> None:
    """The AR's commands wait for their ranks without a deadline: a stopped rank used to hang
    every later request until its deadline, with the replica still registered and serving."""
    node, client = _serving(stall_node)
    with client:
        total = wait_pools_full(client)[0].total_pages
        first = _incarnation(client, "ar-0")
        ranks = _ranks(node, "ar-0")
        assert ranks
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            _wait_new_incarnation(client, "ar-0", first, timeout=STALL_S + 30)
            assert all(_gone(p) for p in ranks)
        finally:
            _resume(ranks)
        assert client.generate("after the fault", seed=4, width=64, height=64, timeout=60).result().png
        assert wait_pools_full(client, timeout=30)[0].free_pages == total


# Well past the longest the rank stays stopped (6 s request + an AR restart, up to ~12 s on a
# loaded 2-core machine + 2.5 s): a shorter limit had the watchdog kill it in one loaded run.
# (Before, the pages also waited out most of it after the rank resumed: the settle time, this + 2 s
# after the writer was proven gone. Now the DiT's heartbeat proves the rank ran the proof window.)
RECEIVER_STALL_S = 30.0
PROOF_WINDOW_S = 2.5  # KvRelayConfig.receiver_proof_window_seconds


def _receiver_stalls_long(cfg: dict[str, Any]) -> None:
    # The DiT rank stays stopped through the AR's restart without being killed; writes give up
    # (IN_DOUBT) after 2 s.
    cfg["stages"][1]["rank_stall_seconds"] = RECEIVER_STALL_S
    for stage in cfg["stages"]:
        stage["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = 2.0
    # One attempt per request: this test is about the failed attempt's ticket and pages (the broker
    # would otherwise run the request again after its transfer failed, holding a second ticket;
    # that retry has tests of its own).
    cfg["broker"]["max_replica_retries"] = 0


def test_a_dead_senders_pages_stay_held_while_the_receiving_rank_is_stopped(tmp_path: Path) -> None:
    """Known gap (c) of docs/transfer.md: the writer's death (a new AR incarnation) proved no
    sender alive, and the pages were freed `drain_quiet_seconds` later although the DiT rank that
    receives was stopped, with the dead sender's bytes possibly in its socket buffer. Now they
    wait until that rank has run again (or been killed by its watchdog): until the DiT's heartbeat
    proves that it ran the proof window since it continued, not the whole settle time after the
    proof of the writer's death, and no byte of them changes once they are free."""
    with running_node(tmp_path, "deadsender", _receiver_stalls_long) as node, \
            KvRelayClient(node.address(), timeout=30) as client:
        total = wait_pools_full(client)[0].total_pages
        ar_first = _incarnation(client, "ar-0")
        dit_first = _incarnation(client, "dit-0")
        ranks = _ranks(node, "dit-0")
        dit_pid = node.process("dit-0").pid
        (pool_file,) = Path("/dev/shm").glob(f"kvrelay-dit-0-{dit_pid}-rank0-*")
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(KvRelayError) as info:
                client.generate("into a stopped receiver", seed=5, width=64, height=64, timeout=6).result()
            assert info.value.reason == "TRANSFER_TIMEOUT", info.value
            # DRAINING past the quiet period: a write is in doubt (held until its call returns).
            time.sleep(1.0)
            (ticket,) = client.list_tickets()
            assert ticket.state == TicketState.DRAINING
            held = {p for r in ticket.rows for p in r.page_ids}
            killed = time.monotonic()  # before the writer is proven gone
            os.kill(node.process("ar-0").pid, signal.SIGKILL)  # its ranks die with it (PDEATHSIG)
            _wait_new_incarnation(client, "ar-0", ar_first, timeout=30)
            time.sleep(3.0)  # many times drain_quiet_seconds (0.2), past the proof window (2.5)
            assert not any(_gone(p) for p in ranks), "the rank was killed: the test took too long"
            assert _incarnation(client, "dit-0") == dit_first
            (pool,) = client.get_pools()
            assert pool.draining_pages > 0 and pool.free_pages < total, pool
            assert _ticket_states(client).get(ticket.ticket_id) == TicketState.DRAINING
        finally:
            continued = time.monotonic()
            _resume(ranks)
        # The rank ran again (its buffer drained): freed once the DiT's heartbeat proves it ran the
        # proof window since, well before the settle time (32 s after the writer's death).
        assert wait_pools_full(client, timeout=RECEIVER_STALL_S + 15)[0].free_pages == total
        freed_after, since_kill = time.monotonic() - continued, time.monotonic() - killed
        page_bytes = pool_file.stat().st_size // total
        def pages_now() -> list[bytes]:
            data = pool_file.read_bytes()
            return [data[p * page_bytes:(p + 1) * page_bytes] for p in sorted(held)]
        freed = pages_now()
        assert freed_after >= PROOF_WINDOW_S, f"freed {freed_after:.1f}s after SIGCONT: before the rank ran the window"
        assert since_kill < RECEIVER_STALL_S, f"freed {since_kill:.1f}s after the writer died: the whole settle time"
        time.sleep(1.0)
        assert pages_now() == freed, "bytes of the dead sender's write landed in freed pages"
        assert _incarnation(client, "dit-0") == dit_first
        assert client.generate("after the fault", seed=6, width=64, height=64, timeout=60).result().png
