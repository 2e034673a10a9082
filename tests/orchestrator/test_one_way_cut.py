"""A DiT replica cut off from the broker one way (broker -> DiT packets lost, DiT -> broker still
delivered), mid-Denoise: found in a black-box run with network namespaces, where the broker's
Denoise calls hung until the client's deadline because nothing on the connection noticed.

Under test: HTTP/2 keepalive (kvrelay.security.Keepalive) ends the broker's call UNAVAILABLE
within its bound; the request fails as any unreachable replica's does; the ticket's pages are
not freed while the DiT may still read them (CONSUMING: only the DiT's release frees them); and
the DiT's own listener notices its caller is gone, cancels the handler, and releases.
"""

from __future__ import annotations

import asyncio
import time

from kvrelay.broker.metrics import register_broker_metrics
from kvrelay.broker.tickets import TicketOutcome, TicketState
from kvrelay.security import Credentials, Keepalive
from kvrelay.server import GRPC_OPTIONS
from kvrelay.v1 import broker_pb2, generation_pb2

from .harness import Cluster, cluster, collect, request, run, wait_until

S = generation_pb2
# The broker's channels: a dead connection is noticed within 1 + 0.5 s (gRPC pings at most once
# a second while no data flows).
BROKER_KEEPALIVE = Keepalive(time_s=1.0, timeout_s=0.5)
DEADLINE_S = 30.0
# A DiT listener that accepts the broker's pings but sends none of its own.
PERMITS_PINGS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
]


def _pages(c: Cluster, state: str) -> float:
    return c.metric("kvrelay_pages", {"replica": c.dit.replica_id, "state": state})


async def _cut_mid_denoise(c: Cluster) -> tuple[generation_pb2.GenerationEvent, float]:
    """Start a generation, hold the DiT at DENOISING 0/n (ticket CONSUMING), drop every packet
    from the broker to the DiT, and return the generation's last event and how long it took."""
    register_broker_metrics(c.core, c.registry)
    c.dit.step_gate.clear()
    call = c.api.Generate(request(seed=4), timeout=DEADLINE_S)
    await c.dit.loaded.wait()
    assert c.dit_proxy is not None
    c.dit_proxy.blackhole("to_target")
    cut_at = time.monotonic()
    events = await collect(call)
    return events[-1], time.monotonic() - cut_at


def test_denoise_over_a_one_way_cut_fails_within_the_keepalive_bound() -> None:
    """The DiT here runs no keepalive of its own (as a stopped or partitioned peer answers
    nothing), so only the broker's channel can notice. Before keepalive the call hung for the
    whole 30 s deadline (DEADLINE_EXCEEDED)."""

    async def body() -> None:
        async with cluster(
            credentials=Credentials(keepalive=BROKER_KEEPALIVE),
            dit_proxy=True,
            dit_server_options=PERMITS_PINGS,
        ) as c:
            final, took = await _cut_mid_denoise(c)
            assert final.state == S.GENERATION_STATE_FAILED, final
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE"), (
                final.error
            )
            assert "Denoise on DiT replica dit-0" in final.error.message
            assert took < BROKER_KEEPALIVE.detect_within_s + 3.0 < DEADLINE_S, took
            # The request is over, the pages are not: the DiT may still be reading them, and
            # nothing proves it stopped (a lost connection is "I stopped waiting").
            ticket = c.core.get_ticket(final.ticket_id)
            assert ticket.state is TicketState.CONSUMING and ticket.outcome is TicketOutcome.FAILED
            await asyncio.sleep(1.0)
            assert c.core.get_ticket(final.ticket_id).state is TicketState.CONSUMING
            pool = c.pool()
            assert pool.reserved == len(ticket.page_ids) and pool.free == pool.total - pool.reserved
            assert _pages(c, "reserved") == len(ticket.page_ids)
            # Kept out of placement until its next heartbeat proves it alive.
            assert not c.core.get_replica(c.dit.replica_id).reachable
            # The DiT finishes reading and releases: every page comes back, none leaked.
            c.dit.step_gate.set()
            await wait_until(lambda: c.dit.released != [], what="the DiT's release")
            await c.wait_pool_free()
            assert c.core.get_ticket(final.ticket_id).state is TicketState.RELEASED
            assert _pages(c, "free") == c.pool().total and _pages(c, "draining") == 0
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 1

    run(body())


def test_a_dit_whose_caller_is_cut_off_cancels_its_denoise_and_releases() -> None:
    """The DiT's listener pings its callers too: its Denoise handler, held before its first step,
    is cancelled once the broker stops answering, and its `finally` hands the pages back, with no
    step ever taken. Without server-side keepalive the handler waited on, holding the pages."""
    dit_keepalive = Keepalive(time_s=1.0, timeout_s=1.0)
    options = [*GRPC_OPTIONS, *dit_keepalive.server_options()]

    async def body() -> None:
        async with cluster(
            credentials=Credentials(keepalive=BROKER_KEEPALIVE), dit_proxy=True, dit_server_options=options
        ) as c:
            final, _ = await _cut_mid_denoise(c)
            assert final.state == S.GENERATION_STATE_FAILED, final
            await c.wait_pool_free(timeout=dit_keepalive.detect_within_s + 5.0)
            assert c.dit.released == [(final.ticket_id, broker_pb2.TICKET_OUTCOME_CANCELLED)]
            assert c.core.get_ticket(final.ticket_id).state is TicketState.RELEASED
            assert _pages(c, "free") == c.pool().total

    run(body())


def test_a_connection_lost_while_the_broker_itself_did_not_run_does_not_blame_the_dit() -> None:
    """Found black-box: a broker SIGSTOPped for 40 s mid-Denoise, then continued, failed the
    generation with 'the DiT replica stopped answering' (its keepalive ping went unanswered
    because the broker itself was not running), while the DiT had run all along. Here the
    broker's clock jumps 6 s between two ticks of its stall watch (broker/stalls.py), as it does
    for a stopped process, before the connection is lost."""

    async def body() -> None:
        async with cluster(
            credentials=Credentials(keepalive=BROKER_KEEPALIVE),
            dit_proxy=True,
            dit_server_options=PERMITS_PINGS,
        ) as c:
            register_broker_metrics(c.core, c.registry)
            c.dit.step_gate.clear()
            call = c.api.Generate(request(seed=5), timeout=DEADLINE_S)
            await c.dit.loaded.wait()
            c.clock_offset[0] += 6.0
            await asyncio.sleep(1.0)  # the stall watch ticks (every 0.5 s)
            assert c.dit_proxy is not None
            c.dit_proxy.blackhole("to_target")
            final = (await collect(call))[-1]
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE"), (
                final.error
            )
            assert "this broker itself did not run for 6 s" in final.error.message, final.error.message
            assert "stopped answering" not in final.error.message
            c.dit.step_gate.set()
            await wait_until(lambda: c.dit.released != [], what="the DiT's release")
            await c.wait_pool_free()

    run(body())
