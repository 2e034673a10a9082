"""A replica asked to stop while it waits at start-up stops at once: `kvrelay ar` and `kvrelay dit`
pointed at a broker nobody serves retry registering (2 minutes, 30 s), and SIGTERM, Ctrl-C
(SIGINT) or SIGHUP during those retries ends the process within seconds, exit 0 (a clean stop,
as when serving), one line saying what it was doing, and no rank process left. Before, `kvrelay ar`
noted the signal and went on retrying for 2 minutes; SIGHUP killed it without stopping its ranks.
Real processes, tiny preset, CPU."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.procs import start_service

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests/configs/test-fast.yaml"
# Port 1 on loopback: nothing listens there, so every RegisterReplica fails UNAVAILABLE.
NOBODY = "127.0.0.1:1"
# A fixed bound well under the retry windows (AR 120 s, DiT 30 s): the stop itself (ranks asked to
# exit, gRPC stopped) takes a second or two, more on a loaded 2-core CI runner.
STOP_WITHIN_S = 10.0


def _printed(lines: list[str]) -> list[str]:
    """What the process printed: stdout/stderr lines come back as JSON records (native capture)."""
    out = []
    for raw in lines:
        record = raw.strip()
        if record.startswith("{"):
            try:
                parsed = json.loads(record)
            except ValueError:
                out.append(record)
                continue
            if parsed.get("event") == "native_output":
                out.append(str(parsed.get("line", "")))
        elif record:
            out.append(record)
    return out


def _wait_for_event(lines: list[str], event: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(f'"event": "{event}"' in line for line in list(lines)):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {event} within {timeout:g}s:\n" + "".join(lines[-40:]))


@pytest.mark.parametrize(
    ("role", "signame"),
    [("ar", "SIGTERM"), ("ar", "SIGINT"), ("ar", "SIGHUP"), ("dit", "SIGTERM"), ("dit", "SIGINT")],
)
def test_a_signal_during_registration_retries_stops_the_replica_at_once(
    role: str, signame: str, tmp_path: Path
) -> None:
    started = start_service(
        [role, "--config", str(CONFIG), "--replica", "0", "--broker", NOBODY],
        cwd=tmp_path,
        env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks")},
    )
    proc = started.proc
    try:
        # The DiT's first attempt waits for the channel up to its RPC deadline (5 s) before it retries.
        _wait_for_event(started.lines, "broker_not_reachable_yet", proc, timeout=90.0)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert ranks, "no rank process started"
        sent = time.monotonic()
        proc.send_signal(getattr(signal, signame))
        try:
            code = proc.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"kvrelay {role} still running {STOP_WITHIN_S:g}s after {signame}:\n" + started.output()
            ) from None
        took = time.monotonic() - sent
        assert code == 0, f"exit {code} after {signame}:\n{started.output()}"
        output = "".join(started.lines)
        assert "Traceback" not in output, output
        said = [line for line in _printed(started.lines) if line.startswith(f"kvrelay {role}: ")]
        assert said == [f"kvrelay {role}: {signame}: stopping (registering with the broker at {NOBODY})"], (
            said, started.output())
        _, alive = psutil.wait_procs(ranks, timeout=5.0)
        assert not alive, f"rank processes left after the stop: {[p.pid for p in alive]}"
        assert took < STOP_WITHIN_S
    finally:
        started.stop(timeout=5.0)


@pytest.mark.parametrize("signame", ["SIGHUP", "SIGTERM"])
def test_a_signal_stops_a_serving_broker_gracefully(signame: str, tmp_path: Path) -> None:
    """`kvrelay broker` stops on SIGHUP as on SIGTERM: exit 0 after its graceful stop (before,
    SIGHUP's default action killed it: exit -1, no grpc_stopped)."""
    started = start_service(
        ["broker", "--config", str(CONFIG), "--port", "0"],
        cwd=tmp_path,
        env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks")},
    )
    proc = started.proc
    try:
        proc.send_signal(getattr(signal, signame))
        try:
            code = proc.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kvrelay broker still running {STOP_WITHIN_S:g}s after {signame}:\n"
                                 + started.output()) from None
        assert code == 0, f"exit {code} after {signame}:\n{started.output()}"
        deadline = time.monotonic() + 5.0  # the reader thread drains the last lines
        while not any('"grpc_stopped"' in line for line in list(started.lines)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any('"grpc_stopped"' in line for line in started.lines), started.output()
    finally:
        started.stop(timeout=5.0)
