"""Hostile callers found black-box against a running `kvrelay up` node (bound replica tokens, api
token, security.rate_limit_per_second 50): each test replays one finding against real servers and
fails without its fix (docs/operations.md, Security)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.security import (
    ChannelSecurity,
    Credentials,
    broker_call_token,
    put_kv_token,
    replica_token_for,
)
from tests.security.stub_server import outcomes, stub_server

SECRET = "the-brokers-secret-0123456789"
DIT0 = replica_token_for(SECRET, "dit-0")

# The services of a replica, their methods answered by stubs (the interceptor is what is tested).
_AR, _DIT = "kvrelay.v1.ArService", "kvrelay.v1.DitService"


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
        stubs = {_AR: ("Tokenize", "Prefill"), _DIT: ("Denoise", "PutKv")}
        async with stub_server(server_creds, stubs, name="replica") as address:
            for method in (f"/{_AR}/Tokenize", f"/{_AR}/Prefill", f"/{_DIT}/Denoise"):
                assert await outcomes(address, broker, method, 6) == ["OK"] * 6, method
            # Another caller still has its bucket (2, then refused); on the broker's RPCs it is
            # refused for who it is once it is past the limit check.
            assert await outcomes(address, writer, f"/{_AR}/Tokenize", 3) == [
                "PERMISSION_DENIED/PERMISSION_DENIED", "PERMISSION_DENIED/PERMISSION_DENIED",
                "RESOURCE_EXHAUSTED/RATE_LIMITED",
            ]  # fmt: skip

    asyncio.run(body())


def test_the_broker_is_rate_limited_on_the_other_rpcs_of_a_replica() -> None:
    """Only the broker's own orchestration RPCs pass unlimited: the broker's credential on PutKv
    (an AR's RPC) is counted like any caller's."""
    server_creds = Credentials(replica_token="shared", rate_limit_per_second=0.01, rate_limit_burst=1)
    broker = ChannelSecurity(token="shared", replica_id="broker")

    async def body() -> None:
        async with stub_server(server_creds, {_DIT: ("PutKv",)}, name="replica") as address:
            # PutKv is client-streaming in the real service; its rule and limit are the method's.
            got = await outcomes(address, broker, f"/{_DIT}/PutKv", 2)
            assert got[1] == "RESOURCE_EXHAUSTED/RATE_LIMITED", got

    asyncio.run(body())
