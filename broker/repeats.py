"""RepeatedWarnings: at most one warning line per (event, replica) per window, for the warnings any
caller holding the replica token can trigger once per RPC (a heartbeat or report from a stale
incarnation). Found black-box: 300 heartbeats naming a made-up incarnation of `dit-0` wrote 300
`stale_incarnation_heartbeat_ignored` lines; a loop of them fills the broker's log (and the disk
under it) as fast as the caller sends.

Pure: the clock is given; touched on the broker's event loop only. The line that is logged after a
quiet window says how many were left out (`suppressed`)."""

from __future__ import annotations

from collections.abc import Callable

# One line per (event, replica id) per this many seconds.
REPEAT_WINDOW_S = 60.0
# (event, replica id) pairs remembered; the least recently logged goes first. Replica ids reaching
# these warnings are registered ones (bounded by the registry), so this bound is a backstop.
MAX_REPEAT_KEYS = 1024


class RepeatedWarnings:
    def __init__(
        self, clock: Callable[[], float], window_s: float = REPEAT_WINDOW_S, max_keys: int = MAX_REPEAT_KEYS
    ) -> None:
        self._clock = clock
        self._window_s = window_s
        self._max_keys = max_keys
        # (event, key) -> (time of the last line logged, lines left out since)
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def admit(self, event: str, key: str) -> int | None:
        """None: leave this line out (it is counted). Otherwise log it, with the returned number of
        lines of the same (event, key) left out since the last one logged."""
        now = self._clock()
        last = self._last.get((event, key))
        if last is not None and now - last[0] < self._window_s:
            self._last[event, key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self._max_keys:
            oldest = min(self._last, key=lambda k: self._last[k][0])
            del self._last[oldest]
        self._last[event, key] = (now, 0)
        return 0 if last is None else last[1]


__all__ = ["RepeatedWarnings", "REPEAT_WINDOW_S", "MAX_REPEAT_KEYS"]
