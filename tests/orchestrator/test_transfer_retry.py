"""A generation whose KV transfer fails (TRANSFER_FAILED, TRANSFER_TIMEOUT, a write its checksum
catches, WRITE_FAILED: a rank of the AR raised while writing) runs again with a fresh ticket under broker.max_replica_retries, over real gRPC against
the real broker, while both replicas keep answering.

The failed attempt's ticket ends exactly as any failed transfer's does (its pages held until no
write can land in them: the retry gets other pages), the retry prefers another AR/DiT pair, takes
the same pair again only when none is up and never a third time, and the client sees states and
steps only move forward, `attempt` go up, and a final error that says how often and why.
Cancellation, the client's deadline, a broker stop and restart end a retried generation as any.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.placement import choose_pair
from kvrelay.broker.tickets import TicketOutcome, TicketState
from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import generation_pb2
from tests.broker.helpers import ManualClock, ar_spec, dit_spec

from .harness import ArReplica, Cluster, cluster, collect, pages_of, request, run, wait_until
from .test_replica_retry import _reopened, assert_forward_only, pool, wait_free

S = generation_pb2
SUCCEEDED, FAILED, CANCELLED = S.GENERATION_STATE_SUCCEEDED, S.GENERATION_STATE_FAILED, S.GENERATION_STATE_CANCELLED
RETRIES = "kvrelay_generation_retries_total"


def write_failed() -> KvRelayServerError:
    """What the AR answers when a write ended FAILED (after reporting each write FAILED)."""
    return KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED", "1 of 1 writes not OK; first: FAILED")


def inject(c: Cluster, fault: str, ar: ArReplica | None = None) -> None:
    """One of the transfer faults on `ar` (default: the cluster's AR), for every Prefill."""
    ar = ar or c.ar
    if fault == "failed":
        ar.fail_after_arming = write_failed()
    elif fault == "write":
        # A rank raised while writing (or its answer was lost): the AR answers WRITE_FAILED.
        ar.fail_after_arming = KvRelayServerError(grpc.StatusCode.INTERNAL, "WRITE_FAILED", "rank 0 raised")
    elif fault == "timeout":
        ar.write_gate.clear()  # armed, the rows never land: the DiT's wait ends TRANSFER_TIMEOUT
    else:
        ar.corrupt_writes = True  # the DiT's checksum never matches: TRANSFER_TIMEOUT too


REASON = {"failed": "TRANSFER_FAILED", "timeout": "TRANSFER_TIMEOUT", "checksum": "TRANSFER_TIMEOUT", "write": "WRITE_FAILED"}
FAULTS = list(REASON)


async def attempt_reached(call: Any, attempt: int, events: list[Any]) -> None:
    while True:
        event = await call.read()
        assert event is not grpc.aio.EOF, f"stream ended before attempt {attempt}: {events}"
        events.append(event)
        if event.attempt >= attempt:
            return


def test_placement_avoids_the_pairs_that_failed_this_generation_and_never_takes_an_excluded_one() -> None:
    core = BrokerCore(None, clock=ManualClock(), lease_seconds=1e6, journal_synchronous="OFF")
    for spec in (ar_spec("ar-0"), dit_spec("dit-0", num_pages=64), dit_spec("dit-1", num_pages=32)):
        core.register_replica(spec)
    try:
        assert choose_pair(core, [16]) == ("ar-0", "dit-0")  # most free pages
        # The generation's own failed pair: another one first, though no pair is suspect ...
        assert choose_pair(core, [16], avoid_pairs={("ar-0", "dit-0")}) == ("ar-0", "dit-1")
        # ... and before a pair only suspect from other generations' failures.
        core.note_transfer_failed("ar-0", "dit-1")
        assert choose_pair(core, [16], avoid_pairs={("ar-0", "dit-0")}) == ("ar-0", "dit-1")
        # Every pair failed it: the plain choice, still.
        assert choose_pair(core, [16], avoid_pairs={("ar-0", "dit-0"), ("ar-0", "dit-1")}) == ("ar-0", "dit-0")
        # An excluded pair never, however it ranks; every pair excluded: none now.
        assert choose_pair(core, [16], exclude_pairs={("ar-0", "dit-0")}) == ("ar-0", "dit-1")
        assert choose_pair(core, [16], exclude_pairs={("ar-0", "dit-0"), ("ar-0", "dit-1")}) == ("ar-0", None)
    finally:
        core.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_transfer_that_fails_once_is_retried_and_the_generation_succeeds(fault: str) -> None:
    async def body() -> None:
        async with cluster(transfer_timeout=1.0) as c:
            undisturbed = (await collect(c.api.Generate(request(request_id="u", seed=11), timeout=20)))[-1]
            assert undisturbed.state == SUCCEEDED, undisturbed.error
            await c.wait_pool_free()
            inject(c, fault)
            c.ar.faulty_prefills = 2  # the undisturbed run's and the first attempt's
            call = c.api.Generate(request(request_id="r", seed=11), timeout=20)
            events: list[Any] = []
            await attempt_reached(call, 2, events)
            first = c.orchestrator.queue.job("r").ended_ticket_ids[-1]  # type: ignore[union-attr]
            old = c.core.get_ticket(first)
            # The failed attempt's ticket ended as any failed transfer's: FAILED / TIMED_OUT with
            # its reason; an armed one with a write unresolved keeps every page (DRAINING).
            # (WRITE_FAILED: this AR reports the writes FAILED before it answers, so the DiT may
            # give up on them first and end the ticket with its own TRANSFER_FAILED.)
            reasons = (REASON[fault], "TRANSFER_FAILED") if fault == "write" else (REASON[fault],)
            assert old.request_over and old.reason.startswith(reasons), old
            if fault == "timeout":
                assert (old.state, old.outcome) == (TicketState.DRAINING, TicketOutcome.TIMED_OUT)
                assert pool(c, "dit-0").draining == len(old.page_ids) > 0
            events += await collect(call)
            final = events[-1]
            assert final.state == SUCCEEDED, final.error
            assert final.attempt == 2 and events[0].attempt == 1
            assert final.image.png == undisturbed.image.png  # the same seed: the same image
            second = c.core.get_ticket(final.ticket_id)
            assert final.ticket_id != first and (second.ar_replica_id, second.dit_replica_id) == ("ar-0", "dit-0")
            # Fresh pages: none of the failed attempt's while a write may still land in them (here
            # the timed-out one's); a page of it only once that ticket was released.
            if set(second.page_ids) & set(old.page_ids):
                assert fault != "timeout"
                assert old.state is TicketState.RELEASED and old.update_time <= second.create_time, (old, second)
            assert c.ar.prefills == ["u", "r", "r"] and c.dit.denoised[1:] == [first, final.ticket_id]
            assert_forward_only(events)
            assert c.metric(RETRIES, {"reason": REASON[fault]}) == 1
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 0
            got = await c.api.GetGeneration(S.GetGenerationRequest(request_id="r"), timeout=5)
            assert got.generation.attempt == 2
            c.ar.write_gate.set()  # the held write lands in the old pages, then they come back
            await c.wait_pool_free()
            assert c.core.list_tickets() == []

    run(body())


@pytest.mark.parametrize("fault", FAULTS)
def test_retries_exhausted_fail_saying_how_often_and_why(fault: str) -> None:
    async def body() -> None:
        async with cluster(transfer_timeout=0.5, max_replica_retries=1) as c:
            inject(c, fault)
            events = await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20))
            final = events[-1]
            assert final.state == FAILED and final.attempt == 2
            assert final.error.reason == REASON[fault]
            message = final.error.message
            assert "(tried 2 times, not retried: broker.max_replica_retries is 1; " in message, message
            assert f"earlier transfers failed: ar-0 -> dit-0 {REASON[fault]})" in message, message
            assert c.ar.prefills == ["r", "r"]
            assert c.metric(RETRIES, {"reason": REASON[fault]}) == 1
            assert_forward_only(events)
            c.ar.write_gate.set()
            await c.wait_pool_free()

    run(body())


def test_max_replica_retries_0_fails_a_transfer_as_before() -> None:
    async def body() -> None:
        async with cluster(max_replica_retries=0) as c:
            inject(c, "failed")
            final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
            assert final.state == FAILED and final.attempt == 1
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "TRANSFER_FAILED")
            assert "(tried" not in final.error.message
            assert c.ar.prefills == ["r"]
            assert c.metric(RETRIES, {"reason": "TRANSFER_FAILED"}) == 0
            await c.wait_pool_free()

    run(body())


def test_a_pair_that_keeps_failing_is_tried_twice_never_a_third_time() -> None:
    async def body() -> None:
        async with cluster(max_replica_retries=5) as c:
            inject(c, "failed")
            final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
            assert final.state == FAILED and final.error.reason == "TRANSFER_FAILED"
            assert c.ar.prefills == ["r", "r"]  # the same pair once more, not five more times
            assert final.attempt == 2
            assert (
                "(tried 2 times, not retried: the transfer failed 2 times on ar-0 -> dit-0 and no other AR/DiT "
                "pair is up; earlier transfers failed: ar-0 -> dit-0 TRANSFER_FAILED)"
            ) in final.error.message, final.error.message
            await c.wait_pool_free()

    run(body())


def test_the_retry_prefers_another_pair_and_bounds_each_pair() -> None:
    async def body() -> None:
        async with cluster(max_replica_retries=5) as c:
            other = await c.add_dit("dit-1", num_pages=16)  # fewer free pages: dit-0 is chosen first
            inject(c, "failed")
            final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
            assert final.state == FAILED and final.error.reason == "TRANSFER_FAILED"
            # dit-0 first, then the other pair although dit-0 still has the most free pages, then
            # each pair once more; never a fifth attempt.
            assert len(c.dit.denoised) == 2 and len(other.denoised) == 2, (c.dit.denoised, other.denoised)
            tickets = c.orchestrator.get("r")
            assert tickets.attempt == 4
            assert "the transfer failed 2 times on ar-0 -> dit-0, ar-0 -> dit-1" in final.error.message
            assert c.metric(RETRIES, {"reason": "TRANSFER_FAILED"}) == 3
            await c.wait_pool_free()
            await wait_free(c, "dit-1")

    run(body())


def test_after_a_failed_transfer_the_retry_goes_to_another_dit_first() -> None:
    async def body() -> None:
        async with cluster() as c:
            other = await c.add_dit("dit-1", num_pages=16)  # fewer free pages: dit-0 is chosen first
            inject(c, "failed")
            c.ar.faulty_prefills = 1
            final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
            assert final.state == SUCCEEDED and final.attempt == 2, final.error
            assert len(c.dit.denoised) == 1 and other.denoised == [final.ticket_id]
            await wait_free(c, "dit-1")

    run(body())


def test_a_failed_transfer_goes_back_to_the_same_pair_once_when_no_other_is_up() -> None:
    async def body() -> None:
        async with cluster() as c:
            inject(c, "failed")
            c.ar.faulty_prefills = 1
            final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
            assert final.state == SUCCEEDED and final.attempt == 2, final.error
            assert len(c.dit.denoised) == 2 and c.ar.prefills == ["r", "r"]
            await c.wait_pool_free()

    run(body())


@pytest.mark.parametrize("fault", FAULTS)
def test_a_deadline_too_close_is_not_retried(fault: str) -> None:
    async def body() -> None:
        async with cluster(transfer_timeout=2.0) as c:
            inject(c, fault)
            c.ar.prefill_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=3), timeout=20)
            await wait_until(lambda: c.ar.prefill_started.is_set(), what="the prefill")
            c.clock_offset[0] += 19.0  # the broker's clock: one second before the client's deadline
            c.ar.prefill_gate.set()
            final = (await collect(call))[-1]
            assert final.state == FAILED and final.error.reason == REASON[fault]
            assert "(tried 1 time, not retried: the client's deadline is " in final.error.message, final.error
            assert c.ar.prefills == ["r"] and final.attempt == 1
            assert c.metric(RETRIES, {"reason": REASON[fault]}) == 0
            c.ar.write_gate.set()
            await c.wait_pool_free()

    run(body())


@pytest.mark.parametrize("fault", ["timeout", "checksum"])
def test_a_transfer_timeout_at_the_dit_stages_own_timeout_is_not_retried_and_blames_no_link(fault: str) -> None:
    """Found black-box: 20 Generate streams without a deadline on one DiT (max_num_seqs 1, 1000
    steps each). Every Denoise call without a client deadline runs under the DiT stage's
    `request_timeout_seconds`; those queued at the DiT behind the others reached it and the DiT
    answered TRANSFER_TIMEOUT ("waited 0.00s": the writes were done, the load never had a turn).
    The broker took that for a broken AR -> DiT link: it marked the pair suspect and ran each
    such generation again at the head of its queue (more load on a DiT already too slow). A
    transfer that fails within LINK_DEADLINE_SLACK_SECONDS of its Denoise call's own timeout is
    now what the client's deadline cutting it short is: no link judged, no retry."""

    async def body() -> None:
        async with cluster(transfer_timeout=0.3) as c:
            inject(c, fault)
            stage_timeout = c.orchestrator.cfg.dit_stage.request_timeout_seconds
            call = c.api.Generate(request(request_id="r", seed=3))  # no client deadline
            await wait_until(lambda: c.dit.denoise_started.is_set(), what="the denoise")
            # The broker's clock: half a second before the Denoise call's own timeout, so the
            # DiT gives up its 0.3 s wait with ~0.2 s of the stage's timeout left.
            c.clock_offset[0] += stage_timeout - 0.5
            final = (await collect(call))[-1]
            assert final.state == FAILED and final.error.reason == REASON[fault], final.error
            assert "(tried 1 time, not retried: its Denoise call reached the DiT stage's request_timeout_seconds" \
                in final.error.message, final.error
            assert c.ar.prefills == ["r"] and final.attempt == 1
            assert c.metric(RETRIES, {"reason": REASON[fault]}) == 0
            assert not c.core.link_suspect("ar-0", "dit-0")
            c.ar.write_gate.set()
            await c.wait_pool_free()

    run(body())


def test_other_failures_of_the_transfer_path_are_not_retried() -> None:
    """A prefill that failed (PREFILL_FAILED) would fail again: one attempt, the error as it was.
    (A rank that raised while writing, WRITE_FAILED, is retried as a transfer failure: FAULTS.)"""

    async def body() -> None:
        async with cluster() as c:
            c.ar.fail_prefill = KvRelayServerError(grpc.StatusCode.INTERNAL, "PREFILL_FAILED", "nan in row 0")
            final = (await collect(c.api.Generate(request(request_id="p", seed=3), timeout=20)))[-1]
            assert (final.state, final.error.reason, final.attempt) == (FAILED, "PREFILL_FAILED", 1)
            assert "(tried" not in final.error.message
            assert c.ar.prefills == ["p"]
            assert c.metric(RETRIES, {"reason": "PREFILL_FAILED"}) == 0
            await c.wait_pool_free()

    run(body())


async def _retry_waiting_for_pages(c: Cluster, request_id: str = "r") -> tuple[Any, str]:
    """A generation whose first transfer timed out with its write still in flight: the ticket
    drains holding its pages, and the DiT (one request's worth of pages) has none for the retry,
    which waits at the queue's head: the draining pages are never handed out again."""
    inject(c, "timeout")
    c.ar.faulty_prefills = 1
    call = c.api.Generate(request(request_id=request_id, seed=3), timeout=20)
    await attempt_reached(call, 2, [])
    first = c.orchestrator.queue.job(request_id).ended_ticket_ids[-1]  # type: ignore[union-attr]
    assert c.core.get_ticket(first).state is TicketState.DRAINING
    await wait_until(lambda: c.orchestrator.queue.depth() == 1, what="the retry waiting for pages")
    assert c.ar.prefills[-1:] == [request_id] and pool(c, "dit-0").free < pages_of("a cat")
    return call, first


def test_cancel_while_the_retry_waits_ends_it_cancelled_and_returns_every_page() -> None:
    async def body() -> None:
        async with cluster(num_pages=pages_of("a cat") + 1, transfer_timeout=0.5) as c:
            call, first = await _retry_waiting_for_pages(c)
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="r"), timeout=5)
            final = (await collect(call))[-1]
            assert final.state == CANCELLED and final.attempt == 2
            assert c.orchestrator.queue.depth() == 0 and c.orchestrator.queue.job("r") is None
            assert c.core.get_ticket(first).state is TicketState.DRAINING  # its write still in flight
            c.ar.write_gate.set()
            await c.wait_pool_free()
            assert c.ar.prefills == ["r"] and c.core.list_tickets() == []

    run(body())


@pytest.mark.parametrize("fault", FAULTS)
def test_cancel_while_the_retry_runs_ends_it_cancelled_and_returns_every_page(fault: str) -> None:
    async def body() -> None:
        async with cluster(transfer_timeout=0.5) as c:
            inject(c, fault)
            c.ar.faulty_prefills = 1
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=3), timeout=20)
            events: list[Any] = []
            await attempt_reached(call, 2, events)
            await wait_until(lambda: c.dit.loaded.is_set(), what="the retry loaded")
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="r"), timeout=5)
            events += await collect(call)
            assert events[-1].state == CANCELLED and events[-1].attempt == 2
            assert_forward_only(events)
            assert c.ar.prefills == ["r", "r"]
            c.ar.write_gate.set()  # the first attempt's held write lands; then its pages come back
            await c.wait_pool_free()
            assert c.core.list_tickets() == []

    run(body())


def test_the_clients_deadline_and_a_broker_stop_end_a_generation_waiting_for_its_retry() -> None:
    async def body() -> None:
        async with cluster(num_pages=pages_of("a cat") + 1, transfer_timeout=0.5) as c:
            call, _ = await _retry_waiting_for_pages(c)
            c.orchestrator.expire("r")  # what the Generate handler does when the deadline passes
            final = (await collect(call))[-1]
            assert (final.state, final.error.reason) == (FAILED, "DEADLINE_EXCEEDED"), final
            assert c.orchestrator.queue.depth() == 0
            c.ar.write_gate.set()
            await c.wait_pool_free()
            c.ar.write_gate.clear()
            c.ar.prefills.clear()
            call, _ = await _retry_waiting_for_pages(c, "s")
            await c.orchestrator.stop()
            snap = c.orchestrator.get("s")
            assert (snap.state, snap.error.reason) == (FAILED, "BROKER_SHUTTING_DOWN")  # type: ignore[union-attr]
            assert c.orchestrator.queue.depth() == 0 and c.orchestrator.queue.running_tasks() == []
            c.ar.write_gate.set()
            await c.wait_pool_free()

    run(body())


def test_a_broker_restart_keeps_a_transfer_retried_generation_ended_once_and_its_tickets_held(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "journal.sqlite")

    async def body() -> tuple[str, str]:
        async with cluster(journal_path=path, transfer_timeout=0.5) as c:
            ar = c.ar
            # The teardown stops the AR before the broker: it must not let the held write of
            # "live"'s first attempt land then (the broker resolved it and, timing permitting,
            # freed its ticket before its stop: RELEASED after the restart).
            ar.resolve_writes_on_stop = False
            # "done": its first transfer fails, the retry succeeds.
            inject(c, "failed")
            c.ar.faulty_prefills = 1
            final = (await collect(c.api.Generate(request(request_id="done", seed=7), timeout=20)))[-1]
            assert final.state == SUCCEEDED and final.attempt == 2
            await c.wait_pool_free()
            # "live": its first transfer times out with its write in flight (DRAINING), and its
            # retry runs (held before its first step) when the broker stops.
            c.ar.fail_after_arming = None
            c.ar.prefills.clear()
            inject(c, "timeout")
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="live", seed=8), timeout=20)
            await attempt_reached(call, 2, [])
            first_live = c.orchestrator.queue.job("live").ended_ticket_ids[-1]  # type: ignore[union-attr]
            c.ar.faulty_prefills = 0  # the retry's write goes through
            # The retry loaded (its ticket CONSUMING) and waits for its first step: the cluster's
            # teardown stops the AR before the broker, and an AR stopped while the retry's Prefill
            # was still in flight ended "live" FAILED REPLICA_UNAVAILABLE (journaled) and freed
            # the first ticket's pages before the broker stopped. Once loaded, the AR is no
            # longer needed (the pipeline's _writer_lost_after_load).
            def retry_denoising() -> bool:
                live = c.orchestrator.get("live")
                return live.attempt == 2 and live.state == S.GENERATION_STATE_DENOISING

            await wait_until(retry_denoising, timeout=15, what="the retry held before its first step")
            assert c.ar.prefills == ["live", "live"]
            ticket_id = c.orchestrator.get("live").ticket_id
            assert c.core.get_ticket(ticket_id).state is TicketState.CONSUMING
        await ar.abandon_writes()
        return first_live, ticket_id

    first_live, _ = run(body())
    core, store = _reopened(path)
    try:
        done = store.find("done")
        assert done is not None and (done.state.name, done.attempt) == ("SUCCEEDED", 2)
        assert [g.request_id for g in store.list_generations()] == ["done"]  # no live one resurrected
        (p,) = core.pool_status("dit-0")
        assert p.free + p.reserved + p.draining == p.total, p
        # The timed-out attempt's write was never resolved: its ticket comes back DRAINING with
        # every page, never freed by the restart.
        ticket = core.get_ticket(first_live)
        assert ticket.state is TicketState.DRAINING and ticket.request_over
        assert p.draining >= len(ticket.page_ids) > 0
    finally:
        core.close()
