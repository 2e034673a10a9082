"""Hostile callers found black-box against a running `kvrelay up` node (bound replica tokens, api
token, security.rate_limit_per_second 50): each test replays one finding against real servers and
fails without its fix (docs/operations.md, Security)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvrelay.errors import reason_of
from kvrelay.security import (
    RPC_RULES,
    ChannelSecurity,
    Credentials,
    broker_call_token,
    make_channel,
    put_kv_token,
    replica_token_for,
)
from kvrelay.server import GrpcServer

SECRET = "the-brokers-secret-0123456789"
DIT0 = replica_token_for(SECRET, "dit-0")

# The methods a replica serves, each answered by a stub handler (the interceptor is what is tested).
_AR, _DIT = "kvrelay.v1.ArService", "kvrelay.v1.DitService"


async def _ok(request: health_pb2.HealthCheckRequest, context: object) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _add(service: str, methods: tuple[str, ...]):  # type: ignore[no-untyped-def]
    def add(_: object, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            _ok, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )  # fmt: skip
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, dict.fromkeys(methods, handler)),))

    return add


async def _outcomes(address: str, security: ChannelSecurity, method: str, calls: int) -> list[str]:
    """The code and reason of `calls` calls of `method` in a row ("OK" for a success)."""
    out = []
    async with make_channel(address, security) as channel:
        call = channel.unary_unary(method)
        request = health_pb2.HealthCheckRequest().SerializeToString()
        for _ in range(calls):
            try:
                await call(request, timeout=5)
                out.append("OK")
            except grpc.aio.AioRpcError as err:
                out.append("/".join(reason_of(err)[:2]))
    return out


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_a_replica_does_not_rate_limit_the_brokers_orchestration(mode: str) -> None:
    """The AR's and DiT's per-peer rate limit counted the broker's Tokenize, Prefill and Denoise:
    a public client sending ~250 Generate/s (prompts the AR refuses after Tokenize) ran the broker's
    bucket at the AR dry, and generations the broker had admitted and placed, other clients' too,
    failed RESOURCE_EXHAUSTED / RATE_LIMITED on Prefill (found black-box on a `kvrelay up` node with
    rate_limit_per_second 50). Public traffic is not rate-limited, so neither is what the broker
    calls for it; any other caller of a replica, and the broker on any other RPC, still is."""
    if mode == "bound":
        server_creds = Credentials(replica_token=DIT0, bound_replica_tokens=True,
                                   rate_limit_per_second=0.01, rate_limit_burst=2)  # fmt: skip
        broker = ChannelSecurity(token=broker_call_token(DIT0), replica_id="broker")
        writer = ChannelSecurity(token=put_kv_token(DIT0, "ar-0"), replica_id="ar-0")
    else:
        server_creds = Credentials(replica_token="shared", rate_limit_per_second=0.01, rate_limit_burst=2)
        broker = ChannelSecurity(token="shared", replica_id="broker")
        writer = ChannelSecurity(token="shared", replica_id="ar-0")

    async def body() -> None:
        server = GrpcServer(
            "replica", "127.0.0.1", 0,
            [(_add(_AR, ("Tokenize", "Prefill")), None, _AR), (_add(_DIT, ("Denoise", "PutKv")), None, _DIT)],
            credentials=server_creds, rules=RPC_RULES,
        )  # fmt: skip
        await server.start()
        try:
            for method in (f"/{_AR}/Tokenize", f"/{_AR}/Prefill", f"/{_DIT}/Denoise"):
                assert await _outcomes(server.address, broker, method, 6) == ["OK"] * 6, method
            # Another caller still has its bucket (2, then refused); on the broker's RPCs it is
            # refused for who it is once it is past the limit check.
            assert await _outcomes(server.address, writer, f"/{_AR}/Tokenize", 3) == [
                "PERMISSION_DENIED/PERMISSION_DENIED", "PERMISSION_DENIED/PERMISSION_DENIED",
                "RESOURCE_EXHAUSTED/RATE_LIMITED",
            ]  # fmt: skip
        finally:
            await server.stop(0.1)

    asyncio.run(body())


def test_the_broker_is_rate_limited_on_the_other_rpcs_of_a_replica() -> None:
    """Only the broker's own orchestration RPCs pass unlimited: the broker's credential on PutKv
    (an AR's RPC) is counted like any caller's."""
    server_creds = Credentials(replica_token="shared", rate_limit_per_second=0.01, rate_limit_burst=1)
    broker = ChannelSecurity(token="shared", replica_id="broker")

    async def body() -> None:
        server = GrpcServer("replica", "127.0.0.1", 0, [(_add(_DIT, ("PutKv",)), None, _DIT)],
                            credentials=server_creds, rules=RPC_RULES)  # fmt: skip
        await server.start()
        try:
            # PutKv is client-streaming in the real service; its rule and limit are the method's.
            outcomes = await _outcomes(server.address, broker, f"/{_DIT}/PutKv", 2)
            assert outcomes[1] == "RESOURCE_EXHAUSTED/RATE_LIMITED", outcomes
        finally:
            await server.stop(0.1)

    asyncio.run(body())
