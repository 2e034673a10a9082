"""OwedReleases: a ReleaseTicket the broker has not heard is delivered later, never dropped
while the broker is unreachable, never sent with a second outcome, and ends on NOT_FOUND (the
broker does not know the ticket: nothing is held) or on a refusal for good."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.dit_service.releases import OwedReleases


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name)


class _Broker:
    """ReleaseTicket: raises `answer` while it is set, else records the release."""

    def __init__(self, answer: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE) -> None:
        self.answer = answer
        self.tries: list[tuple[str, str]] = []
        self.released: dict[str, str] = {}
        self.tried = asyncio.Event()

    async def send(self, ticket_id: str, outcome: str, reason: str) -> None:
        self.tries.append((ticket_id, outcome))
        self.tried.set()
        if self.answer is not None:
            raise _error(self.answer)
        self.released.setdefault(ticket_id, outcome)


def _releases(broker: _Broker, inline_attempts: int = 3) -> OwedReleases:
    return OwedReleases(broker.send, inline_attempts=inline_attempts, first_delay_s=0.001, max_delay_s=0.002)


async def _until(predicate: object, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


def test_a_release_the_broker_did_not_hear_is_retried_until_it_does() -> None:
    async def body() -> None:
        broker = _Broker()
        releases = _releases(broker)
        await releases.release("t1", "OK", "")
        # The call stopped waiting after its inline tries; the ticket is still owed, not lost.
        assert len(broker.tries) == 3 and broker.released == {}
        assert releases.owed == {"t1"}
        await _until(lambda: len(broker.tries) >= 6)
        broker.answer = None
        await _until(lambda: not releases.owed)
        assert broker.released == {"t1": "OK"}
        assert {outcome for _, outcome in broker.tries} == {"OK"}

    asyncio.run(body())


def test_an_owed_release_is_sent_with_its_first_outcome_only() -> None:
    async def body() -> None:
        broker = _Broker()
        releases = _releases(broker)
        await releases.release("t1", "OK", "")
        await releases.release("t1", "CANCELLED", "a second end of the same ticket")
        # What a re-registration reports meanwhile: the first outcome, with its reason.
        assert releases.owed_outcomes() == {"t1": ("OK", "")}
        broker.answer = None
        await _until(lambda: not releases.owed)
        assert broker.released == {"t1": "OK"}
        assert {outcome for _, outcome in broker.tries} == {"OK"}

    asyncio.run(body())


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION])
def test_unknown_or_refused_ends_the_retries(code: grpc.StatusCode) -> None:
    """NOT_FOUND: the broker committed the release and was killed before answering (a released
    ticket leaves its journal), or its journal is new. FAILED_PRECONDITION (wrong replica):
    refused for good, retrying is refused the same way."""

    async def body() -> None:
        broker = _Broker(code)
        releases = _releases(broker)
        await releases.release("t1", "OK", "")
        assert broker.tries == [("t1", "OK")] and releases.owed == frozenset()

    asyncio.run(body())


def test_a_delivered_release_returns_at_once() -> None:
    async def body() -> None:
        broker = _Broker(None)
        releases = _releases(broker)
        await releases.release("t1", "FAILED", "TRANSFER_FAILED")
        assert broker.released == {"t1": "FAILED"} and releases.owed == frozenset()

    asyncio.run(body())


def test_a_cancelled_caller_leaves_the_delivery_running() -> None:
    async def body() -> None:
        broker = _Broker()
        releases = _releases(broker, inline_attempts=1000)
        caller = asyncio.ensure_future(releases.release("t1", "OK", ""))
        await broker.tried.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        broker.answer = None
        await _until(lambda: not releases.owed)
        assert broker.released == {"t1": "OK"}

    asyncio.run(body())


def test_stop_gives_a_grace_then_stops_trying() -> None:
    async def body() -> None:
        broker = _Broker()
        releases = _releases(broker)
        await releases.release("t1", "OK", "")
        await releases.stop(grace_s=0.05)
        assert releases.owed == frozenset()
        tries = len(broker.tries)
        await asyncio.sleep(0.05)
        assert len(broker.tries) == tries, "no try after stop"

    asyncio.run(body())


def test_a_release_owed_just_before_the_stop_is_delivered_by_the_stop() -> None:
    """Seen on CI: a Denoise handler cancelled twice while the DiT stopped began its shielded
    release as a coroutine that had not run when the stop path looked for undelivered releases;
    the process exited and the ticket stayed CONSUMING. `owe` creates the delivery at once, so
    `stop` right after it (no await in between) still waits for it."""

    async def scenario() -> None:
        broker = _Broker(answer=None)
        releases = _releases(broker)
        waiter = releases.owe("t-late", "CANCELLED", "stopping")
        assert releases.owed == {"t-late"}
        await releases.stop(grace_s=2.0)
        assert broker.released == {"t-late": "CANCELLED"}
        assert waiter.done()

    asyncio.run(scenario())
