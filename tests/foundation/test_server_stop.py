"""GrpcServer.stop(grace) over real sockets: a stop with no RPC running ends at once, even while
a client in another process holds an idle connection (grpc's own graceful stop waited out the
whole grace for it: every idle AR, broker and DiT took 1, 2 and 5 s to stop); an RPC running
still gets its grace, and the stop ends when it does; one that outlives the grace is cancelled;
and calls racing the stop are answered or refused, never cut once accepted."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from kvrelay.security import RPC_RULES, CallerClass, RpcRule
from kvrelay.server import GrpcServer

SVC = "test.Slow"
# A client that makes one health check, says so, and then keeps its channel open and idle: the
# peer that held grpc's graceful stop (the supervisor's health channel, the broker's channels),
# which ends only once every connection is closed.
IDLE_CLIENT = r"""
import sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
print("checked", flush=True)
time.sleep(600)
"""
GRACE_S = 30.0
# Far under GRACE_S, far over what an idle stop takes on a loaded machine (milliseconds).
PROMPT_S = 10.0


class _Slow:
    """Unary RPCs that run until released (`release`), or `Quick` ones that sleep a little."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.quick = {"entered": 0, "answered": 0, "cancelled": 0}
        self.cleaned = asyncio.Event()

    async def Wait(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def CleanUp(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        """Cancelled by its caller, it cleans up until released (a Denoise handing back its pages)."""
        self.entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            self.cancelled.set()
            await self.release.wait()
            self.cleaned.set()
        return health_pb2.HealthCheckResponse()

    async def Quick(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        self.quick["entered"] += 1
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.quick["cancelled"] += 1
            raise
        self.quick["answered"] += 1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _add_slow(servicer: _Slow, server: grpc.aio.Server) -> None:
    req, resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )
        for name in ("Wait", "Quick", "CleanUp")
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SVC, handlers),))


async def _serve() -> tuple[GrpcServer, _Slow]:
    slow = _Slow()
    rules = {**RPC_RULES, **{f"/{SVC}/{m}": RpcRule(CallerClass.PUBLIC, True, "none") for m in ("Wait", "Quick", "CleanUp")}}
    server = GrpcServer("test", "127.0.0.1", 0, [(_add_slow, slow, SVC)], rules=rules, metrics_port=0)
    await server.start()
    await server.set_serving(True)
    return server, slow


@contextlib.asynccontextmanager
async def _idle_client_in_another_process(address: str) -> Any:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", IDLE_CLIENT, address,
                                                stdout=asyncio.subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"checked"
        # Stopped, it reads nothing more (not the server's GOAWAY either): a running client reads
        # it a few seconds later and closes, a busy or stopped one never does.
        proc.send_signal(signal.SIGSTOP)
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _call(channel: grpc.aio.Channel, method: str) -> Any:
    unary = channel.unary_unary(f"/{SVC}/{method}", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)  # fmt: skip
    return unary(health_pb2.HealthCheckRequest(), timeout=60)


def test_an_idle_stop_ends_at_once_while_another_process_holds_a_connection() -> None:
    async def scenario() -> None:
        server, _ = await _serve()
        async with _idle_client_in_another_process(server.address):
            started = time.monotonic()
            await asyncio.wait_for(server.stop(GRACE_S), GRACE_S + 30)
            took = time.monotonic() - started
        assert took < PROMPT_S, f"an idle stop took {took:.1f} s of its {GRACE_S:g} s grace"

    asyncio.run(scenario())


def test_a_running_rpc_gets_its_grace_and_the_stop_ends_with_it() -> None:
    async def scenario() -> None:
        server, slow = await _serve()
        async with _idle_client_in_another_process(server.address), grpc.aio.insecure_channel(server.address) as channel:
            call = _call(channel, "Wait")
            await asyncio.wait_for(slow.entered.wait(), 30)
            stopping = asyncio.ensure_future(server.stop(GRACE_S))
            done, _ = await asyncio.wait({stopping}, timeout=1.0)
            assert not done, "the stop did not wait for the running RPC"
            released = time.monotonic()
            slow.release.set()
            reply = await asyncio.wait_for(call, 30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # answered, not cut
            await asyncio.wait_for(stopping, GRACE_S + 30)
            took = time.monotonic() - released
        assert not slow.cancelled.is_set()
        assert took < PROMPT_S, f"the stop took {took:.1f} s more after its last RPC ended"

    asyncio.run(scenario())


def test_a_handler_cleaning_up_after_its_caller_left_gets_the_grace_too() -> None:
    async def scenario() -> None:
        server, slow = await _serve()
        async with _idle_client_in_another_process(server.address), grpc.aio.insecure_channel(server.address) as channel:
            call = _call(channel, "CleanUp")
            await asyncio.wait_for(slow.entered.wait(), 30)
            call.cancel()
            await asyncio.wait_for(slow.cancelled.wait(), 30)
            stopping = asyncio.ensure_future(server.stop(GRACE_S))
            done, _ = await asyncio.wait({stopping}, timeout=1.0)
            assert not done, "the stop did not wait for the handler still running"
            slow.release.set()
            await asyncio.wait_for(stopping, GRACE_S + 30)
        assert slow.cleaned.is_set()

    asyncio.run(scenario())


def test_an_rpc_that_outlives_the_grace_is_cancelled() -> None:
    async def scenario() -> None:
        server, slow = await _serve()
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = _call(channel, "Wait")
            await asyncio.wait_for(slow.entered.wait(), 30)
            await asyncio.wait_for(server.stop(0.3), 30)
            assert slow.cancelled.is_set()
            try:
                await asyncio.wait_for(call, 30)
            except grpc.aio.AioRpcError:
                pass
            else:
                raise AssertionError("the RPC was answered after the grace")

    asyncio.run(scenario())


def test_calls_racing_the_stop_are_answered_or_refused_never_cut() -> None:
    """Calls keep coming while the server stops: each is answered (it reached the server before
    the stop) or refused (after it); a call the server runs is never cancelled by the stop's
    early end (only the grace, 30 s here, could cut one)."""

    async def scenario() -> None:
        server, slow = await _serve()
        outcomes: list[str] = []
        async with _idle_client_in_another_process(server.address), grpc.aio.insecure_channel(server.address) as channel:
            await _call(channel, "Quick")  # connected
            outcomes.append("OK")

            async def caller() -> None:
                while True:
                    try:
                        await _call(channel, "Quick")
                        outcomes.append("OK")
                    except grpc.aio.AioRpcError as err:
                        outcomes.append(err.code().name)
                        if err.code() == grpc.StatusCode.UNAVAILABLE:
                            return

            callers = [asyncio.ensure_future(caller()) for _ in range(20)]
            await asyncio.sleep(0.3)
            await asyncio.wait_for(server.stop(GRACE_S), GRACE_S + 30)
            done, pending = await asyncio.wait(callers, timeout=30)
            for task in pending:
                task.cancel()
            assert not pending
        assert slow.quick["cancelled"] == 0 and slow.quick["answered"] == slow.quick["entered"], slow.quick
        assert 0 < outcomes.count("OK") == slow.quick["answered"], (slow.quick, sorted(set(outcomes)))

    asyncio.run(scenario())
