"""A client's share of the broker's queue (broker.max_queue_per_client): found black-box, one api
client filled broker.max_queue with generations it detached from (they wait on, counted, with
nobody reading them) and every other client got RESOURCE_EXHAUSTED / QUEUE_FULL. A client is its
verified identity, else its peer address (the api token is one for all clients): the second
client here dials from 127.0.0.2 through a proxy, another host as the broker sees it."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.server import GRPC_OPTIONS
from kvrelay.v1 import generation_pb2, generation_pb2_grpc
from tests.tcp_proxy import TcpProxy

from .harness import cluster, collect, error_info, request, run

QUEUED = generation_pb2.GENERATION_STATE_QUEUED


async def _queued(api: generation_pb2_grpc.GenerationServiceStub, request_id: str) -> None:
    """Submit, see it QUEUED, then drop the stream: the generation stays, detached (30 s)."""
    call = api.Generate(request(request_id=request_id, seed=1, detach_timeout_seconds=30), timeout=20)
    assert (await call.read()).state == QUEUED
    call.cancel()


async def _refused(api: generation_pb2_grpc.GenerationServiceStub, request_id: str) -> tuple[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(api.Generate(request(request_id=request_id, seed=1), timeout=5))
    code, reason, _ = error_info(exc.value)
    return code.name, reason


@pytest.mark.parametrize("share", [None, 2])
def test_one_client_cannot_take_the_whole_queue(share: int | None) -> None:
    """max_queue 4: by default a client holds at most 3 (three quarters); set, 2. One over is
    CLIENT_QUEUE_FULL for that client alone, and another client still gets in (before: the first
    client's every generation was queued and the other's was QUEUE_FULL)."""
    held = 3 if share is None else share
    extra = {} if share is None else {"max_queue_per_client": share}

    async def body() -> None:
        async with cluster(num_pages=3, max_queue=4, **extra) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await c.ar.prefill_started.wait()  # holds the pages: everything after it waits
            for i in range(held):
                await _queued(c.api, f"a{i}")
            assert await _refused(c.api, "a-over") == ("RESOURCE_EXHAUSTED", "CLIENT_QUEUE_FULL")
            assert c.orchestrator.queue_depth() == held
            host, port = c.target.rsplit(":", 1)
            proxy = await TcpProxy(host, int(port), source_host="127.0.0.2").start()
            other = grpc.aio.insecure_channel(proxy.address, options=GRPC_OPTIONS)
            try:
                api = generation_pb2_grpc.GenerationServiceStub(other)
                for i in range(4 - held):
                    await _queued(api, f"b{i}")
                assert c.orchestrator.queue_depth() == 4
                # The queue itself is full now: QUEUE_FULL, as before the share existed.
                assert await _refused(api, "b-over") == ("RESOURCE_EXHAUSTED", "QUEUE_FULL")
            finally:
                await other.close()
                await proxy.stop()
            c.ar.prefill_gate.set()
            running.cancel()

    run(body())
