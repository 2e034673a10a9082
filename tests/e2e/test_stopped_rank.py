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
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError
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


def _resume(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)


def test_a_dit_rank_stopped_mid_denoise_fail_stops_the_replica_and_the_node_recovers(tmp_path: Path) -> None:
    with running_node(tmp_path, "stopdit", _stall) as node, KvRelayClient(node.address(), timeout=30) as client:
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


def test_an_idle_stopped_dit_rank_is_found_before_requests_pile_up(tmp_path: Path) -> None:
    """The black-box finding: ranks stopped between requests, every request to the replica failed
    TRANSFER_TIMEOUT and drained while its service kept heartbeating."""
    with running_node(tmp_path, "idledit", _stall) as node, KvRelayClient(node.address(), timeout=30) as client:
        wait_pools_full(client)
        first = _incarnation(client, "dit-0")
        ranks = _ranks(node, "dit-0")
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            _wait_new_incarnation(client, "dit-0", first, timeout=STALL_S + 20)
            assert all(_gone(p) for p in ranks)
        finally:
            _resume(ranks)
        wait_pools_full(client, timeout=30)
        assert client.generate("after the fault", seed=3, width=64, height=64, timeout=60).result().png


def test_an_ar_rank_stopped_forever_fail_stops_the_ar_replica(tmp_path: Path) -> None:
    """The AR's commands wait for their ranks without a deadline: a stopped rank used to hang
    every later request until its deadline, with the replica still registered and serving."""
    with running_node(tmp_path, "stopar", _stall) as node, KvRelayClient(node.address(), timeout=30) as client:
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
