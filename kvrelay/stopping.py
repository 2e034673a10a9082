"""A requested stop of a service process (SIGTERM, SIGINT, SIGHUP), and the waits it interrupts.

Owns the process's stop signals from `ProcessStop.install()` on: the first signal sets one event
(and prints the one line `kvrelay <role>: SIGTERM: stopping (<phase>)`), and every start-up wait
that can last longer than a moment (the replica lock, the model load, registration retries) runs
through `until_stopped`, which ends it and raises `StopRequested` when the stop comes first. It
never exits the process itself: the caller unwinds through its `finally` (what it started, it
stops) and exits with the code of a clean stop, 0.

Before this, `kvrelay ar` retried an unreachable broker for 2 minutes with SIGTERM and Ctrl-C
noted but not acted on, and SIGHUP killed a replica without stopping its workers in order.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvrelay.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# SIGHUP too: the terminal or SSH session that started the process went away.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long an interrupted wait may take to end once aborted (a killed rank group, a cancelled
# RPC): its thread must be done before the process exits, or interpreter shutdown waits on it.
ABORT_WAIT_S = 10.0


class StopRequested(Exception):
    """A stop was requested while the process waited at start-up; `signal_name` says which."""

    def __init__(self, signal_name: str, phase: str) -> None:
        super().__init__(f"{signal_name} while {phase}")
        self.signal_name = signal_name
        self.phase = phase


class ProcessStop:
    """The stop request of one service process: an event for the event loop, a threading.Event
    for blocking waits on worker threads, and the phase the process is in (for the one line)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.event = asyncio.Event()
        self.thread_event = threading.Event()
        self.signal_name: str | None = None
        self.phase = "starting"

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def install(self) -> None:
        """Take SIGTERM, SIGINT and SIGHUP on the running loop (replacing any handler there)."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request, sig.name)

    def request(self, signal_name: str) -> None:
        if self.event.is_set():
            log.info("stop_already_requested", signal=signal_name, phase=self.phase)
            return
        self.signal_name = signal_name
        log.info("stop_requested", signal=signal_name, phase=self.phase)
        print(f"kvrelay {self.role}: {signal_name}: stopping ({self.phase})", file=sys.stderr, flush=True)
        self.thread_event.set()
        self.event.set()

    def check(self) -> None:
        """Raise StopRequested if a stop was requested (between two steps of the start-up)."""
        if self.event.is_set():
            raise StopRequested(self.signal_name or "stop", self.phase)

    async def until_stopped(self, awaitable: Awaitable[T], *, abort: Callable[[], object] | None = None) -> T:
        """Await `awaitable` unless a stop comes first; then end it and raise StopRequested.

        A coroutine is cancelled. A wait that runs on a thread (asyncio.to_thread) cannot be:
        `abort` (run on a thread) must make it return, e.g. kill the ranks it waits for or set the
        event it polls; the thread is then waited for up to ABORT_WAIT_S, its outcome dropped."""
        if self.event.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started (a to_thread call has not reached its thread)
            self.check()
        task = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
        if abort is not None:
            await asyncio.to_thread(abort)
        else:
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=ABORT_WAIT_S)
        if task not in done:
            log.warning("wait_interrupted", phase=self.phase, outcome=f"still running after {ABORT_WAIT_S:g} s")
        elif task.cancelled():
            log.info("wait_interrupted", phase=self.phase, outcome="cancelled")
        else:
            # What the interrupted wait raised (a killed rank, a closed pipe) is the stop's doing.
            error = task.exception()
            outcome = "returned" if error is None else f"{type(error).__name__}: {error}"
            log.info("wait_interrupted", phase=self.phase, outcome=outcome)
        raise StopRequested(self.signal_name or "stop", self.phase)


__all__ = ["ABORT_WAIT_S", "STOP_SIGNALS", "ProcessStop", "StopRequested"]
