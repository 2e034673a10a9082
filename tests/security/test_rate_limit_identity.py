"""Rate limits per verified identity (kvrelay.security.AuthInterceptor._rate_limit): found black-box
on a `kvrelay up` node (bound replica tokens, security.rate_limit_per_second 50), an AR's Heartbeat
failed RESOURCE_EXHAUSTED / RATE_LIMITED under normal load: the bucket was per peer address, and
the replicas on its host had used it. A replica whose own token (or certificate) proves its id has
a bucket of its own; a credential that names nobody (the shared replica token) keeps the host's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.errors import reason_of
from kvrelay.security import (
    AuthInterceptor,
    ChannelSecurity,
    Credentials,
    TlsMaterial,
    _RateLimiter,
    make_channel,
    replica_token_for,
)
from tests.security.stub_server import outcomes, stub_server

SECRET = "the-brokers-secret-0123456789"
_BROKER = "kvrelay.v1.BrokerService"
HEARTBEAT = f"/{_BROKER}/Heartbeat"


LIMITED = "RESOURCE_EXHAUSTED/RATE_LIMITED"


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_replicas_of_one_host_have_a_bucket_each_when_their_token_proves_the_id(mode: str) -> None:
    """Bound tokens: ar-1 (same host, 127.0.0.1) running its bucket dry leaves ar-0's Heartbeat
    alone (before: RATE_LIMITED, one bucket per address). Shared token: any holder may declare any
    id, so the id proves nothing and the host's bucket stays shared: declaring another id does not
    buy another bucket."""
    if mode == "bound":
        server_creds = Credentials(bound_replica_tokens=True, replica_secret=SECRET,
                                   rate_limit_per_second=0.01, rate_limit_burst=2)  # fmt: skip

        def replica(rid: str) -> ChannelSecurity:
            return ChannelSecurity(token=replica_token_for(SECRET, rid), replica_id=rid)
    else:
        server_creds = Credentials(replica_token="shared", rate_limit_per_second=0.01, rate_limit_burst=2)

        def replica(rid: str) -> ChannelSecurity:
            return ChannelSecurity(token="shared", replica_id=rid)

    async def body() -> None:
        # A stub Heartbeat under the real rule (replica; the interceptor is what is tested, and no
        # ownership check is registered for it here).
        async with stub_server(server_creds, {_BROKER: ("Heartbeat",)}, name="broker") as address:
            assert await outcomes(address, replica("ar-1"), HEARTBEAT, 3) == ["OK", "OK", LIMITED]
            second = await outcomes(address, replica("ar-0"), HEARTBEAT, 1)
            assert second == (["OK"] if mode == "bound" else [LIMITED])

    asyncio.run(body())


def test_a_rate_limited_caller_is_told_whose_bucket_ran_dry() -> None:
    server_creds = Credentials(bound_replica_tokens=True, replica_secret=SECRET,
                               rate_limit_per_second=0.01, rate_limit_burst=1)  # fmt: skip

    async def body() -> str:
        async with stub_server(server_creds, {_BROKER: ("Heartbeat",)}, name="broker") as address:
            sec = ChannelSecurity(token=replica_token_for(SECRET, "dit-3"), replica_id="dit-3")
            async with make_channel(address, sec) as channel:
                call = channel.unary_unary(HEARTBEAT)
                await call(b"", timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"", timeout=5)
                return reason_of(err.value)[2]

    message = asyncio.run(body())
    assert "replica dit-3" in message and "security.rate_limit_per_second" in message, message


def test_only_verified_credentials_name_an_identity() -> None:
    """Identities come from what a server verified: a bound token (for the id it was derived for),
    a certificate's common name, the operator token. The shared replica token and the api token
    are everyone's: no identity (the peer's address is the key)."""
    bound = AuthInterceptor(
        Credentials(bound_replica_tokens=True, replica_secret=SECRET, operator_token="op")
    )

    def ident(auth: AuthInterceptor, token: str, declared: str | None = None, cn: str | None = None) -> str:
        md = [("authorization", f"Bearer {token}")] + ([("kvrelay-replica-id", declared)] if declared else [])
        ctx = {"x509_common_name": [cn.encode()]} if cn else {}
        return auth.authenticate(md, ctx).identity

    assert ident(bound, replica_token_for(SECRET, "ar-0"), "ar-0") == "replica:ar-0"
    # ar-0's token declaring another id is no credential at all: nothing to mint.
    assert ident(bound, replica_token_for(SECRET, "ar-0"), "ar-9") == ""
    assert ident(bound, "op") == "operator"
    shared = AuthInterceptor(Credentials(replica_token="shared", api_token="api"))
    assert ident(shared, "shared", "ar-0") == ""
    assert ident(shared, "api") == ""
    tls = TlsMaterial(cert_chain=b"", private_key=b"", root_certificates=b"", require_client_cert=True)
    mtls = AuthInterceptor(Credentials(api_token="api", tls=tls))
    assert ident(mtls, "", cn="ar-2") == "replica:ar-2"
    assert ident(mtls, "", cn="kvrelay-node", declared="ar-2") == ""  # a node certificate binds no id
    assert ident(mtls, "", cn="alice") == "client:alice"
    assert ident(mtls, "", cn="kvrelay-operator") == "operator:kvrelay-operator"
    # Development deployment: everyone trusted, nobody identified.
    assert ident(AuthInterceptor(Credentials()), "", "ar-0") == ""


def test_the_buckets_are_bounded_and_new_keys_past_the_bound_share_one() -> None:
    """At most max_buckets keys: a refilled (idle) bucket is dropped for a new key; when every
    bucket is busy, new keys share one overflow bucket, and nobody's bucket is reset (before:
    past 10000 keys every bucket was cleared, so enough new keys refilled everyone's)."""
    now = [0.0]
    limiter = _RateLimiter(rate=1.0, burst=2, clock=lambda: now[0], max_buckets=2)
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    assert [limiter.allow("b") for _ in range(3)] == [True, True, False]
    # Table full of busy buckets: c and d share the overflow bucket.
    assert [limiter.allow("c"), limiter.allow("d"), limiter.allow("c")] == [True, True, False]
    assert limiter.allow("a") is False and limiter.allow("b") is False  # nobody was reset
    assert len(limiter) == 2
    now[0] = 3.0  # a and b refilled: as good as no bucket, dropped for the next new key
    assert limiter.allow("c") is True
    assert len(limiter) == 1 and limiter.allow("c") is True and limiter.allow("c") is False
