"""What a DiT heartbeat says of its receivers (docs/broker.md, Draining): how long each rank and
the replica's own process have run without a stall. A SIGSTOP of either, longer than the beat gap
(kvrelay.config.STALL_GAP_SECONDS), reads as a stall while it lasts and starts a new run when it
ends; the heartbeat echoes the broker's last probe and comes sooner when the broker asks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvrelay.dit_service.registration import Registration
from kvrelay.v1 import broker_pb2
from kvrelay.worker import STALL_GAP_SECONDS, StallFreeRun, WorkerGroup
from tests.models.rank_handlers import ModelsTestHandler

STOP_S = STALL_GAP_SECONDS + 0.7


def _until(what: str, predicate: Any, timeout_s: float = 10.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_run_restarts_after_a_beat_gap_and_reads_zero_while_silent() -> None:
    run = StallFreeRun(now=0.0)
    for t in (0.5, 1.0, 1.5, 2.0):
        run.beat(t)
    assert run.seconds(2.2) == pytest.approx(2.2)
    assert run.seconds(2.0 + STALL_GAP_SECONDS + 0.1) == 0.0  # silent past the gap: maybe stopped now
    run.beat(6.0)  # it ran again: a new run
    assert run.seconds(6.5) == pytest.approx(0.5)


@pytest.mark.slow
def test_a_sigstop_of_a_rank_resets_its_stall_free_run() -> None:
    group = WorkerGroup(1, ModelsTestHandler)
    group.start()
    try:
        _until("a second of stall-free run", lambda: group.stall_free_s()[0] >= 1.0)
        os.kill(group.pids[0], signal.SIGSTOP)
        time.sleep(STOP_S)
        assert group.stall_free_s() == [0.0], "a stopped rank read as running"
        os.kill(group.pids[0], signal.SIGCONT)
        continued = time.monotonic()
        run = _until("the rank's beat", lambda: group.stall_free_s()[0])
        assert run <= time.monotonic() - continued + 0.05, (
            f"the run did not start again at SIGCONT: {run:.2f}s"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(group.pids[0], signal.SIGCONT)
        group.stop()
    assert group.stall_free_s() == [], "a stopped group has no ranks to count"


_PROCESS = textwrap.dedent("""
    import asyncio, sys, time
    from kvrelay.worker import StallFreeRun, beat_stall_free_run

    async def main():
        run = StallFreeRun()
        asyncio.get_running_loop().create_task(beat_stall_free_run(run))
        while True:
            print(f"{time.monotonic()} {run.seconds()}", flush=True)
            await asyncio.sleep(0.05)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_a_sigstop_of_the_service_process_resets_its_stall_free_run() -> None:
    """The DiT's own process receives the gRPC-stream fallback: its beat runs on its event loop."""
    proc = subprocess.Popen([sys.executable, "-c", _PROCESS], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert proc.stdout is not None
    try:
        while float(proc.stdout.readline().split()[1]) < 1.0:
            pass
        proc.send_signal(signal.SIGSTOP)
        time.sleep(STOP_S)
        continued = time.monotonic()
        proc.send_signal(signal.SIGCONT)
        after = []
        while len(after) < 5:
            stamp, seconds = (float(x) for x in proc.stdout.readline().split())
            if stamp > continued:
                after.append((stamp, seconds))
        for stamp, seconds in after:
            assert seconds <= stamp - continued + 0.01, f"the run did not start again at SIGCONT: {after}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


class _Broker:
    """Heartbeat answers with probe numbers 1, 2, ...; asks for the next one soon while `soon`."""

    def __init__(self) -> None:
        self.requests: list[broker_pb2.HeartbeatRequest] = []
        self.soon = 0.0
        self.times: list[float] = []

    async def Heartbeat(self, request: broker_pb2.HeartbeatRequest, timeout: float) -> Any:  # noqa: N802
        self.requests.append(request)
        self.times.append(time.monotonic())
        return broker_pb2.HeartbeatResponse(probe=len(self.requests), next_heartbeat_seconds=self.soon)


def test_each_heartbeat_echoes_the_last_probe_and_comes_sooner_when_asked() -> None:
    broker = _Broker()
    runs = iter([(5.0, 2), (0.0, 2), (7.5, 1), (9.0, 2), (9.5, 2), (10.0, 2)])
    info = SimpleNamespace(replica_id="dit-0", incarnation_id="inc")
    registration = Registration(broker, info, interval_s=0.3, token=None, on_fenced=lambda _: None,  # type: ignore[arg-type]
                                receiver_run=lambda: next(runs))  # fmt: skip

    async def beat(n: int) -> None:
        registration.start_heartbeats()
        while len(broker.requests) < n:
            await asyncio.sleep(0.01)
        await registration.stop(deregister=False)

    asyncio.run(beat(3))
    assert [r.receiver_run.probe for r in broker.requests] == [0, 1, 2]
    assert [(r.receiver_run.stall_free_seconds, r.receiver_run.ranks) for r in broker.requests] == [
        (5.0, 2), (0.0, 2), (7.5, 1),
    ]  # fmt: skip
    broker.soon = 0.05
    asyncio.run(beat(6))
    gaps = [b - a for a, b in zip(broker.times[3:], broker.times[4:], strict=False)]
    assert gaps and max(gaps) < 0.2, f"asked for heartbeats every 0.05 s, got {gaps}"
