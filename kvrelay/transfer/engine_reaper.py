"""Destroys retired Mooncake TransferEngines off the serving path, and fast.

Owns one daemon thread per MooncakeEndpoint that takes engines no call runs on any more and lets
them go. It must never be handed an engine a call may still use (the endpoint counts calls per
engine and hands over only idle ones), and it must never hold up a process that stops: the
thread is a daemon, its queue is bounded, and `close()` waits a bounded time.

Why not just drop the reference in a thread: the binding's destructor runs with the GIL held
(pybind11) and joins the engine's handshake listener, which sits in accept() with a 1 s receive
timeout; measured, every Python thread of the process stopped for about a second, whichever
thread dropped the engine. A connection to the listener wakes it, but no thread of this process
can open one while the destructor holds the GIL, so a short-lived helper process connects to the
engine's RPC port (and closes at once) every few milliseconds until nothing listens there: the
destructor then returns within milliseconds (benchmarks/mooncake/engine_teardown.py). Each of
those connections makes the engine log two warnings ("incomplete handshake"). If the helper
cannot start or connect, the engine is still destroyed, with the old pause.
"""

from __future__ import annotations

import collections
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvrelay.logging import get_logger

# Engines waiting to be destroyed, at most; the endpoint keeps others retired until there is room.
MAX_QUEUED = 8
# How long the helper connects before it gives up (the destructor then waits out its accept).
_POKE_FOR_S = 3.0
_POKE_EVERY_S = 0.002
_HELPER_START_S = 5.0

_POKER = """
import socket, sys, time
host, port, until = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
print("ready", flush=True)
while time.monotonic() < until:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        break  # nothing listens there any more: the engine's listener is closed
    time.sleep(float(sys.argv[4]))
"""

_log = get_logger(__name__)


@dataclass(slots=True)
class RetiredEngine:
    """An engine no call runs on (`engine`: the binding's object, its only reference), where its
    handshake listener answers, and the memory still registered on it."""

    engine: Any
    host: str
    rpc_port: int
    generation: int
    registered: tuple[int, ...] = ()
    replaced: bool = True  # False: the endpoint closes (not logged)


class EngineReaper:
    """One thread that destroys retired engines in order; `submit` never blocks."""

    def __init__(self, name: str = "mooncake-engine-reaper") -> None:
        self._name = name
        self._queue: collections.deque[RetiredEngine] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._busy = False
        self.destroyed = 0

    def has_room(self) -> bool:
        with self._cond:
            return not self._closing and len(self._queue) < MAX_QUEUED

    def submit(self, retired: RetiredEngine, *, force: bool = False) -> None:
        """Queue `retired` for destruction. Check `has_room()` first: without `force` a full queue
        raises (the caller keeps its engine); `force` ignores the bound (an endpoint that closes
        hands over every engine; one that checked the room holds every other submitter off).
        After `close()` nobody else would destroy it: the calling thread does."""
        with self._cond:
            if not force and len(self._queue) >= MAX_QUEUED:
                raise RuntimeError("the engine reaper's queue is full")
            if not self._closing:
                self._queue.append(retired)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return
        self._destroy(retired)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every engine handed over so far is destroyed (True), or `timeout_s` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Destroy what is queued, then stop the thread; waits at most `timeout_s` (the thread is
        a daemon: a process that exits meanwhile is not held up). True if it stopped in time."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            _log.warning("mooncake_engine_reaper_still_running", queued=self.pending(), waited_s=timeout_s)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing, nothing left
                retired = self._queue.popleft()
                self._busy = True
            try:
                self._destroy(retired)
            except Exception as exc:  # noqa: BLE001 - one engine's teardown must not stop the others'
                _log.error("mooncake_engine_destroy_failed", generation=retired.generation, error=repr(exc)[:500])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _destroy(self, retired: RetiredEngine) -> None:
        engine, retired.engine = retired.engine, None
        for addr in retired.registered:
            engine.unregister_memory(addr)
        helper = _start_helper(retired.host, retired.rpc_port)
        t0 = time.monotonic()
        del engine  # the binding's destructor runs here, the GIL held until it returns
        held_ms = round(1000 * (time.monotonic() - t0))
        if helper is not None:
            try:
                helper.wait(_POKE_FOR_S + 2.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - it gives up by itself
                helper.kill()
                helper.wait()
            if helper.stdout is not None:
                helper.stdout.close()
        self.destroyed += 1
        if retired.replaced:  # not at every endpoint's close
            _log.info(
                "mooncake_engine_destroyed", generation=retired.generation, duration_ms=held_ms,
                listener_woken=helper is not None,
            )  # fmt: skip


def _start_helper(host: str, port: int) -> subprocess.Popen[bytes] | None:
    """The process that wakes the engine's listener, once it runs (None if it could not start)."""
    try:
        helper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _POKER, host, str(port), str(_POKE_FOR_S), str(_POKE_EVERY_S)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except OSError as exc:
        _log.warning("mooncake_engine_reaper_helper_failed", error=repr(exc)[:300])
        return None
    assert helper.stdout is not None
    ready, _, _ = select.select([helper.stdout], [], [], _HELPER_START_S)
    if not ready or not helper.stdout.readline():
        helper.kill()
        helper.wait()
        helper.stdout.close()
        _log.warning("mooncake_engine_reaper_helper_failed", error="the helper did not start")
        return None
    return helper
