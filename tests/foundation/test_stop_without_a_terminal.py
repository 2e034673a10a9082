"""A process whose terminal went away still stops on a signal.

Found walking the docs as a new user: `kvrelay up` in a terminal that closed (an SSH session that
dropped, `script` killed) left its broker serving, orphaned, for good. The broker's stderr was the
dead terminal: the one line `kvrelay broker: SIGHUP: stopping (serving)` failed to print (EIO;
EPIPE for a pipe whose reader left) and, raised inside the signal handler before the stop event
was set, it swallowed the stop. Every later SIGHUP and SIGTERM met the same, so only SIGKILL ended
it (the supervisor, killed before it escalated, never sent that one).
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrelay.stopping import ProcessStop

REPO = Path(__file__).resolve().parents[2]


class _DeadTerminal(io.TextIOBase):
    """stderr on a terminal that hung up: every write fails, as a pty's does with EIO."""

    def write(self, text: str) -> int:
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("second", [None, "SIGTERM"])
def test_a_stop_is_taken_although_its_line_cannot_be_printed(
    monkeypatch: pytest.MonkeyPatch, second: str | None
) -> None:
    async def scenario() -> ProcessStop:
        stop = ProcessStop("broker")
        stop.phase = "serving"
        stop.request("SIGHUP")
        if second:
            stop.request(second)  # the fast stop's line fails the same way
        return stop

    monkeypatch.setattr(sys, "stderr", _DeadTerminal())
    stop = asyncio.run(scenario())
    assert stop.requested and stop.thread_event.is_set() and stop.signal_name == "SIGHUP"
    assert stop.fast_requested == (second is not None)


@pytest.mark.parametrize("role", ["broker", "ar", "dit"])
def test_a_process_whose_stderr_reader_left_stops_on_sigterm(tmp_path: Path, role: str) -> None:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    # Console logging, not captured: a terminal's setting (a JSON log's capture thread would
    # take the failed write instead).
    env = {**os.environ, "KVRELAY_LOG_FORMAT": "console", "KVRELAY_NATIVE_CAPTURE": "0", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "kvrelay", role, "--config", str(config), "--port", "0", "--metrics-port", "0"]
    if role != "broker":
        argv += ["--replica", "0", "--broker", "127.0.0.1:1"]  # it stops while it waits to register
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        proc.stderr.close()  # the terminal went away: writes to stderr now fail (EPIPE)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvrelay {role} ignored SIGTERM once its stderr was gone")
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_kvrelay_up_whose_terminal_went_away_stops_its_node_on_sighup(tmp_path: Path) -> None:
    """The SSH session of `kvrelay up` dropped: SIGHUP, and stderr (the node's children's too,
    without --log-dir) goes nowhere. Every child stops and `kvrelay up` exits 0, as on Ctrl-C."""
    import psutil

    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "KVRELAY_LOG_FORMAT": "console", "KVRELAY_NATIVE_CAPTURE": "0", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "kvrelay", "up", "--config", str(config), "--metrics-port", "0"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    children: list[psutil.Process] = []
    try:
        assert up.stdout is not None and up.stderr is not None
        report = []
        for line in up.stdout:
            report.append(line)
            if line.startswith("try: kvrelay generate"):
                break
        rows = [line.split() for line in report if line.split()[:1] in (["broker"], ["ar-0"], ["dit-0"])]
        assert len(rows) == 3, "".join(report) + up.stderr.read()
        children = [psutil.Process(int(row[1])) for row in rows]
        up.stderr.close()
        up.send_signal(signal.SIGHUP)
        # Before: OSError from the 'stopping' line, exit 1 with a traceback nobody could read.
        assert up.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for child in children:
            if child.is_running():
                child.kill()
