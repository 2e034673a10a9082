"""Placement avoids an AR/DiT pair whose last transfer failed, while another pair can serve.

Found black-box with the broker, two ARs and two DiTs in network namespaces: with one DiT's
Mooncake ports closed to the AR hosts (its gRPC port open, so the broker saw it healthy), every
request placed on it waited `transfer_timeout` and failed `TRANSFER_TIMEOUT`, for as long as the
firewall stayed: placement knew nothing of the AR -> DiT link. Now a request that ends
`TRANSFER_TIMEOUT` or `TRANSFER_FAILED` makes the pair suspect for a backoff (5 s, doubling to
120 s) and a success clears it; a suspect pair still serves when no other can."""

from __future__ import annotations

import grpc

from kvrelay.broker.core import LINK_BACKOFF_INITIAL_S, LINK_BACKOFF_MAX_S, BrokerCore
from kvrelay.broker.placement import choose_pair, place
from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import generation_pb2
from tests.broker.helpers import ManualClock, ar_spec, dit_spec
from tests.orchestrator.harness import cluster, collect, request, run

SUCCEEDED = generation_pb2.GENERATION_STATE_SUCCEEDED
FAILED = generation_pb2.GENERATION_STATE_FAILED


def _core(clock: ManualClock) -> BrokerCore:
    core = BrokerCore(None, clock=clock, lease_seconds=1e6, journal_synchronous="OFF")
    for spec in (ar_spec("ar-0"), ar_spec("ar-1"), dit_spec("dit-0", num_pages=64), dit_spec("dit-1", num_pages=32)):
        core.register_replica(spec)
    return core


def test_a_suspect_pair_is_skipped_while_another_can_serve() -> None:
    clock = ManualClock()
    core = _core(clock)
    assert choose_pair(core, [16]) == ("ar-0", "dit-0")  # least-loaded AR, most free pages
    core.note_transfer_failed("ar-0", "dit-0")
    assert choose_pair(core, [16]) == ("ar-0", "dit-1")  # the same AR, the other DiT
    core.note_transfer_failed("ar-0", "dit-1")
    assert choose_pair(core, [16]) == ("ar-1", "dit-0")  # every DiT of ar-0 suspect: the other AR
    core.note_transfer_failed("ar-1", "dit-0")
    core.note_transfer_failed("ar-1", "dit-1")
    assert choose_pair(core, [16]) == ("ar-0", "dit-0")  # all suspect: the plain choice, never none
    ticket = place(core, "req-1", [16])
    assert ticket is not None and (ticket.ar_replica_id, ticket.dit_replica_id) == ("ar-0", "dit-0")


def test_the_backoff_doubles_while_the_pair_fails_and_a_success_clears_it() -> None:
    clock = ManualClock()
    core = _core(clock)
    assert core.note_transfer_failed("ar-0", "dit-0") == LINK_BACKOFF_INITIAL_S
    clock.advance(LINK_BACKOFF_INITIAL_S - 0.1)
    assert core.link_suspect("ar-0", "dit-0")
    clock.advance(0.2)
    assert not core.link_suspect("ar-0", "dit-0")  # tried again once the backoff passed
    assert choose_pair(core, [16]) == ("ar-0", "dit-0")
    backoffs = [core.note_transfer_failed("ar-0", "dit-0") for _ in range(8)]
    assert backoffs[:3] == [2 * LINK_BACKOFF_INITIAL_S, 4 * LINK_BACKOFF_INITIAL_S, 8 * LINK_BACKOFF_INITIAL_S]
    assert backoffs[-1] == LINK_BACKOFF_MAX_S
    assert not core.link_suspect("ar-0", "dit-1") and not core.link_suspect("ar-1", "dit-0")  # per pair
    core.note_transfer_ok("ar-0", "dit-0")
    assert not core.link_suspect("ar-0", "dit-0")
    assert core.note_transfer_failed("ar-0", "dit-0") == LINK_BACKOFF_INITIAL_S  # from the start again


def test_a_request_that_failed_its_transfer_marks_its_pair_and_one_that_succeeded_clears_it() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.fail_denoise = KvRelayServerError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT", "rows/ranks [(0, 0)] not loaded in time"
            )
            events = await collect(c.api.Generate(request("a blocked link"), timeout=10))
            assert events[-1].state == FAILED and events[-1].error.reason == "TRANSFER_TIMEOUT"
            assert c.core.link_suspect("ar-0", "dit-0")
            # The only pair: still used (a suspect pair is avoided, never refused).
            c.dit.fail_denoise = None
            events = await collect(c.api.Generate(request("healed"), timeout=10))
            assert events[-1].state == SUCCEEDED
            assert not c.core.link_suspect("ar-0", "dit-0")
            # Other failures say nothing about the link.
            c.dit.fail_denoise = KvRelayServerError(grpc.StatusCode.INTERNAL, "DENOISE_FAILED", "a model error")
            events = await collect(c.api.Generate(request("a model error"), timeout=10))
            assert events[-1].state == FAILED
            assert not c.core.link_suspect("ar-0", "dit-0")

    run(body(), timeout=60)
