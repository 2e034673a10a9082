"""A requested stop of a service process (SIGTERM, SIGINT, SIGHUP), and the waits it interrupts.

Owns the process's stop signals from `ProcessStop.install()` on: the first signal sets one event
(and prints the one line `kvrelay <role>: SIGTERM: stopping (<phase>)`), and every start-up wait
that can last longer than a moment (the replica lock, the model load, registration retries) runs
through `until_stopped`, which ends it and raises `StopRequested` when the stop comes first. It
never exits the process itself: the caller unwinds through its `finally` (what it started, it
stops) and exits with the code of a clean stop, 0.

A second SIGTERM or SIGINT while the graceful stop runs is a fast stop, as a second
Ctrl-C is to vLLM, uvicorn or `docker compose up`: it prints `kvrelay <role>: SIGINT again: fast stop
(<phase>)`, sets `fast_event` and runs the `on_fast` callbacks at once (kill the rank workers, cut
the gRPC server's grace); every drain step the process awaits through `unless_fast` ends there.
What a fast stop still does is only what the contract needs (the workers gone before their
memory is freed, the journal closed), and to the broker it is a crash, never a clean release:
the process neither deregisters nor reports a write it did not see end (docs/transfer.md, the
in-doubt rules), and it exits EXIT_FAST_STOP. A third signal changes nothing, and neither does a
SIGHUP after the first signal: a hangup is not an operator's second request and may come more
than once (a closing terminal; `kvrelay up`'s PR_SET_PDEATHSIG, which Linux sends again each time
an orphan is handed to another thread of its dying parent and then to init: a supervisor killed
with SIGKILL gave its children two SIGTERMs, and they cut their drain).

Before this, `kvrelay ar` retried an unreachable broker for 2 minutes with SIGTERM and Ctrl-C
noted but not acted on, and SIGHUP killed a replica without stopping its workers in order.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

from kvrelay.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# SIGHUP too: the terminal or SSH session that started the process went away.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The signals whose second coming is a fast stop (a hangup never is: see the module docstring).
FAST_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The exit code of a process whose graceful stop a second signal cut short (every process kind:
# broker, ar, dit and `kvrelay up`); distinct from 0 (a graceful stop), 1 (a start-up failure),
# 2 (configuration) and 3 (a fail stop).
EXIT_FAST_STOP = 4
# How long an interrupted wait may take to end once aborted (a killed rank group, a cancelled
# RPC): its thread must be done before the process exits, or interpreter shutdown waits on it.
ABORT_WAIT_S = 10.0


def run_on_own_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """`fn()` on a thread of its own (not the loop's default executor, whose few threads may all
    be blocked in the very calls a fast stop must end); a future of its result on the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        try:
            result = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, err)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=body, name=name, daemon=True).start()
    return future


def exit_without_teardown(code: int) -> NoReturn:
    """End a process whose work is done as Python's own exit would, minus its teardown.

    What that exit does first still runs, in its order: non-daemon threads are joined (and
    concurrent.futures' workers ended: threading's shutdown), the atexit handlers (the native
    output capture's flush, logging's, multiprocessing's), stdout and stderr flushed. Skipped: the
    last garbage collection and the teardown of every module, which free a heap that torch and
    the models make large, for nothing (the kernel frees it at once): they added 0.3-1.1 s to
    every stop of an AR, a DiT, each of their ranks and the broker, after the process had
    logged that it stopped (multiprocessing's fork-started children skip them the same way).

    A stop signal from here on is ignored: the process has stopped and exits with `code`. The
    event loop's handlers are gone (closing the loop restores the default actions), and a second
    SIGTERM a supervisor sends a moment after the first (a fast stop of a process whose graceful
    stop had already ended) killed it mid-exit: exit -15 instead of its code."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _say(line: str) -> None:
    """The one line of a stop on stderr, if it can still be written (a closed terminal: not)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


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
        # Set by a second signal: the graceful stop is cut short (see the module docstring).
        self.fast_event = asyncio.Event()
        self._on_fast: list[Callable[[], object]] = []

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    @property
    def fast_requested(self) -> bool:
        return self.fast_event.is_set()

    def on_fast(self, callback: Callable[[], object]) -> None:
        """Run `callback` (on the event loop, must not block) when a fast stop is requested, or
        now if it already was: what cuts in-flight work (kill the ranks, cut the server's grace)."""
        if self.fast_event.is_set():
            self._run_fast_callback(callback)
        else:
            self._on_fast.append(callback)

    def install(self) -> None:
        """Take SIGTERM, SIGINT and SIGHUP on the running loop (replacing any handler there)."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request, sig.name)
        # Those that came while the process started (kvrelay.early_signals), in their order.
        from kvrelay import early_signals

        for name in early_signals.take():
            loop.call_soon(self.request, name)

    def request(self, signal_name: str) -> None:
        if self.fast_event.is_set():
            log.info("stop_already_requested", signal=signal_name, phase=self.phase, fast=True)
            return
        if self.event.is_set():
            if signal_name in {s.name for s in FAST_STOP_SIGNALS}:
                self.request_fast(signal_name)
            else:
                log.info("stop_already_requested", signal=signal_name, phase=self.phase)
            return
        self.signal_name = signal_name
        # The stop first, its line after: on a terminal that went away (a dropped SSH session)
        # the print fails (EIO), and raised here it swallowed the stop: the process ignored every
        # SIGHUP and SIGTERM from then on (tests/foundation/test_stop_without_a_terminal.py).
        self.thread_event.set()
        self.event.set()
        log.info("stop_requested", signal=signal_name, phase=self.phase)
        _say(f"kvrelay {self.role}: {signal_name}: stopping ({self.phase})")

    def request_fast(self, signal_name: str) -> None:
        """A second signal: cut the graceful stop (idempotent; implies the first request)."""
        if self.fast_event.is_set():
            return
        if not self.event.is_set():
            self.signal_name = signal_name
            self.thread_event.set()
            self.event.set()
        self.fast_event.set()
        log.warning("fast_stop_requested", signal=signal_name, phase=self.phase)
        _say(f"kvrelay {self.role}: {signal_name} again: fast stop ({self.phase}): cutting in-flight work, "
             f"exit {EXIT_FAST_STOP}")
        callbacks, self._on_fast = self._on_fast, []
        for callback in callbacks:
            self._run_fast_callback(callback)

    @staticmethod
    def _run_fast_callback(callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:  # noqa: BLE001 - one failed cut must not keep the others from running
            log.exception("fast_stop_callback_failed")

    async def unless_fast(self, awaitable: Awaitable[T]) -> bool:
        """Await a step of the graceful stop (a drain, a grace period) unless a fast stop comes
        first: then cancel it and return False. True when it ran to its end; what it raised is
        raised. Only for steps a crash may skip: never for one that keeps memory alive while a
        write may still land in it."""
        if self.fast_event.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            elif isinstance(awaitable, asyncio.Future):
                awaitable.cancel()
            return False
        task = asyncio.ensure_future(awaitable)
        fast = asyncio.ensure_future(self.fast_event.wait())
        try:
            await asyncio.wait({task, fast}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            fast.cancel()
        if task.done():
            task.result()
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        log.info("drain_cut", phase=self.phase)
        return False

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
            # Done with an error together with the stop is the stop's doing, told below as an
            # interrupted wait (a thread wait that polls `thread_event` raised InterruptedError
            # before this loop ran the stop's wake-up; a loaded host, tests/foundation/test_stopping.py).
            if not self.event.is_set() or task.cancelled() or task.exception() is None:
                return task.result()
        elif abort is not None:
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


__all__ = [
    "ABORT_WAIT_S", "EXIT_FAST_STOP", "FAST_STOP_SIGNALS", "STOP_SIGNALS", "ProcessStop", "StopRequested",
    "exit_without_teardown", "run_on_own_thread",
]
