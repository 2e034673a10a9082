"""A replica the broker cannot connect to (its process killed, its host cut off) while its lease
still runs: found in a black-box run with DiT replicas in network namespaces, where a `kill -9`
of one DiT host sent it 91 of the next 150 requests (each failed in milliseconds, so the
least-loaded placement kept choosing it until the lease lapsed), and where the same DiT,
restarted at its address, got no call for a minute: the broker's channel to it waited out
gRPC's reconnect backoff and failed every call at once.

The broker now drops the channel after a call that never reached the replica and keeps the
replica out of placement until its next heartbeat (docs/broker.md, "Unreachable replicas")."""

from __future__ import annotations

import asyncio

import grpc

from kvrelay.broker.placement import choose_dit_replica
from kvrelay.server import GRPC_OPTIONS
from kvrelay.v1 import dit_pb2_grpc, generation_pb2
from tests.orchestrator.harness import cluster, collect, request, run, wait_until

SUCCEEDED = generation_pb2.GENERATION_STATE_SUCCEEDED
FAILED = generation_pb2.GENERATION_STATE_FAILED


def test_a_dead_dit_leaves_placement_at_once_and_is_reached_again_at_its_address() -> None:
    async def body() -> None:
        async with cluster() as c:
            events = await collect(c.api.Generate(request("warm up"), timeout=10))
            assert events[-1].state == SUCCEEDED  # the broker's channel to the DiT is connected

            # The DiT process dies (no deregistration; its 60 s lease still runs).
            port = int(c.dit.endpoint.rsplit(":", 1)[1])
            assert c.dit._server is not None
            await c.dit._server.stop(0)

            events = await collect(c.api.Generate(request("a dead dit"), timeout=10))
            assert events[-1].state == FAILED
            assert events[-1].error.reason == "REPLICA_UNAVAILABLE"  # retryable
            status = c.core.get_replica("dit-0")
            assert status.up and not status.fenced  # not a lease, not a fence...
            assert not status.reachable  # ...but out of placement
            assert choose_dit_replica(c.core, [4]) is None
            await c.wait_pool_free()  # nothing was armed: the pages are back

            # Meanwhile a new request waits in the queue instead of failing on the dead DiT.
            waiting = asyncio.ensure_future(collect(c.api.Generate(request("queued"), timeout=10)))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            assert c.dit.denoise_started.is_set()  # from the warm-up only
            c.dit.denoise_started.clear()

            # The DiT comes back at the same address and heartbeats: the queued request reaches
            # it at once (a channel in reconnect backoff would fail it with UNAVAILABLE).
            server = grpc.aio.server(options=GRPC_OPTIONS)
            dit_pb2_grpc.add_DitServiceServicer_to_server(c.dit, server)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            c.dit._server = server
            c.core.heartbeat("dit-0", c.dit.incarnation_id)
            assert c.core.get_replica("dit-0").reachable
            events = await asyncio.wait_for(waiting, 10)
            assert events[-1].state == SUCCEEDED
            await wait_until(lambda: c.pool().free == c.pool().total, what="pages free")

    run(body(), timeout=30)
