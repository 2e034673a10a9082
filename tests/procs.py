"""Starting and stopping real kvrelay processes in tests (always stopped, by PID)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[str]
    address: str

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


def start_service(args: Sequence[str], *, cwd: Path, timeout: float = 60.0, env: dict[str, str] | None = None) -> ServiceProcess:
    """Run `python -m kvrelay ARGS` and wait for its 'listening on HOST:PORT' line."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVRELAY_LOG_FORMAT": "json", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = _LISTEN.search(line)
        if match:
            _drain_in_background(proc)
            return ServiceProcess(proc, f"{match.group(1)}:{match.group(2)}")
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"service {args} did not start:\n{''.join(seen[-40:])}")


def _drain_in_background(proc: subprocess.Popen[str]) -> None:
    import threading

    def drain() -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    threading.Thread(target=drain, daemon=True).start()
