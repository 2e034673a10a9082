"""Starting and stopping real kvrelay processes in tests (always stopped, by PID)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[str]
    address: str
    # Every line the process printed (stdout and stderr), read on a thread: for failure messages.
    lines: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)

    def output(self) -> str:
        return "".join(self.lines[-60:])


def start_service(
    args: Sequence[str],
    *,
    cwd: Path,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServiceProcess:
    """Run `python -m kvrelay ARGS` and wait for its 'listening on HOST:PORT' line.

    `preexec_fn` runs in the child before it starts (resource limits of a fault test)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVRELAY_LOG_FORMAT": "json", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        preexec_fn=preexec_fn,
    )
    lines: list[str] = []
    found: list[str] = []
    seen = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = _LISTEN.search(line)
            if match and not found:
                found.append(f"{match.group(1)}:{match.group(2)}")
                seen.set()
        seen.set()

    threading.Thread(target=reader, daemon=True).start()
    if not seen.wait(timeout) or not found:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"kvrelay {args[0]} did not start:\n" + "".join(lines[-40:]))
    return ServiceProcess(proc, found[0], lines)


def metrics_port_of(lines: Sequence[str]) -> int | None:
    """The metrics port a process printed in its `grpc_listening` line (JSON logs), if any."""
    import json

    for line in lines:
        if '"grpc_listening"' in line and "metrics_port" in line:
            try:
                return int(json.loads(line)["metrics_port"])
            except (ValueError, KeyError, TypeError):
                continue
    return None


def scrape_counter_by_labels(port: int, name: str, labels: Sequence[str]) -> dict[tuple[str, ...], float]:
    """The samples of counter `name` (without `_total`) at 127.0.0.1:`port`, keyed by `labels`' values."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        tuple(sample.labels[label] for label in labels): sample.value
        for family in text_string_to_metric_families(text) if family.name == name
        for sample in family.samples if sample.name == name + "_total"
    }
