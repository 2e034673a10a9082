"""kvrelay.early_signals: a stop signal a service process gets while it still starts (imports,
config, listening) is kept and acted on when its ProcessStop takes the signals over: one is a
graceful stop, two a fast stop; other commands keep the default actions. Each case in its own
process (signal dispositions are per process)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, os, signal, sys, time
from kvrelay import early_signals

early_signals.catch(["kvrelay", sys.argv[1]])
for name in sys.argv[2:]:
    os.kill(os.getpid(), getattr(signal, name))
time.sleep(0.2)  # the process goes on starting: nothing acts on them yet
print("still starting", flush=True)

async def main():
    from kvrelay.stopping import ProcessStop
    stop = ProcessStop("test")
    stop.install()
    await asyncio.wait_for(stop.event.wait(), 10)
    await asyncio.sleep(0.1)
    print(f"stop {stop.signal_name} fast={stop.fast_requested}", flush=True)

asyncio.run(main())
"""


def _run(command: str, *signals: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, command, *signals], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def _said(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith(("still ", "stop "))]  # not the log


@pytest.mark.parametrize("command", ["broker", "ar", "dit"])
def test_a_signal_while_starting_is_a_graceful_stop_once_the_process_takes_signals(command: str) -> None:
    done = _run(command, "SIGTERM")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _said(done) == ["still starting", "stop SIGTERM fast=False"], done.stdout


def test_two_signals_while_starting_are_a_fast_stop() -> None:
    done = _run("dit", "SIGHUP", "SIGINT")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _said(done) == ["still starting", "stop SIGHUP fast=True"], done.stdout


def test_other_commands_keep_the_default_action() -> None:
    done = _run("generate", "SIGTERM")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout)
    assert "still starting" not in done.stdout
