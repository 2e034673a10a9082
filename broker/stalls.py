"""When this broker's own event loop did not run: the process stopped (SIGSTOP, a debugger), or
starved of CPU. A stage call whose connection timed out then (keepalive `ping timeout`: the
broker's pings went unanswered because the broker itself was not running to read the acks)
says nothing about the replica at its other end, and the generation's error must say so: found
black-box, a broker SIGSTOPped for 40 s mid-Denoise failed the generation `REPLICA_UNAVAILABLE`
"the DiT replica stopped answering" while the DiT had run all along.

Owns only the record of stalls; pure but for `run`, the loop that ticks it (the clock is given).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

# The loop ticks this often; a gap between ticks longer than this plus STALL_SECONDS is a stall.
TICK_SECONDS = 0.5
STALL_SECONDS = 2.0
# Stalls remembered (the oldest dropped first): a call asks only about its own lifetime.
KEPT_STALLS = 64


class LoopStalls:
    """The recent stretches of time in which this process's event loop did not run."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last = clock()
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=KEPT_STALLS)

    def tick(self) -> None:
        """Called every TICK_SECONDS by `run`; records the gap since the last call if it is a stall."""
        now = self._clock()
        if now - self._last > TICK_SECONDS + STALL_SECONDS:
            self._stalls.append((self._last, now))
        self._last = now

    def longest_since(self, start: float) -> float:
        """Seconds of the longest stall that overlaps [start, now] (0.0: none). The stall now
        going on, if any, counts from the last tick: the caller asks from the loop, so it is over."""
        self.tick()
        return max((end - max(begin, start) for begin, end in self._stalls if end > start), default=0.0)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.tick()
