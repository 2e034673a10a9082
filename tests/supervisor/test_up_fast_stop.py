"""`kvrelay up`: a second signal makes the node's stop fast. Real child processes
(tests/supervisor/health_child.py) that drain for 2 minutes after their first SIGTERM: Ctrl-C
starts the ordered stop, a second Ctrl-C forwards a second SIGTERM to every child still running
(the replicas draining now, the broker when its turn comes), so each makes its own fast stop and
exits 4 instead of being drained for minutes or SIGKILLed; `kvrelay up` exits EXIT_FAST_STOP,
saying so in one line, and no process is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvrelay.stopping import EXIT_FAST_STOP
from tests.supervisor.test_supervisor import (
    _started_by_us,
    _up_process,
    _wait_up,
    alive,
    all_pids,
    by_name,
    records,
    wait_dead,
    write_config,
)

# Far under the children's 120 s drain, generous for a loaded 2-core runner.
EXIT_WITHIN_S = 30.0
DRAIN = {"drain_seconds": 120}


@pytest.fixture
def children_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir()
    yield path
    for record in records(path):
        for pid in (record.get("pid"), record.get("grandchild")):
            if isinstance(pid, int) and alive(pid) and _started_by_us(pid, record):
                os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_forwards_a_fast_stop_to_every_child(tmp_path: Path, children_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    proc = _up_process(tmp_path, children_dir, path, behaviour={"broker": DRAIN, "ar": DRAIN, "dit": DRAIN})
    try:
        _wait_up(proc)
        pids = all_pids(children_dir)
        assert pids and all(alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            by_name(children_dir, name) and "draining" in by_name(children_dir, name)[-1] for name in ("ar-0", "dit-0")
        ):
            time.sleep(0.05)
        assert all("draining" in by_name(children_dir, name)[-1] for name in ("ar-0", "dit-0")), records(children_dir)
        assert "draining" not in by_name(children_dir, "broker")[-1]  # the broker's turn comes last
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kvrelay up still stopping {EXIT_WITHIN_S:g}s after a second Ctrl-C") from None
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_FAST_STOP, stderr
    assert "SIGINT again: fast stop" in stderr, stderr
    assert wait_dead(pids, timeout=5) == []
    assert not [p for p in psutil.pids() if p in pids and alive(p)]
    # Each child made its own fast stop (not SIGKILL, not the 2-minute drain): the replicas while
    # draining, the broker on the two SIGTERMs its turn brought.
    for record in records(children_dir):
        assert (record.get("exit_code"), record.get("fast")) == (4, True), record
