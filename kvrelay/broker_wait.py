"""How an AR or DiT replica waits for its broker at start (`broker.register_wait_seconds`).

RegisterReplica is retried with backoff while the broker does not answer (not started yet, a
wrong address, a firewall). Every PROGRESS_INTERVAL_S a log line says what the replica waits for,
where, and for how long yet; once the wait is over the replica raises its BrokerUnreachable and
prints one line (kvrelay.errors.broker_unreachable_line). The AR waited 120 s and the DiT 30 s,
each with its own loop: this is the one wait both use.

Owns the timing and the progress lines only: which errors mean "not answered" is the caller's,
and it never sleeps itself (the caller awaits the delay it returns, so a stop request ends it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from kvrelay.logging import get_logger

log = get_logger(__name__)

DEFAULT_REGISTER_WAIT_SECONDS: Final = 120.0
PROGRESS_INTERVAL_S: Final = 5.0


class BrokerWait:
    """One replica's wait for RegisterReplica to be answered, from its first try."""

    def __init__(
        self,
        broker: str,
        wait_s: float,
        *,
        first_delay_s: float = 0.2,
        max_delay_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.wait_s = wait_s
        self._clock = clock
        self._start = clock()
        self._delay = first_delay_s
        self._max_delay = max_delay_s
        self._next_progress = self._start  # the first unanswered try says so at once
        self.tries = 0

    def unanswered(self, code: str, message: str) -> float | None:
        """A try the broker did not answer (`code`, `message`: its gRPC status): the seconds to
        wait before the next one, or None when the wait is over and the replica gives up."""
        now = self._clock()
        self.tries += 1
        waited = now - self._start
        if waited + self._delay > self.wait_s:
            return None
        if now >= self._next_progress:
            log.info(
                "broker_not_reachable_yet",
                waiting_for=f"the broker at {self.broker} to answer RegisterReplica",
                waited_s=round(waited, 1),
                gives_up_in_s=round(self.wait_s - waited, 1),
                tries=self.tries,
                code=code,
                message=message[:200],
            )
            self._next_progress = now + PROGRESS_INTERVAL_S
        delay = self._delay
        self._delay = min(self._delay * 2, self._max_delay)
        return delay


class IdInUseWait:
    """One replica's wait while the broker refuses its registration `REPLICA_ID_IN_USE`: another
    process of its replica id is registered and answers (docs/operations.md, Across hosts).

    A process on its way out stops heartbeating and the broker lets a new incarnation take the id
    once its lease lapses, so the refused one tries again every `interval_s` for `wait_s` (twice
    the lease); a process still live after that is a second one of the id, and the refused
    replica exits with the broker's message. Logs `replica_id_in_use` at the first refusal and
    every PROGRESS_INTERVAL_S."""

    def __init__(
        self, replica_id: str, wait_s: float, *, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.replica_id = replica_id
        self.wait_s = wait_s
        self.interval_s = interval_s
        self._clock = clock
        self._start: float | None = None
        self._next_progress = 0.0
        self.tries = 0

    def refused(self, message: str) -> float | None:
        """A refusal `REPLICA_ID_IN_USE` (`message`: the broker's): the seconds to wait before the
        next try, or None when the wait is over and the replica gives up."""
        now = self._clock()
        if self._start is None:
            self._start = self._next_progress = now
        self.tries += 1
        waited = now - self._start
        if waited + self.interval_s > self.wait_s:
            return None
        if now >= self._next_progress:
            log.warning(
                "replica_id_in_use",
                replica_id=self.replica_id,
                waited_s=round(waited, 1),
                gives_up_in_s=round(self.wait_s - waited, 1),
                message=message[:400],
            )
            self._next_progress = now + PROGRESS_INTERVAL_S
        return self.interval_s
