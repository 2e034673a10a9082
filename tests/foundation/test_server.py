"""The shared gRPC server over a real socket: health Check and Watch, reflection v1 and v1alpha,
and a request that cannot be decoded answered INVALID_ARGUMENT without reaching the handler."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from kvrelay import security
from kvrelay.errors import reason_of
from kvrelay.security import RPC_RULES, CallerClass, RpcRule
from kvrelay.server import GrpcServer

ECHO = "test.Echo"
GARBAGE = b"\xff\xff\xff\xff"  # an invalid tag: no protobuf message decodes it


class _Echo:
    """Tiny service over health messages: unary, server-stream and client-stream calls."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def Unary(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        self.seen.append(request.service)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Count(self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: Any) -> health_pb2.HealthCheckResponse:
        async for request in requests:
            self.seen.append(request.service)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _add_echo(servicer: _Echo, server: grpc.aio.Server) -> None:
    req, resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(
            servicer.Unary, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        ),
        "Count": grpc.stream_unary_rpc_method_handler(
            servicer.Count, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO, handlers),))


async def _serve() -> tuple[GrpcServer, _Echo]:
    echo = _Echo()
    # test.Echo is public here: kvrelay's servers refuse an RPC without a caller class.
    rules = {**RPC_RULES, **{f"/{ECHO}/{m}": RpcRule(CallerClass.PUBLIC, True, "none") for m in ("Unary", "Count")}}
    server = GrpcServer("test", "127.0.0.1", 0, [(_add_echo, echo, ECHO)], rules=rules)
    await server.start()
    return server, echo


def test_health_watch_streams_status_changes() -> None:
    async def body() -> None:
        server, _ = await _serve()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                call = stub.Watch(health_pb2.HealthCheckRequest(service=ECHO), timeout=10)
                first = await call.read()
                assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
                await server.set_serving(True)
                second = await call.read()
                assert second.status == health_pb2.HealthCheckResponse.SERVING
                call.cancel()
                checked = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert checked.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0.5)

    asyncio.run(body())


def test_undecodable_requests_are_invalid_argument_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        server, echo = await _serve()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                unary = channel.unary_unary(f"/{ECHO}/Unary")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unary(GARBAGE, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await check(GARBAGE, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                stream = channel.stream_unary(f"/{ECHO}/Count")
                good = health_pb2.HealthCheckRequest(service="a").SerializeToString()

                async def requests() -> AsyncIterator[bytes]:
                    yield good
                    yield GARBAGE
                    yield good

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream(requests(), timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                # The good ones still work, and the handler never saw a malformed message.
                reply = await unary(health_pb2.HealthCheckRequest(service="b").SerializeToString(), timeout=5)
                assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING
                assert echo.seen == ["a", "b"]
        finally:
            await server.stop(0.5)

    with caplog.at_level(logging.INFO), structlog.testing.capture_logs() as events:
        asyncio.run(body())
    malformed = [e for e in events if e["event"] == "malformed_request"]
    assert [e["method"] for e in malformed] == [f"/{ECHO}/Unary", "/grpc.health.v1.Health/Check", f"/{ECHO}/Count"]
    # grpc's own "Unexpected error ... raised by servicer method" traceback is gone.
    assert not any(r.exc_info for r in caplog.records)
    assert not any("Traceback" in r.getMessage() for r in caplog.records)


def test_a_flood_of_undecodable_requests_is_one_line_per_method() -> None:
    """A request that does not decode is answered before its credential is checked: one warning
    line each let any peer fill the log (found black-box: 3000 junk Heartbeat requests from an
    anonymous peer wrote 1997 `malformed_request` lines to the broker's log in 3 s). Every one is
    still answered INVALID_ARGUMENT; one line per method per window is written."""

    async def body() -> None:
        server, echo = await _serve()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                unary = channel.unary_unary(f"/{ECHO}/Unary")
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                for call in [unary] * 40 + [check] * 3:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(GARBAGE, timeout=5)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                reply = await unary(health_pb2.HealthCheckRequest(service="b").SerializeToString(), timeout=5)
                assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING
                assert echo.seen == ["b"]
        finally:
            await server.stop(0.5)

    with structlog.testing.capture_logs() as events:
        asyncio.run(body())
    malformed = [(e["method"], e["suppressed"]) for e in events if e["event"] == "malformed_request"]
    assert malformed == [(f"/{ECHO}/Unary", 0), ("/grpc.health.v1.Health/Check", 0)]


def test_the_line_after_a_quiet_window_counts_those_left_out() -> None:
    from kvrelay.logging import MALFORMED_LOG_WINDOW_S, _MalformedLog

    now = [100.0]
    log = _MalformedLog(clock=lambda: now[0])
    assert log.admit("/a/B") == 0
    assert [log.admit("/a/B") for _ in range(5)] == [None] * 5
    assert log.admit("/a/C") == 0  # each method has its own window
    now[0] += MALFORMED_LOG_WINDOW_S
    assert log.admit("/a/B") == 5
    assert log.admit("/a/B") is None


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha(version: str) -> None:
    async def body() -> None:
        server, _ = await _serve()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = channel.stream_stream(
                    f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol=f"grpc.reflection.{version}.ServerReflection"
                    ),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"),
                ]
                replies = [r async for r in call(iter(requests), timeout=10)]
                listed = {s.name for s in replies[0].list_services_response.service}
                assert {ECHO, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"} <= listed  # fmt: skip
                for reply in replies[1:]:
                    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
        finally:
            await server.stop(0.5)

    asyncio.run(body())


def test_every_rpc_is_counted_and_timed_with_its_code() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()

    async def body() -> None:
        echo = _Echo()
        server = GrpcServer("test", "127.0.0.1", 0, [(_add_echo, echo, ECHO)], metrics_registry=registry)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)  # NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary(f"/{ECHO}/Unary")(GARBAGE, timeout=5)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
                await watch.read()
                watch.cancel()
                await asyncio.sleep(0.2)
        finally:
            await server.stop(0.5)

    asyncio.run(body())

    def handled(service: str, method: str, code: str) -> float | None:
        return registry.get_sample_value(
            "kvrelay_grpc_server_handled_total",
            {"grpc_service": service, "grpc_method": method, "grpc_code": code},
        )

    assert handled("grpc.health.v1.Health", "Check", "OK") == 1
    assert handled("grpc.health.v1.Health", "Check", "NOT_FOUND") == 1
    assert handled(ECHO, "Unary", "INVALID_ARGUMENT") == 1
    assert handled("grpc.health.v1.Health", "Watch", "CANCELLED") == 1
    count = registry.get_sample_value(
        "kvrelay_grpc_server_handling_seconds_count", {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
    )
    assert count == 2
    assert registry.get_sample_value("process_cpu_seconds_total") is not None


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (its SETTINGS and GOAWAY read first)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return False


def test_silent_connections_are_closed_and_their_number_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found black-box: ~20000 TCP connections that never sent a byte (no HTTP/2 preface) held
    # the broker's every file descriptor for gRPC's default 120 s handshake timeout; every new
    # client got DEADLINE_EXCEEDED, and the attacker needs no credential.
    monkeypatch.setattr(security, "SERVER_HANDSHAKE_TIMEOUT_MS", 2500)
    cap = security.MIN_INCOMING_CONNECTIONS
    monkeypatch.setattr(security, "_open_files_limit", lambda: security.RESERVED_FDS + cap)
    assert security.max_incoming_connections() == cap

    async def body() -> None:
        server, _ = await _serve()
        host, port = server.address.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port))) for _ in range(cap + 4)]
        try:
            # Beyond the bound: closed at once, well before the handshake timeout (the process
            # keeps descriptors of its own).
            assert await asyncio.to_thread(lambda: all(_closed_by_peer(s, 1.0) for s in socks[cap:]))
            # Within it: closed once the handshake timeout passes without a preface.
            assert await asyncio.to_thread(lambda: all(_closed_by_peer(s, 5.0) for s in socks[:cap]))
            async with grpc.aio.insecure_channel(server.address) as channel:
                checked = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert checked.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            for s in socks:
                s.close()
            await server.stop(0.5)

    asyncio.run(body())


def test_streams_of_the_open_rpcs_are_bounded_and_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found black-box: health Watch needs no credential, and 10000 Watch streams from one anonymous
    # peer grew the broker by 256 MB (about 25 KB each), with no bound but the peer's patience.
    monkeypatch.setattr(security, "MAX_OPEN_STREAMS", 8)

    async def body() -> None:
        server, _ = await _serve()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watches = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10) for _ in range(8)]
                for watch in watches:
                    await watch.read()
                refused = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await refused.read()
                assert reason_of(err.value)[:2] == ("RESOURCE_EXHAUSTED", "TOO_MANY_STREAMS")
                # Health/Check (unary) is never refused, and a cancelled stream frees its slot.
                checked = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert checked.status == health_pb2.HealthCheckResponse.NOT_SERVING
                for watch in watches[:2]:
                    watch.cancel()
                await asyncio.sleep(0.3)
                again = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert (await again.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                again.cancel()
                for watch in watches[2:]:
                    watch.cancel()
        finally:
            await server.stop(0.5)

    asyncio.run(body())
