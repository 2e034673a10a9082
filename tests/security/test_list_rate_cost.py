"""ListGenerations counts against its caller's rate-limit bucket by the page it asks for
(kvrelay.security.list_generations_cost): found black-box, a client flooding ListGenerations took
the broker's event loop (a health check took 4.9 s) while public RPCs were never rate-limited."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvrelay.errors import reason_of
from kvrelay.limits import LIST_REPLY_BYTES_PER_REQUEST
from kvrelay.security import (
    RPC_RULES,
    ChannelSecurity,
    Credentials,
    _RateLimiter,
    list_generations_reply_cost,
    make_channel,
)
from kvrelay.server import GrpcServer
from kvrelay.v1 import generation_pb2

_GENERATION = "kvrelay.v1.GenerationService"
LIST = f"/{_GENERATION}/ListGenerations"


async def _empty(
    request: generation_pb2.ListGenerationsRequest, context: object
) -> generation_pb2.ListGenerationsResponse:
    return generation_pb2.ListGenerationsResponse()


def _add_list(_: object, server: grpc.aio.Server, answer: object = _empty) -> None:
    # A stub ListGenerations under the real rule: the interceptor's bucket is what is tested.
    handler = grpc.unary_unary_rpc_method_handler(
        answer, request_deserializer=generation_pb2.ListGenerationsRequest.FromString,
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


def test_a_charge_after_the_fact_runs_the_bucket_into_debt_and_the_refusal_names_the_wait() -> None:
    clock = [0.0]
    limiter = _RateLimiter(10.0, 100, clock=lambda: clock[0])
    assert limiter.take("k", 11) == 0.0
    limiter.charge("k", 189)  # 100 - 11 - 189: 100 in debt
    assert limiter.take("k", 11) == pytest.approx(11.1)  # (11 - -100) / 10 tokens a second
    clock[0] += 11.0
    assert limiter.take("k", 11) == pytest.approx(0.1)
    clock[0] += 0.2
    assert limiter.take("k", 11) == 0.0
    limiter.charge("k", 10_000)  # debt stops at the burst below zero: refused at most 2 x burst / rate
    assert limiter.take("k", 1) == pytest.approx(10.1)
    limiter.charge("other", 0)  # nothing charged, no bucket made
    assert len(limiter) == 1


def _sized_reply(prompt_bytes: int) -> generation_pb2.ListGenerationsResponse:
    generation = generation_pb2.Generation(
        request_id="r", params=generation_pb2.GenerationParams(prompt="p" * prompt_bytes)
    )
    return generation_pb2.ListGenerationsResponse(generations=[generation])


def test_list_generations_counts_its_reply_bytes_then_refuses_with_retry_info() -> None:
    """Burst 300 (almost no refill): a default page counts 11 up front, and its reply of ~256 KiB
    (an operator's page of retained prompts) 64 more after it; so 3 pass (300 - 3 x 75 = 75 left)
    and the 4th too (75 >= 11), leaving 0 (debt); the 5th is RESOURCE_EXHAUSTED RATE_LIMITED with
    google.rpc.RetryInfo and ErrorInfo's retry_after_ms: the time the bucket takes to hold 11.
    Before (the page alone counted) 27 such calls passed in a row."""
    reply = _sized_reply(256 * 1024 - 30)
    charge = list_generations_reply_cost(reply)
    assert charge == reply.ByteSize() / LIST_REPLY_BYTES_PER_REQUEST and 63.9 < charge <= 64.0
    rate = 0.01
    creds = Credentials(api_token="api", rate_limit_per_second=rate, rate_limit_burst=300)

    async def answer(request: object, context: object) -> generation_pb2.ListGenerationsResponse:
        return reply

    async def body() -> tuple[list[str], grpc.aio.AioRpcError]:
        add = lambda _, server: _add_list(_, server, answer)  # noqa: E731
        server = GrpcServer("broker", "127.0.0.1", 0, [(add, None, _GENERATION)], credentials=creds,
                            rules=RPC_RULES)  # fmt: skip
        await server.start()
        out: list[str] = []
        refusal = None
        try:
            async with make_channel(server.address, ChannelSecurity(token="api")) as channel:
                call = channel.unary_unary(LIST)
                for _ in range(5):
                    try:
                        await call(generation_pb2.ListGenerationsRequest().SerializeToString(), timeout=5)
                        out.append("OK")
                    except grpc.aio.AioRpcError as err:
                        out.append("/".join(reason_of(err)[:2]))
                        refusal = err
        finally:
            await server.stop(0.1)
        assert refusal is not None
        return out, refusal

    outcomes, refusal = asyncio.run(body())
    assert outcomes == ["OK"] * 4 + ["RESOURCE_EXHAUSTED/RATE_LIMITED"]
    # 4 x (11 + charge) taken from 300: the bucket holds 300 - 4 x 11 - 4 x charge (< 0: debt).
    owed = 11 - (300 - 4 * (11 + charge))
    status = rpc_status.from_call(refusal)
    assert status is not None
    infos = {d.type_url.rsplit("/", 1)[-1]: d for d in status.details}
    retry, error = error_details_pb2.RetryInfo(), error_details_pb2.ErrorInfo()
    infos["google.rpc.RetryInfo"].Unpack(retry)
    infos["google.rpc.ErrorInfo"].Unpack(error)
    delay = retry.retry_delay.ToNanoseconds() / 1e9
    # The test's own seconds refill a few hundredths of a token: within 1 s of owed / rate.
    assert owed / rate - 1.0 < delay <= owed / rate + 0.001, (delay, owed / rate)
    assert int(error.metadata["retry_after_ms"]) == round(delay * 1000)
    assert f"retry in {delay:.3f} s" in refusal.details()
    assert "ListGenerations counts as 11 and its reply's bytes after it" in refusal.details()
