"""kvrelay/stopping.py in-process: the second stop request is a fast stop (its callbacks run once,
a drain awaited through `unless_fast` is cancelled), a third changes nothing; and
GrpcServer.stop(grace, fast=...) cancels running RPCs at once when the fast stop comes during the
grace. The processes' own fast stops: tests/{broker,ar_service,dit_service,supervisor}/*fast_stop*."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.server import GrpcServer
from kvrelay.stopping import ProcessStop, run_on_own_thread
from kvrelay.v1 import broker_pb2, broker_pb2_grpc


def test_the_second_request_is_a_fast_stop_and_a_third_changes_nothing() -> None:
    async def scenario() -> None:
        stop = ProcessStop("ar")
        cuts: list[str] = []
        stop.on_fast(lambda: cuts.append("kill ranks"))
        stop.request("SIGTERM")
        assert stop.requested and not stop.fast_requested and cuts == []
        stop.request("SIGINT")
        assert stop.fast_requested and cuts == ["kill ranks"]
        stop.request("SIGTERM")
        assert cuts == ["kill ranks"]
        # A cut registered once the fast stop came runs at once.
        stop.on_fast(lambda: cuts.append("late"))
        assert cuts == ["kill ranks", "late"]
        assert stop.signal_name == "SIGTERM"  # the first signal names the stop

    asyncio.run(scenario())


def test_a_repeated_hangup_never_makes_the_stop_fast() -> None:
    """`kvrelay up`'s PR_SET_PDEATHSIG (SIGHUP) comes again each time Linux hands an orphan to
    another thread of its dying parent: that is no operator's second Ctrl-C."""

    async def scenario() -> None:
        stop = ProcessStop("dit")
        stop.request("SIGHUP")
        stop.request("SIGHUP")
        assert stop.requested and not stop.fast_requested
        stop.request("SIGTERM")  # an operator's signal after the hangup still cuts the drain
        assert stop.fast_requested

    asyncio.run(scenario())


def test_a_fast_stop_cancels_the_drain_it_interrupts() -> None:
    async def scenario() -> None:
        stop = ProcessStop("dit")
        stop.request("SIGTERM")
        cancelled = asyncio.Event()

        async def drain() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.05, stop.request, "SIGTERM")
        assert await asyncio.wait_for(stop.unless_fast(drain()), 30) is False
        assert cancelled.is_set()
        # Once fast, a drain step does not even start; one that ends first is waited for.
        assert await stop.unless_fast(asyncio.sleep(0)) is False
        other = ProcessStop("dit")
        assert await other.unless_fast(asyncio.sleep(0.01)) is True

    asyncio.run(scenario())


def test_a_drain_that_raises_raises() -> None:
    async def scenario() -> None:
        stop = ProcessStop("broker")

        async def broken() -> None:
            raise RuntimeError("journal")

        with pytest.raises(RuntimeError, match="journal"):
            await stop.unless_fast(broken())

    asyncio.run(scenario())


def test_run_on_own_thread_hands_back_result_and_error() -> None:
    async def scenario() -> None:
        assert await run_on_own_thread(lambda: 7, "t") == 7

        def fails() -> None:
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            await run_on_own_thread(fails, "t")

    asyncio.run(scenario())


class _Slow(broker_pb2_grpc.BrokerServiceServicer):
    """A BrokerService whose GetPool never answers on its own: an RPC the grace waits for."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def GetPool(self, request: broker_pb2.GetPoolRequest, context: object) -> broker_pb2.GetPoolResponse:
        self.entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return broker_pb2.GetPoolResponse()


def test_a_fast_stop_during_the_servers_grace_cancels_the_running_rpcs() -> None:
    async def scenario() -> None:
        servicer = _Slow()
        name = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name
        server = GrpcServer(name="t", host="127.0.0.1", port=0,
                            registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, servicer, name)])
        await server.start()
        stop = ProcessStop("broker")
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = broker_pb2_grpc.BrokerServiceStub(channel).GetPool(broker_pb2.GetPoolRequest(), timeout=60)
            await asyncio.wait_for(servicer.entered.wait(), 30)
            stop.request("SIGTERM")
            stopping = asyncio.ensure_future(server.stop(grace=3600, fast=stop))
            await asyncio.sleep(0.2)
            assert not stopping.done()  # the graceful stop waits for the RPC
            stop.request("SIGTERM")
            await asyncio.wait_for(stopping, 30)
            assert servicer.cancelled.is_set()
            with pytest.raises(grpc.aio.AioRpcError):
                await call

    asyncio.run(scenario())
