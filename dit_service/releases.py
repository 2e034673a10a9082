"""The releases a DiT replica owes the broker: one `ReleaseTicket` per call that ended, delivered
until the broker has heard it.

Owns one rule: a release is owed from the moment its call stops reading the ticket's pages until
the broker acknowledges it (or answers that it does not know the ticket: nothing is held for it
any more). A broker that cannot be reached (stopped, restarting, partitioned) only delays it:
delivery goes on in the background with backoff, for as long as the process runs. Giving up
after a few tries lost the release for good when it raced a re-registration that still listed
the ticket as held (the listing was built before the call ended and reached the broker after
its release failed): the broker then kept the pages reserved until the next broker restart.
An owed ticket is never listed as held (`owed`): a re-registration reports it with its outcome
instead (`owed_outcomes`), which the broker's reconciliation applies as the release itself. The
first outcome owed for a ticket is the only one ever sent, so the broker never hears two
different ones from this incarnation.

Stopping the process gives undelivered releases a short grace; what is left then is freed by
the broker when the replica's next incarnation registers (proof that this memory is gone).
No gRPC stubs, no tickets' pages: `send` does the RPC and raises grpc.aio.AioRpcError.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import grpc

from kvrelay.logging import get_logger

log = get_logger(__name__)

# Codes after which the same idempotent ReleaseTicket may succeed later. INTERNAL is among them:
# a broker whose journal write failed exits and recovers from its journal.
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
})  # fmt: skip

# send(ticket_id, outcome, reason): one ReleaseTicket with its own deadline.
SendRelease = Callable[[str, str, str], Awaitable[object]]


class OwedReleases:
    """`await releases.release(ticket_id, outcome, reason)` returns once the broker acknowledged
    the release or the first `inline_attempts` tries failed; in the latter case delivery goes on
    in the background. `owed` lists the tickets not acknowledged yet."""

    def __init__(
        self,
        send: SendRelease,
        *,
        inline_attempts: int = 6,
        first_delay_s: float = 0.05,
        max_delay_s: float = 2.0,
    ) -> None:
        if inline_attempts < 1:
            raise ValueError(f"inline_attempts must be >= 1, got {inline_attempts}")
        self._send = send
        self.inline_attempts = inline_attempts
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._owed: dict[str, tuple[str, str]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def owed(self) -> frozenset[str]:
        """Tickets whose release the broker has not acknowledged yet (in flight or retried)."""
        return frozenset(self._owed)

    def owed_outcomes(self) -> dict[str, tuple[str, str]]:
        """ticket -> (outcome, reason) of every owed release: what a re-registration reports,
        so that the broker's reconciliation records the call's real outcome."""
        return dict(self._owed)

    async def release(self, ticket_id: str, outcome: str, reason: str) -> None:
        """Owe the broker this release until it hears it. Never raises. A second release of a
        ticket still owed sends nothing new: the first outcome stands."""
        await self.owe(ticket_id, outcome, reason)

    def owe(self, ticket_id: str, outcome: str, reason: str) -> asyncio.Future[None]:
        """`release`, owed at once: the delivery task exists (and `stop` waits for it) before
        this returns, with no await in between. Returns a future that completes when `release`
        would return. For a caller that may be cancelled again before a coroutine of its own
        could run (a handler's `finally` while the server stops): a shielded `release()` there
        had not started when the stop path looked for undelivered releases, and the process
        exited with the ticket still CONSUMING at the broker."""
        loop = asyncio.get_running_loop()
        if ticket_id in self._owed:
            log.warning("release_already_owed", ticket_id=ticket_id, outcome=outcome,
                        owed_outcome=self._owed[ticket_id][0])
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        self._owed[ticket_id] = (outcome, reason)
        inline_done: asyncio.Future[None] = loop.create_future()
        task = loop.create_task(self._deliver(ticket_id, outcome, reason, inline_done), name=f"release-{ticket_id}")
        self._tasks[ticket_id] = task
        # Waited on, not awaited: a caller cancelled now leaves the delivery running.
        return asyncio.ensure_future(_first_of(task, inline_done))

    async def _deliver(self, ticket_id: str, outcome: str, reason: str, inline_done: asyncio.Future[None]) -> None:
        delay = self.first_delay_s
        attempt = 0
        try:
            while True:
                attempt += 1
                try:
                    await self._send(ticket_id, outcome, reason)
                    if attempt > self.inline_attempts:
                        log.info("release_delivered_late", ticket_id=ticket_id, outcome=outcome, attempts=attempt)
                    return
                except grpc.aio.AioRpcError as err:
                    code = err.code()
                    if code == grpc.StatusCode.NOT_FOUND:
                        # Unknown to the broker: released and dropped from its journal (e.g. it
                        # committed our release and was killed before answering), or a fresh
                        # journal. Either way no page is held for this ticket any more.
                        log.info("release_ticket_unknown", ticket_id=ticket_id, outcome=outcome,
                                 details=err.details())
                        return
                    if code not in RETRYABLE:
                        # Refused for good (wrong replica, bad credentials): retrying is refused
                        # the same way. Logged: the ticket's pages wait for the broker's own proof.
                        log.error("release_refused", ticket_id=ticket_id, outcome=outcome, code=code.name,
                                  details=err.details())
                        return
                    if attempt == self.inline_attempts:
                        log.warning("release_pending", ticket_id=ticket_id, outcome=outcome, code=code.name,
                                    details=err.details())
                        if not inline_done.done():
                            inline_done.set_result(None)
                await asyncio.sleep(delay * (1 + random.random() * 0.25))
                delay = min(delay * 2, self.max_delay_s)
        finally:
            self._owed.pop(ticket_id, None)
            self._tasks.pop(ticket_id, None)

    async def stop(self, grace_s: float) -> None:
        """Give undelivered releases `grace_s` more, then stop trying (the next incarnation's
        registration frees their pages). Logs what was left undelivered."""
        tasks = set(self._tasks.values())
        if not tasks:
            return
        if grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        left = sorted(self._owed)
        if left:
            log.warning("releases_undelivered", tickets=left)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_of(*futures: asyncio.Future[None]) -> None:
    await asyncio.wait(set(futures), return_when=asyncio.FIRST_COMPLETED)
