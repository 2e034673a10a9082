"""HTTP/2 keepalive on every kvrelay channel and listener (kvrelay.security.Keepalive, the SDK's
own channel options): the config keys reach every channel, a long idle stream is pinged (and is
never sent GOAWAY too_many_pings by our own listeners), and a connection that stops answering
ends its calls UNAVAILABLE within the keepalive bound instead of at their deadlines."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.client import AsyncKvRelayClient
from kvrelay.client._common import channel_options as sdk_channel_options
from kvrelay.config import ConfigError, KvRelayConfig, parse_config
from kvrelay.security import (
    DEFAULT_KEEPALIVE,
    CallerClass,
    ChannelSecurity,
    Credentials,
    Keepalive,
    channel_options,
    load_credentials,
    make_channel,
    server_options,
)
from kvrelay.server import GRPC_OPTIONS, GrpcServer
from tests.orchestrator.harness import cluster, run
from tests.tcp_proxy import TcpProxy

# gRPC sends at most one ping a second while no data flows: shorter times act as 1 s.
FAST = Keepalive(time_s=1.0, timeout_s=0.5)
# Idle long enough for a listener with gRPC's defaults to strike our pings out (3 strikes).
IDLE_S = 5.5


def _config(**security: object) -> KvRelayConfig:
    data = yaml.safe_load((Path(__file__).parents[1] / "configs" / "test-fast.yaml").read_text())
    data["security"] = security
    return parse_config(data, "<test>")


def test_config_keys_reach_every_channel_listener_and_sdk_client() -> None:
    creds = load_credentials(_config(keepalive_time_seconds=3, keepalive_timeout_seconds=2).security)
    assert creds.keepalive == Keepalive(3.0, 2.0)
    for caller in CallerClass:
        assert creds.channel(caller).keepalive == creds.keepalive
    opts = dict(channel_options(keepalive=creds.keepalive))
    assert opts["grpc.keepalive_time_ms"] == 3000 and opts["grpc.keepalive_timeout_ms"] == 2000
    # gRPC forgets the keepalive timeout once any byte arrives; the ping timeout is what holds.
    assert opts["grpc.http2.ping_timeout_ms"] == 2000
    assert opts["grpc.http2.max_pings_without_data"] == 0
    served = dict(server_options(creds))
    assert served["grpc.keepalive_time_ms"] == 3000
    # Our listeners accept our clients' pings (with margin), and the SDK's at its default.
    assert served["grpc.http2.min_ping_interval_without_data_ms"] == 1500
    assert served["grpc.keepalive_permit_without_calls"] == 1
    assert dict(server_options(Credentials()))["grpc.http2.min_ping_interval_without_data_ms"] <= 5000
    sdk = dict(sdk_channel_options(**{k: v for k, v in creds.client_options().items() if k.startswith("keepalive")}))
    assert sdk["grpc.keepalive_time_ms"] == 3000 and sdk["grpc.http2.ping_timeout_ms"] == 2000
    assert "grpc.keepalive_time_ms" not in dict(sdk_channel_options(keepalive_time=None))
    assert load_credentials(_config().security).keepalive == DEFAULT_KEEPALIVE
    with pytest.raises(ConfigError, match="keepalive_time_seconds"):
        _config(keepalive_time_seconds=0)


async def _health_server(keepalive: Keepalive) -> GrpcServer:
    server = GrpcServer(name="ka", host="127.0.0.1", port=0, registrations=[],
                        credentials=Credentials(keepalive=keepalive))
    await server.start()
    await server.set_serving(True)
    return server


def test_an_idle_stream_is_pinged_not_cut_and_a_silent_peer_ends_it() -> None:
    """A health Watch idle for ~5 ping intervals: never sent GOAWAY too_many_pings (our
    listeners permit our clients' pings; gRPC's defaults allow one every 5 minutes) and still
    pinged (gRPC's default stops after two pings without data), so a one-way cut after the idle
    spell ends it within the bound."""

    async def body() -> None:
        server = await _health_server(FAST)
        proxy = await TcpProxy("127.0.0.1", server.bound_port).start()
        channel = make_channel(proxy.address, ChannelSecurity(keepalive=FAST))
        try:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            pending = asyncio.ensure_future(watch.read())
            await asyncio.sleep(IDLE_S)
            assert not pending.done(), pending.exception() if pending.done() else None
            assert proxy.connections == 1
            proxy.blackhole("to_target")
            cut_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pending
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert time.monotonic() - cut_at < FAST.detect_within_s + 2.0
        finally:
            await channel.close()
            await proxy.stop()
            await server.stop(grace=0)

    run(body())


def test_an_sdk_status_stream_idle_over_many_pings_is_not_cut() -> None:
    """The SDK's Generate stream waits at DENOISING 0/n for ~5 of its ping intervals against a
    broker whose keepalive settings permit them; the generation then succeeds on that stream."""
    sdk_time = 1.0
    keepalive = Keepalive(sdk_time, 1.0)

    async def body() -> None:
        # The DiT's listener as the real one's (the broker's Denoise call idles there as long).
        dit_options = [*GRPC_OPTIONS, *keepalive.server_options()]
        async with cluster(credentials=Credentials(keepalive=keepalive), dit_server_options=dit_options) as c:
            c.dit.step_gate.clear()
            async with AsyncKvRelayClient(c.target, keepalive_time=sdk_time, keepalive_timeout=1.0) as client:
                handle = await client.generate("a quiet lake", seed=2, width=64, height=64, timeout=30)
                result = asyncio.ensure_future(handle.result())
                await c.dit.loaded.wait()
                await asyncio.sleep(IDLE_S)
                assert not result.done(), result.exception() if result.done() else None
                c.dit.step_gate.set()
                assert (await result).png

    run(body())
