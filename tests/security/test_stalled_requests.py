"""Calls whose request message never comes (found black-box): an anonymous peer opened 20 HTTP/2
connections of 1000 streams each to the broker, sent each stream's headers and never its message;
grpc.aio kept a task per call waiting for the message, no credential checked yet (the interceptor
sees the request only once it has arrived), and the broker grew from 70 MB to 515 MB, ~22 KB a
call, for as long as the peer held them: the bound on connections times the 1024 streams each
allowed ~20 million such calls. A half-closed call with no message at all was held the same way.
Every server now ends such a call after kvrelay.security.REQUEST_MESSAGE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvrelay import security
from kvrelay.errors import reason_of
from kvrelay.security import Credentials
from kvrelay.server import GrpcServer, _live_rpc_tasks

_GEN = "kvrelay.v1.GenerationService"
_CREDS = Credentials(api_token="api-token-0123456789", replica_token="replica-token-0123456789")


async def _ok(request: health_pb2.HealthCheckRequest, context: object) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _stream(request: health_pb2.HealthCheckRequest, context: object) -> AsyncIterator[object]:
    yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _register(_: object, server: grpc.aio.Server) -> None:
    kinds = {
        "GetGeneration": grpc.unary_unary_rpc_method_handler,
        "Generate": grpc.unary_stream_rpc_method_handler,
    }
    behaviors = {"GetGeneration": _ok, "Generate": _stream}
    handlers = {
        name: make(
            behaviors[name],
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        for name, make in kinds.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GEN, handlers),))


async def _never() -> AsyncIterator[bytes]:
    await asyncio.sleep(3600)
    yield b""


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def _outcome(channel: grpc.aio.Channel, method: str, requests: AsyncIterator[bytes]) -> tuple[str, str]:
    """Code and reason of `method` called with `requests` as its raw request stream (what an
    HTTP/2 peer can send to a unary method: headers, then any number of messages, or none)."""
    call = channel.stream_stream(method)(
        requests, timeout=5, metadata=(("authorization", "Bearer api-token-0123456789"),)
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        code, reason, _ = reason_of(err)
        return code, reason
    return "OK", ""


def test_a_call_whose_request_never_comes_is_ended_and_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security, "REQUEST_MESSAGE_TIMEOUT_S", 0.2, raising=False)

    async def body() -> None:
        server = GrpcServer("stub", "127.0.0.1", 0, [(_register, None, _GEN)], credentials=_CREDS)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stalled = [
                    _outcome(channel, f"/{_GEN}/{name}", requests())
                    for name in ("GetGeneration", "Generate")
                    for requests in (_never, _nothing)
                    for _ in range(3)
                ]
                outcomes = await asyncio.gather(*stalled)
                assert outcomes[:3] == [("DEADLINE_EXCEEDED", "REQUEST_MESSAGE_TIMEOUT")] * 3
                assert outcomes[3:6] == [("INVALID_ARGUMENT", "NO_REQUEST_MESSAGE")] * 3
                assert outcomes[6:9] == [("DEADLINE_EXCEEDED", "REQUEST_MESSAGE_TIMEOUT")] * 3
                assert outcomes[9:] == [("INVALID_ARGUMENT", "NO_REQUEST_MESSAGE")] * 3
                # The server holds no task of them.
                for _ in range(50):
                    if not _live_rpc_tasks():
                        break
                    await asyncio.sleep(0.02)
                assert not _live_rpc_tasks()
                # A caller that sends its message is served as before, on either kind of method,
                # and a bad credential is still refused once the message is there.
                one = health_pb2.HealthCheckRequest().SerializeToString()

                async def message() -> AsyncIterator[bytes]:
                    yield one

                assert await _outcome(channel, f"/{_GEN}/GetGeneration", message()) == ("OK", "")
                assert await _outcome(channel, f"/{_GEN}/Generate", message()) == ("OK", "")
                unary = channel.unary_unary(f"/{_GEN}/GetGeneration")
                api = (("authorization", "Bearer api-token-0123456789"),)
                serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
                assert await unary(one, timeout=5, metadata=api) == serving.SerializeToString()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await unary(one, timeout=5, metadata=(("authorization", "Bearer wrong"),))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0.1)

    asyncio.run(body())


def test_one_host_holds_a_bounded_number_of_calls_waiting_for_their_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(security, "MAX_WAITING_CALLS_PER_HOST", 2, raising=False)

    async def body() -> None:
        server = GrpcServer("stub", "127.0.0.1", 0, [(_register, None, _GEN)], credentials=_CREDS)
        await server.start()
        requests = server._requests
        assert requests is not None
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                held = [
                    asyncio.ensure_future(_outcome(channel, f"/{_GEN}/GetGeneration", _never()))
                    for _ in range(2)
                ]
                for _ in range(250):
                    if requests.waiting() == 2:
                        break
                    await asyncio.sleep(0.02)
                assert requests.waiting() == 2
                refused = await _outcome(channel, f"/{_GEN}/Generate", _never())
                assert refused == ("RESOURCE_EXHAUSTED", "TOO_MANY_WAITING_CALLS")
                for call in held:
                    call.cancel()
                await asyncio.gather(*held, return_exceptions=True)
                for _ in range(250):
                    if requests.waiting() == 0:
                        break
                    await asyncio.sleep(0.02)
                assert requests.waiting() == 0

                async def message() -> AsyncIterator[bytes]:
                    yield health_pb2.HealthCheckRequest().SerializeToString()

                assert await _outcome(channel, f"/{_GEN}/GetGeneration", message()) == ("OK", "")
        finally:
            await server.stop(0.1)

    asyncio.run(body())
