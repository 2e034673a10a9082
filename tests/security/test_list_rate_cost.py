"""ListGenerations counts against its caller's rate-limit bucket by the page it asks for
(kvrelay.security.list_generations_cost): found black-box, a client flooding ListGenerations took
the broker's event loop (a health check took 4.9 s) while public RPCs were never rate-limited."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.errors import reason_of
from kvrelay.security import RPC_RULES, ChannelSecurity, Credentials, _RateLimiter, make_channel
from kvrelay.server import GrpcServer
from kvrelay.v1 import generation_pb2

_GENERATION = "kvrelay.v1.GenerationService"
LIST = f"/{_GENERATION}/ListGenerations"


async def _empty(
    request: generation_pb2.ListGenerationsRequest, context: object
) -> generation_pb2.ListGenerationsResponse:
    return generation_pb2.ListGenerationsResponse()


def _add_list(_: object, server: grpc.aio.Server) -> None:
    # A stub ListGenerations under the real rule: the interceptor's bucket is what is tested.
    handler = grpc.unary_unary_rpc_method_handler(
        _empty, request_deserializer=generation_pb2.ListGenerationsRequest.FromString,
        response_serializer=generation_pb2.ListGenerationsResponse.SerializeToString,
    )  # fmt: skip
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_GENERATION, {"ListGenerations": handler}),)
    )


def test_list_generations_counts_its_page_against_the_callers_bucket() -> None:
    """Burst 30: a default page (100) counts 11, so the third in a row is RATE_LIMITED and says
    what it counted; page_size 1 counts 1.1, so 27 pass on a full bucket and the 28th does not."""
    creds = Credentials(api_token="api", rate_limit_per_second=0.01, rate_limit_burst=30)

    async def outcomes(page_size: int, calls: int) -> tuple[list[str], str]:
        server = GrpcServer("broker", "127.0.0.1", 0, [(_add_list, None, _GENERATION)], credentials=creds,
                            rules=RPC_RULES)  # fmt: skip
        await server.start()
        out, message = [], ""
        try:
            async with make_channel(server.address, ChannelSecurity(token="api")) as channel:
                call = channel.unary_unary(LIST)
                request = generation_pb2.ListGenerationsRequest(page_size=page_size).SerializeToString()
                for _ in range(calls):
                    try:
                        await call(request, timeout=5)
                        out.append("OK")
                    except grpc.aio.AioRpcError as err:
                        out.append("/".join(reason_of(err)[:2]))
                        message = reason_of(err)[2]
        finally:
            await server.stop(0.1)
        return out, message

    default, message = asyncio.run(outcomes(0, 3))
    assert default == ["OK", "OK", "RESOURCE_EXHAUSTED/RATE_LIMITED"]
    assert "ListGenerations counts as 11" in message, message
    small, _ = asyncio.run(outcomes(1, 28))
    assert small == ["OK"] * 27 + ["RESOURCE_EXHAUSTED/RATE_LIMITED"]


def test_a_list_flood_does_not_spend_the_heartbeats_of_replicas_on_its_host() -> None:
    """A development deployment (and the shared replica token) has one bucket per host: the
    public caller's ListGenerations (each counting its page) must not run dry the bucket that
    the replicas on its host beat from."""
    from grpc_health.v1 import health_pb2

    from tests.security.stub_server import stub_methods
    from tests.security.test_rate_limit_identity import HEARTBEAT

    _add_heartbeat = stub_methods("kvrelay.v1.BrokerService", ("Heartbeat",))

    creds = Credentials(rate_limit_per_second=0.01, rate_limit_burst=30)
    list_request = generation_pb2.ListGenerationsRequest(page_size=1000).SerializeToString()
    beat_request = health_pb2.HealthCheckRequest().SerializeToString()

    async def body() -> list[str]:
        server = GrpcServer("broker", "127.0.0.1", 0, [(_add_list, None, _GENERATION),
                            (_add_heartbeat, None, "kvrelay.v1.BrokerService")], credentials=creds,
                            rules=RPC_RULES)  # fmt: skip
        await server.start()
        out = []
        try:
            async with make_channel(server.address, ChannelSecurity()) as channel:
                calls = [(channel.unary_unary(LIST), list_request)] * 2
                calls += [(channel.unary_unary(HEARTBEAT), beat_request)] * 3
                for call, request in calls:
                    try:
                        await call(request, timeout=5)
                        out.append("OK")
                    except grpc.aio.AioRpcError as err:
                        out.append("/".join(reason_of(err)[:2]))
        finally:
            await server.stop(0.1)
        return out

    assert asyncio.run(body()) == ["OK", "RESOURCE_EXHAUSTED/RATE_LIMITED", "OK", "OK", "OK"]


@pytest.mark.parametrize(
    ("burst", "cost", "expected"), [(30, 11.0, [True, True, False]), (5, 101.0, [True, False])]
)
def test_a_call_costlier_than_the_burst_still_passes_on_a_full_bucket(
    burst: int, cost: float, expected: list[bool]
) -> None:
    clock = [0.0]
    limiter = _RateLimiter(1.0, burst, clock=lambda: clock[0])
    assert [limiter.allow("k", cost) for _ in expected] == expected
    clock[0] += burst  # refilled
    assert limiter.allow("k", cost)
