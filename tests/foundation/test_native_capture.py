"""A service process logging JSON turns native output (glog/absl lines, prints, tracebacks) into
JSON records, and exits promptly even while a process it started still holds the pipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SCRIPT = r"""
import os, subprocess, sys
from kvrelay.logging import capture_native_output, configure_logging, get_logger
configure_logging(json=True, process="t")
assert capture_native_output("t")
# A child that outlives us holds the pipes (as rank workers and multiprocessing's tracker do).
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print(f"child {child.pid}", flush=True)
os.write(2, b"I1202 12:00:00.000000  123 transfer_engine.cpp:7] native info\n")
os.write(2, b"E1202 12:00:00.000000  123 transfer_metadata.cpp:9] Local segment descriptor not found\n")
os.write(2, b"W1202 12:00:00.000000  124 rpc.cc:1] something odd\nplain stderr\n")
os.write(2, b"kvrelay dit: SIGTERM: stopping (serving)\nkvrelay dit: stages[1].devices: no GPU 3\n")
os.write(2, b"kvrelay dit: SIGINT again: fast stop (serving): cutting in-flight work, exit 4\n")
get_logger("x").info("structured", n=1)
print("plain stdout")
raise RuntimeError("boom")
"""


def test_every_line_is_json_and_the_process_exits_promptly() -> None:
    env = {**os.environ, "KVRELAY_NATIVE_CAPTURE": "1"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.monotonic() - started
    lines = (done.stdout + done.stderr).splitlines()
    records = [json.loads(line) for line in lines]  # every line is JSON
    native = {r["line"]: r for r in records if r["event"] == "native_output"}
    child = next(int(line.split()[1]) for line in native if line.startswith("child "))
    try:
        os.kill(child, signal.SIGKILL)  # the sleeper this test started
    except ProcessLookupError:
        pass
    assert done.returncode == 1
    assert elapsed < 20, elapsed  # not held until the 30 s child ends
    assert native["native info"]["level"] == "info" and native["native info"]["source"] == "transfer_engine.cpp:7"
    assert native["Local segment descriptor not found"]["level"] == "info"  # routine, not an error
    assert native["something odd"]["level"] == "warning"
    assert native["plain stdout"]["stream"] == "stdout"
    assert native["plain stderr"]["level"] == "warning"
    # A stop that was asked for is no error (every graceful stop logged one); a failure line is.
    assert native["kvrelay dit: SIGTERM: stopping (serving)"]["level"] == "info"
    assert native["kvrelay dit: stages[1].devices: no GPU 3"]["level"] == "error"
    assert native["kvrelay dit: SIGINT again: fast stop (serving): cutting in-flight work, exit 4"]["level"] == "warning"
    assert any("RuntimeError: boom" in line for line in native)  # the traceback, line by line
    assert all(r["process"] == "t" for r in records)
    assert any(r["event"] == "structured" and r["n"] == 1 for r in records)
