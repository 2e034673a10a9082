"""kvrelay.stopping.exit_without_teardown in a real process: what Python's exit does first still
runs (non-daemon threads joined, atexit handlers, buffered output flushed) and the exit code is
the one given; the interpreter's teardown of the heap (here: a module global's finaliser) does
not run. Every service process and worker rank ends through it after a stop."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import atexit, sys, threading, time
from kvrelay.stopping import exit_without_teardown

class Heap:
    def __del__(self):
        print("torn down", flush=True)

heap = Heap()

def late():
    time.sleep(0.3)
    print("thread joined", flush=True)

threading.Thread(target=late).start()
atexit.register(lambda: sys.stdout.write("atexit ran\n"))
sys.stdout.write("buffered line\n")
exit_without_teardown(7)
"""


def test_threads_atexit_and_output_are_kept_the_teardown_skipped() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    lines = done.stdout.splitlines()
    assert {"buffered line", "thread joined", "atexit ran"} <= set(lines), done.stdout
    assert lines.index("thread joined") < lines.index("atexit ran")
    assert "torn down" not in lines, done.stdout


LATE_SIGNAL = r"""
import asyncio, atexit, os, signal, sys, time
from kvrelay.stopping import ProcessStop, exit_without_teardown

async def main():
    stop = ProcessStop("test")
    stop.install()
    os.kill(os.getpid(), signal.SIGTERM)
    await stop.event.wait()  # a graceful stop, done at once
    return 0

code = asyncio.run(main())
# The supervisor's second signal arrives while the process exits (here: during the exit's own
# steps, as an atexit handler runs).
def late():
    os.kill(os.getpid(), signal.SIG{name})
    time.sleep(0.3)
    print("exit path done", flush=True)
atexit.register(late)
exit_without_teardown(code)
"""


@pytest.mark.parametrize("name", ["TERM", "INT", "HUP"])
def test_a_stop_signal_after_the_stop_does_not_kill_the_exiting_process(name: str) -> None:
    done = subprocess.run([sys.executable, "-c", LATE_SIGNAL.replace("{name}", name)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, -getattr(signal, f"SIG{name}"), done.stderr[-2000:])
    assert "exit path done" in done.stdout
