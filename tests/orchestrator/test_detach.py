"""The detach rule of the real GenerationService (broker/generation.py) over real gRPC: a Generate
stream that ends early cancels its generation (CLIENT_DISCONNECTED) only once no stream follows
it and its `detach_timeout_seconds` passed without a re-attach; and the SDK's re-attach through a
cut connection continues the same generation (docs/client.md "Re-attaching")."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest

from kvrelay.client import AsyncKvRelayClient, GenerationState, KvRelayError, RetryPolicy
from kvrelay.v1 import generation_pb2
from tests.tcp_proxy import TcpProxy

from .harness import cluster, collect, error_info, request, run, wait_until
from .test_pipeline import read_until

S = generation_pb2
DENOISING = S.GENERATION_STATE_DENOISING
SUCCEEDED = S.GENERATION_STATE_SUCCEEDED


def test_a_reattach_within_the_detach_timeout_continues_the_generation() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            ask = request(request_id="d-1", seed=1, detach_timeout_seconds=30)
            call = c.api.Generate(ask, timeout=20)
            await read_until(call, DENOISING)
            call.cancel()  # the client goes away (a dropped connection looks the same)
            await asyncio.sleep(0.3)
            assert c.orchestrator.get("d-1").state.name == "DENOISING"
            again = c.api.Generate(ask, timeout=20)
            assert (await again.read()).state == DENOISING  # the current state first
            c.dit.step_gate.set()
            assert (await collect(again))[-1].state == SUCCEEDED
            assert c.ar.prefills == ["d-1"]  # re-attached, never resubmitted
            await c.wait_pool_free()

    run(body())


def test_without_a_reattach_the_generation_is_cancelled_when_the_detach_timeout_passes() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            ask = request(request_id="d-2", seed=2, detach_timeout_seconds=4.0)
            call = c.api.Generate(ask, timeout=20)
            await read_until(call, DENOISING)
            call.cancel()
            await asyncio.sleep(2.0)
            # A re-attach that ends early again restarts the wait from its own end.
            again = c.api.Generate(ask, timeout=20)
            assert (await again.read()).state == DENOISING
            again.cancel()
            dropped = time.monotonic()
            await asyncio.sleep(3.0)  # past the first stream's 4 s, within the second's (1 s margins)
            assert c.orchestrator.get("d-2").state.name == "DENOISING"
            await wait_until(lambda: c.orchestrator.get("d-2").state.terminal, timeout=10, what="cancel")
            assert time.monotonic() - dropped >= 4.0
            snap = c.orchestrator.get("d-2")
            assert snap.state.name == "CANCELLED" and snap.error is not None
            assert snap.error.reason == "CLIENT_DISCONNECTED" and "re-attached" in snap.error.message
            c.dit.step_gate.set()
            await c.wait_pool_free()

    run(body())


def test_a_stream_that_ends_while_another_follows_cancels_nothing() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            ask = request(request_id="d-3", seed=3)  # detach 0: at once, when the last one goes
            first = c.api.Generate(ask, timeout=20)
            await read_until(first, DENOISING)
            second = c.api.Generate(ask, timeout=20)
            assert (await second.read()).state == DENOISING
            first.cancel()
            await asyncio.sleep(0.3)
            assert c.orchestrator.get("d-3").state.name == "DENOISING"
            c.dit.step_gate.set()
            assert (await collect(second))[-1].state == SUCCEEDED

    run(body())


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, 3601.0])
def test_a_detach_timeout_out_of_bounds_is_invalid_argument(value: float) -> None:
    async def body() -> None:
        async with cluster() as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(c.api.Generate(request(detach_timeout_seconds=value), timeout=10))
            code, _, metadata = error_info(info.value)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and metadata["field"] == "detach_timeout_seconds"

    run(body())


def test_the_sdk_reattaches_through_a_cut_connection_and_the_generation_goes_on() -> None:
    policy = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, reattach_seconds=10)

    async def body() -> None:
        async with cluster() as c:
            host, port = c.target.rsplit(":", 1)
            proxy = await TcpProxy(host, int(port)).start()
            try:
                c.dit.step_gate.clear()

                async def open_gate_after_the_reconnect() -> None:
                    await wait_until(lambda: proxy.connections >= 2, what="a new connection")
                    c.dit.step_gate.set()

                async with AsyncKvRelayClient(proxy.address, retry=policy) as client:
                    handle = await client.generate("a fox", seed=4, width=64, height=64, request_id="cut")
                    states = []
                    opener = None
                    async for event in handle.events():
                        states.append(event.state)
                        if event.state is GenerationState.DENOISING and opener is None:
                            assert proxy.cut() > 0  # the network fails mid-stream
                            opener = asyncio.create_task(open_gate_after_the_reconnect())
                    result = await handle.result()
                    assert opener is not None
                    await opener
                assert result.request_id == "cut" and states[-1] is GenerationState.SUCCEEDED
                assert proxy.connections >= 2  # cut while the steps were held, then re-attached
                assert c.ar.prefills == ["cut"]

                # Without a request_id nothing can re-attach: the broker cancels at once.
                c.dit.step_gate.clear()
                async with AsyncKvRelayClient(proxy.address, retry=policy) as client:
                    handle = await client.generate("a hare", seed=5, width=64, height=64)
                    with pytest.raises(KvRelayError) as info:
                        async for event in handle.events():
                            if event.state is GenerationState.DENOISING:
                                proxy.cut()
                    assert info.value.code == "UNAVAILABLE"
                    request_id = handle.request_id
                    assert request_id
                await wait_until(lambda: c.orchestrator.get(request_id).state.terminal, what="cancel")
                snap = c.orchestrator.get(request_id)
                assert snap.error is not None and snap.error.reason == "CLIENT_DISCONNECTED"
                c.dit.step_gate.set()
                await c.wait_pool_free()
            finally:
                await proxy.stop()

    run(body())
