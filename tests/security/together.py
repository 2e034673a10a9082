"""Starting and stopping a deployment's replica processes side by side (tests/procs.py, one each).

A replica's start is mostly its interpreter importing torch and loading its model, and its stop
mostly its server's and drain's graces: two replicas started or stopped one after the other take
the sum, side by side about the longer one. Each still gets its own start-up check and exit code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent import futures

from tests.procs import ServiceProcess


def start_together(starts: Mapping[str, Callable[[], ServiceProcess]]) -> dict[str, ServiceProcess]:
    """Run every start at once; the processes by name. If any fails to start, the others that did
    are stopped before its error is raised (never left running)."""
    with futures.ThreadPoolExecutor(max(1, len(starts))) as pool:
        pending = {name: pool.submit(start) for name, start in starts.items()}
        futures.wait(pending.values())
    started = {name: f.result() for name, f in pending.items() if f.exception() is None}
    errors = [f.exception() for f in pending.values() if f.exception() is not None]
    if errors:
        stop_together(started)
        raise errors[0]  # type: ignore[misc]
    return started


def stop_together(procs: Mapping[str, ServiceProcess], timeout: float = 10.0) -> dict[str, int]:
    """SIGTERM to every process at once (ServiceProcess.stop: SIGKILL after `timeout`); each
    one's exit code by name."""
    with futures.ThreadPoolExecutor(max(1, len(procs))) as pool:
        codes = {name: pool.submit(proc.stop, timeout) for name, proc in procs.items()}
    return {name: f.result() for name, f in codes.items()}
