"""A generation whose AR or DiT replica stops answering mid-request runs again on another replica
(broker.max_replica_retries), over real gRPC against the real broker.

The failed attempt's ticket ends exactly as a failed request's does (here: a killed DiT's
CONSUMING ticket keeps its pages until the DiT's next incarnation proves its reader gone), the
generation goes back to the queue's head, is placed on a replica that did not fail it, with the
same seed, and its client sees states and steps only move forward. Cancellation, the client's
deadline and the retry bound still end it; nothing leaks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog

from kvrelay.broker.tickets import TicketOutcome, TicketState
from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2

from .harness import Cluster, cluster, collect, pages_of, request, run, wait_until

S = generation_pb2
DENOISING, SUCCEEDED, FAILED, CANCELLED = (
    S.GENERATION_STATE_DENOISING,
    S.GENERATION_STATE_SUCCEEDED,
    S.GENERATION_STATE_FAILED,
    S.GENERATION_STATE_CANCELLED,
)
RETRIES = "kvrelay_generation_retries_total"


async def read_until(call: Any, state: int, events: list[Any]) -> None:
    while True:
        event = await call.read()
        assert event is not grpc.aio.EOF, f"stream ended before state {state}: {events}"
        events.append(event)
        if event.state == state:
            return


def pool(c: Cluster, replica_id: str) -> Any:
    (p,) = c.core.pool_status(replica_id)
    assert p.free + p.reserved + p.draining == p.total, p
    return p


async def wait_free(c: Cluster, replica_id: str) -> None:
    await wait_until(lambda: pool(c, replica_id).free == pool(c, replica_id).total, what=f"{replica_id} pages back")


def assert_forward_only(events: list[Any]) -> None:
    """What SDK and CLI watchers assume: the state never goes back, nor the step within DENOISING."""
    seen = [(e.state, e.step) for e in events]
    assert seen == sorted(seen), seen
    # Only a retry repeats a state and step: once with the new attempt's number, once with its
    # ticket (its placement).
    assert [e.attempt for e in events] == sorted(e.attempt for e in events)
    tagged = [(e.state, e.step, e.attempt, e.ticket_id) for e in events]
    assert len(tagged) == len(set(tagged)), f"an event repeated: {tagged}"


def test_a_dit_killed_mid_denoise_hands_the_generation_to_the_other_dit() -> None:
    async def body() -> None:
        async with cluster() as c:
            other = await c.add_dit("dit-1", num_pages=16)  # fewer free pages: dit-0 is chosen first
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7, num_inference_steps=3), timeout=20)
            events: list[Any] = []
            await read_until(call, DENOISING, events)
            first = c.orchestrator.get("r").ticket_id
            assert c.core.get_ticket(first).dit_replica_id == "dit-0"
            await c.dit.kill()
            events += await collect(call)
            final = events[-1]
            assert final.state == SUCCEEDED, final.error
            assert final.image.seed == 7 and final.image.png
            assert final.ticket_id != first
            assert final.attempt == 2 and events[0].attempt == 1
            got = await c.api.GetGeneration(S.GetGenerationRequest(request_id="r"), timeout=5)
            assert got.generation.attempt == 2
            second = c.core.get_ticket(final.ticket_id)
            assert (second.dit_replica_id, second.outcome) == ("dit-1", TicketOutcome.OK)
            assert other.denoised == [final.ticket_id]
            assert c.ar.prefills == ["r", "r"]  # the AR ran the same request again, for the new ticket
            assert_forward_only(events)
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 1
            assert c.metric("kvrelay_generations_total", {"outcome": "succeeded"}) == 1
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 0
            # The failed attempt's ticket ended as any failed request's: the killed DiT was reading
            # it, so its pages stay held until the DiT's next incarnation proves that reader gone.
            old = c.core.get_ticket(first)
            assert (old.state, old.outcome, old.reason) == (
                TicketState.CONSUMING, TicketOutcome.FAILED, "REPLICA_UNAVAILABLE"
            )
            assert pool(c, "dit-0").reserved == len(old.page_ids) > 0
            await wait_free(c, "dit-1")
            await c.dit.restart_with(32)
            await wait_free(c, "dit-0")
            assert c.core.get_ticket(first).state is TicketState.RELEASED

    run(body())


def test_the_same_seed_gives_the_same_image_on_the_retry() -> None:
    async def body() -> None:
        async with cluster() as c:
            await c.add_dit("dit-1", num_pages=16)
            undisturbed = (await collect(c.api.Generate(request(request_id="a", seed=99), timeout=20)))[-1]
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="b", seed=99), timeout=20)
            await read_until(call, DENOISING, [])
            await c.dit.kill()
            retried = (await collect(call))[-1]
            assert retried.state == SUCCEEDED
            assert retried.image.png == undisturbed.image.png

    run(body())


def test_max_replica_retries_0_fails_the_generation_as_before() -> None:
    async def body() -> None:
        async with cluster(max_replica_retries=0) as c:
            other = await c.add_dit("dit-1", num_pages=16)
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            await c.dit.kill()
            final = (await collect(call))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
            assert "dit-0" in final.error.message and "(tried" not in final.error.message
            assert final.attempt == 1
            assert other.denoised == []
            assert c.ar.prefills == ["r"]
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 0

    run(body())


def test_retries_exhausted_fail_the_generation_saying_how_often_it_was_tried() -> None:
    async def body() -> None:
        async with cluster(max_replica_retries=1) as c:
            second = await c.add_dit("dit-1", num_pages=24)
            third = await c.add_dit("dit-2", num_pages=16)
            second.fail_denoise = KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "connection reset")
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            await c.dit.kill()
            final = (await collect(call))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
            assert "dit-1" in final.error.message  # the last attempt's replica
            assert "tried 2 times" in final.error.message
            assert "max_replica_retries is 1" in final.error.message
            assert len(second.denoised) == 1 and third.denoised == []
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 1
            await wait_free(c, "dit-1")
            await wait_free(c, "dit-2")

    run(body())


def test_with_no_other_replica_up_the_generation_fails_at_once() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            await c.dit.kill()
            final = (await collect(call))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
            assert "tried 1 time, not retried: no other DiT replica is up" in final.error.message
            assert c.ar.prefills == ["r"]
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 0

    run(body())


def test_an_ar_that_stops_answering_hands_the_generation_to_another_ar() -> None:
    async def body() -> None:
        async with cluster() as c:
            from .harness import ArReplica

            second = ArReplica(c.target, c.memory, replica_id="ar-1")
            await second.start()
            try:
                c.ar.fail_prefill = KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "rank 0 died")
                final = (await collect(c.api.Generate(request(request_id="r", seed=3), timeout=20)))[-1]
                assert final.state == SUCCEEDED, final.error
                assert c.core.get_ticket(final.ticket_id).ar_replica_id == "ar-1"
                assert c.ar.prefills == ["r"] and second.prefills == ["r"]
                assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 1
                await c.wait_pool_free()
            finally:
                await second.stop()

    run(body())


def test_a_replica_whose_rank_died_hands_the_generation_to_another_replica() -> None:
    """REPLICA_FAILED: a rank of the replica died or hung, the replica said so and fail-stops (it
    is restarted): the same situation as the replica's own process dying, so the same retry."""
    async def body() -> None:
        async with cluster() as c:
            from .harness import ArReplica

            rank_died = KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", "rank 0 died")
            # The AR: its Prefill answers REPLICA_FAILED; another AR takes the generation.
            second = ArReplica(c.target, c.memory, replica_id="ar-1")
            await second.start()
            try:
                c.ar.fail_prefill = rank_died
                final = (await collect(c.api.Generate(request(request_id="a", seed=3), timeout=20)))[-1]
                assert final.state == SUCCEEDED and final.attempt == 2, final.error
                assert c.core.get_ticket(final.ticket_id).ar_replica_id == "ar-1"
                assert c.metric(RETRIES, {"reason": "REPLICA_FAILED"}) == 1
                await c.wait_pool_free()
            finally:
                await second.stop()
            # Gone for good (deregistered, as a stopping replica does): else, while the first
            # attempt's ticket still counts on ar-0, the retry below goes to the least loaded AR,
            # the stopped ar-1, and fails to connect (this test failed so when run alone).
            c.core.deregister_replica("ar-1", second.incarnation_id)
            # The DiT: its Denoise answers REPLICA_FAILED; the other DiT takes the generation.
            c.ar.fail_prefill = None
            other = await c.add_dit("dit-1", num_pages=16)
            c.dit.fail_denoise = rank_died
            final = (await collect(c.api.Generate(request(request_id="d", seed=5), timeout=20)))[-1]
            assert final.state == SUCCEEDED and final.attempt == 2, final.error
            assert c.core.get_ticket(final.ticket_id).dit_replica_id == "dit-1"
            assert other.denoised == [final.ticket_id]
            assert c.metric(RETRIES, {"reason": "REPLICA_FAILED"}) == 2
            await wait_free(c, "dit-1")

    run(body())


def test_a_deadline_too_close_is_not_retried() -> None:
    async def body() -> None:
        async with cluster() as c:
            other = await c.add_dit("dit-1", num_pages=16)
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            c.clock_offset[0] += 19.5  # the broker's clock: half a second before the client's deadline
            await c.dit.kill()
            final = (await collect(call))[-1]
            assert final.state == FAILED
            assert final.error.reason == "REPLICA_UNAVAILABLE"
            assert "not retried: the client's deadline is" in final.error.message
            assert other.denoised == []

    run(body())


def test_cancel_while_requeued_ends_it_cancelled_and_returns_every_page() -> None:
    async def body() -> None:
        async with cluster() as c:
            # dit-1 holds one request at a time: of two generations retried there, one waits.
            other = await c.add_dit("dit-1", num_pages=pages_of("a cat") + 1)
            other.step_gate.clear()
            c.dit.step_gate.clear()
            calls = {rid: c.api.Generate(request(request_id=rid, seed=5), timeout=20) for rid in ("x", "y")}
            for call in calls.values():
                await read_until(call, DENOISING, [])
            await c.dit.kill()
            queue = c.orchestrator.queue
            await wait_until(lambda: len(other.denoised) == 1 and queue.depth() == 1, what="one retried, one waiting")
            waiting = next(rid for rid in calls if not queue.job(rid).placed.done())  # type: ignore[union-attr]
            running = "y" if waiting == "x" else "x"
            assert queue.job(waiting).attempt == 2  # type: ignore[union-attr]
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id=waiting), timeout=5)
            final = (await collect(calls[waiting]))[-1]
            assert final.state == CANCELLED
            assert queue.depth() == 0 and queue.job(waiting) is None
            other.step_gate.set()
            done = (await collect(calls[running]))[-1]
            assert done.state == SUCCEEDED
            assert len(other.denoised) == 1  # the cancelled one never ran a second attempt
            await wait_free(c, "dit-1")
            await c.dit.restart_with(32)
            await wait_free(c, "dit-0")
            assert c.core.list_tickets() == []
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 2

    run(body())


def test_forgetting_the_failed_dit_by_force_leaves_the_retried_generation_alone() -> None:
    async def body() -> None:
        async with cluster() as c:
            other = await c.add_dit("dit-1", num_pages=16)
            other.step_gate.clear()
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            first = c.orchestrator.get("r").ticket_id
            await c.dit.kill()
            await wait_until(lambda: len(other.denoised) == 1, what="the retry on dit-1")
            await wait_until(lambda: other.loaded.is_set(), what="the retry loaded")
            c.core.deregister_replica(c.dit.replica_id, c.dit.incarnation_id)
            broker = broker_pb2_grpc.BrokerServiceStub(c.channel)
            reply = await broker.ForgetReplica(
                broker_pb2.ForgetReplicaRequest(replica_id="dit-0", force=True), timeout=5
            )
            assert list(reply.ended_ticket_ids) == [first]  # the earlier attempt's, ended already
            other.step_gate.set()
            final = (await collect(call))[-1]
            assert final.state == SUCCEEDED, final.error

    run(body())


def test_a_dit_forgotten_by_force_mid_denoise_hands_the_generation_to_the_other_dit() -> None:
    async def body() -> None:
        async with cluster() as c:
            other = await c.add_dit("dit-1", num_pages=16)
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=7), timeout=20)
            await read_until(call, DENOISING, [])
            first = c.orchestrator.get("r").ticket_id
            # Cut off (it neither steps nor ends), then forgotten by an operator.
            c.core.deregister_replica(c.dit.replica_id, c.dit.incarnation_id)
            broker = broker_pb2_grpc.BrokerServiceStub(c.channel)
            await broker.ForgetReplica(broker_pb2.ForgetReplicaRequest(replica_id="dit-0", force=True), timeout=5)
            final = (await asyncio.wait_for(collect(call), 10))[-1]
            assert final.state == SUCCEEDED, final.error
            assert final.ticket_id != first and other.denoised == [final.ticket_id]
            assert c.metric(RETRIES, {"reason": "REPLICA_FORGOTTEN"}) == 1
            await wait_free(c, "dit-1")

    run(body())


def test_the_retry_never_goes_back_to_the_replica_that_failed_it() -> None:
    async def body() -> None:
        async with cluster() as c:
            # A call the DiT's process ended (its stream cancelled) without the broker losing the
            # connection: dit-0 stays up and reachable, and still has the most free pages.
            other = await c.add_dit("dit-1", num_pages=16)
            c.dit.fail_denoise = KvRelayServerError(grpc.StatusCode.CANCELLED, "CANCELLED", "the process is exiting")
            final = (await collect(c.api.Generate(request(request_id="r", seed=7), timeout=20)))[-1]
            assert final.state == SUCCEEDED, final.error
            assert len(c.dit.denoised) == 1 and other.denoised == [final.ticket_id]
            assert c.core.get_replica("dit-0").reachable
            await c.wait_pool_free()
            await wait_free(c, "dit-1")

    run(body())


def test_the_cli_progress_says_when_the_generation_moved_to_another_replica() -> None:
    import io

    from kvrelay.client import GenerationEvent, GenerationState
    from kvrelay.client.cli import _Progress

    out = io.StringIO()
    progress = _Progress(out, enabled=True)
    for step, attempt in ((1, 1), (2, 1), (2, 2), (3, 2)):
        progress.update(GenerationEvent("r", GenerationState.DENOISING, step, 4, attempt=attempt))
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "DENOISING 1/4",
        "DENOISING 2/4",
        "DENOISING 2/4 (its replica or KV transfer failed: attempt 2)",
        "DENOISING 3/4",
    ]


async def _one_retried_one_requeued(c: Cluster) -> tuple[Any, dict[str, Any], str, str]:
    """Two generations on dit-0, dit-0 killed: one runs its retry on dit-1 (held before its first
    step), the other waits at the queue's head (dit-1 holds one request at a time)."""
    other = await c.add_dit("dit-1", num_pages=pages_of("a cat") + 1)
    other.step_gate.clear()
    c.dit.step_gate.clear()
    calls = {rid: c.api.Generate(request(request_id=rid, seed=5), timeout=20) for rid in ("x", "y")}
    for call in calls.values():
        await read_until(call, DENOISING, [])
    await c.dit.kill()
    queue = c.orchestrator.queue
    await wait_until(lambda: other.loaded.is_set() and queue.depth() == 1, what="one retried, one waiting")
    waiting = next(rid for rid in calls if not queue.job(rid).placed.done())  # type: ignore[union-attr]
    running = "y" if waiting == "x" else "x"
    return other, calls, waiting, running


def test_the_clients_deadline_ends_a_generation_waiting_for_or_running_its_retry() -> None:
    async def body() -> None:
        async with cluster() as c:
            other, calls, waiting, running = await _one_retried_one_requeued(c)
            for rid in (waiting, running):
                c.orchestrator.expire(rid)  # what the Generate handler does when the deadline passes
                final = (await collect(calls[rid]))[-1]
                assert (final.state, final.error.reason) == (FAILED, "DEADLINE_EXCEEDED"), final
            assert c.orchestrator.queue.depth() == 0
            assert len(other.denoised) == 1
            await wait_free(c, "dit-1")
            await wait_until(lambda: c.orchestrator.queue.running_tasks() == [], what="pipelines done")

    run(body())


def test_a_broker_stop_ends_a_generation_waiting_for_or_running_its_retry() -> None:
    async def body() -> None:
        async with cluster() as c:
            other, calls, waiting, running = await _one_retried_one_requeued(c)
            await c.orchestrator.stop()
            for rid in (waiting, running):
                snap = c.orchestrator.get(rid)
                assert (snap.state, snap.error.reason) == (FAILED, "BROKER_SHUTTING_DOWN")  # type: ignore[union-attr]
            assert c.orchestrator.queue.running_tasks() == []
            assert c.orchestrator.queue.depth() == 0
            # The running retry's ticket ended with it: the DiT stops and releases its pages.
            await wait_free(c, "dit-1")
            assert len(other.denoised) == 1

    run(body())


def _reopened(path: str) -> tuple[Any, Any]:
    """A broker's core and generation store restarted from the journal at `path`."""
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.generations import GenerationStore

    core = BrokerCore(path, lease_seconds=60.0, drain_quiet_seconds=0.05, journal_synchronous="OFF")
    store = GenerationStore(result_ttl_seconds=30, max_results=16, journal=core.journal)
    store.restore()
    return core, store


def test_a_broker_restart_keeps_a_retried_generation_ended_once_and_restores_no_live_one(tmp_path: Any) -> None:
    path = str(tmp_path / "journal.sqlite")

    async def body() -> tuple[str, str, str]:
        async with cluster(journal_path=path) as c:
            second = await c.add_dit("dit-1", num_pages=24)
            third = await c.add_dit("dit-2", num_pages=16)
            # "done": on dit-0 (most free pages), dit-0 killed, finished on dit-1.
            c.dit.step_gate.clear()
            done_call = c.api.Generate(request(request_id="done", seed=7), timeout=20)
            await read_until(done_call, DENOISING, [])
            first_done = c.orchestrator.get("done").ticket_id
            await c.dit.kill()
            final = (await collect(done_call))[-1]
            assert final.state == SUCCEEDED and final.attempt == 2
            # "live": on dit-1 (dit-0 is out of placement), dit-1 killed, its retry running on
            # dit-2 when the broker stops.
            second.step_gate.clear()
            third.step_gate.clear()
            live_call = c.api.Generate(request(request_id="live", seed=8), timeout=20)
            await read_until(live_call, DENOISING, [])
            first_live = c.orchestrator.get("live").ticket_id
            assert c.core.get_ticket(first_live).dit_replica_id == "dit-1"
            await second.kill()
            await wait_until(lambda: third.loaded.is_set(), what="the retry loaded on dit-2")
            return first_done, first_live, c.orchestrator.get("live").ticket_id

    first_done, first_live, second_live = run(body())
    core, store = _reopened(path)
    try:
        done = store.find("done")
        assert done is not None
        assert (done.state.name, done.attempt) == ("SUCCEEDED", 2)
        # A live generation is never resurrected (nor journaled as ended by the stop).
        assert [g.request_id for g in store.list_generations()] == ["done"]
        # Every ticket of both attempts is restored as the lifecycle says: none freed early, none
        # handed out twice; the pages of each DiT add up.
        for rid in ("dit-0", "dit-1", "dit-2"):
            (p,) = core.pool_status(rid)
            assert p.free + p.reserved + p.draining == p.total, p
        for ticket_id in (first_done, first_live):  # read by a DiT that was killed: held still
            ticket = core.get_ticket(ticket_id)
            assert ticket.request_over and ticket.state is TicketState.CONSUMING, ticket
        # The running retry's ticket: released by its DiT as the broker stopped, or restored ended.
        live = {t.ticket_id: t for t in core.list_tickets()}
        assert set(live) <= {first_done, first_live, second_live}
        assert second_live not in live or live[second_live].request_over
    finally:
        core.close()


@pytest.mark.parametrize("how", ["killed", "rank_failed", "write_failed"])
def test_an_ar_lost_after_the_dit_loaded_every_row_does_not_end_the_denoise(
    how: str,
) -> None:
    """Found black-box (2 ARs, 1 DiT, the writing AR SIGSTOPped just after its last write): once
    the DiT verified every row (ticket READY/CONSUMING) the AR has nothing more to give, yet its
    Prefill failing UNAVAILABLE ended the attempt: the denoise was thrown away and run again from
    the start on another AR, or, with no other AR up, the generation FAILED. Now the denoise goes
    on: one attempt, the same ticket, no retry counted. Also when the AR answers REPLICA_FAILED
    then (a rank died after its writes were final), or WRITE_FAILED (a rank raised, or its answer
    was lost, after its writes were final: before, the broker threw the denoise away and retried
    the generation with a fresh ticket although the DiT had verified every row's checksum)."""

    async def body() -> None:
        async with cluster() as c:
            c.ar.reply_gate.clear()  # every write reported, the Prefill reply held
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="r", seed=5, num_inference_steps=3), timeout=20)
            events: list[Any] = []
            await read_until(call, DENOISING, events)
            ticket_id = c.orchestrator.get("r").ticket_id
            assert c.core.get_ticket(ticket_id).state is TicketState.CONSUMING
            with structlog.testing.capture_logs() as logged:
                if how == "killed":
                    assert c.ar._server is not None
                    await c.ar._server.stop(0)  # the AR goes away mid-call (kill -9), its reply never sent
                else:
                    c.ar.fail_reply = (
                        KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", "rank 0 died")
                        if how == "rank_failed"
                        else KvRelayServerError(grpc.StatusCode.INTERNAL, "WRITE_FAILED", "rank 0 raised")
                    )
                    c.ar.reply_gate.set()
                # The broker saw the Prefill call end (and let it go) before the next step.
                await wait_until(lambda: any(e["event"] == "prefill_reply_lost" for e in logged),
                                 timeout=10, what="the broker to see the Prefill fail")
            c.dit.step_gate.set()
            events += await collect(call)
            final = events[-1]
            assert final.state == SUCCEEDED, final.error
            assert final.ticket_id == ticket_id and final.attempt == 1
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 0
            assert c.metric(RETRIES, {"reason": "REPLICA_FAILED"}) == 0
            assert c.metric(RETRIES, {"reason": "WRITE_FAILED"}) == 0
            assert_forward_only(events)
            await c.wait_pool_free()

    run(body())


@pytest.mark.parametrize("how", ["killed", "rank_failed"])
def test_an_ar_lost_after_the_image_is_made_does_not_fail_the_generation(how: str) -> None:
    """Found black-box (1 AR, 1 DiT, the AR SIGSTOPped just after its writes, then kill -9): the
    DiT denoised every step, decoded and released the ticket OK, and the broker held the image
    while it waited for the Prefill reply (it only carries timings). The AR's end then FAILED the
    generation REPLICA_UNAVAILABLE at DENOISING 50/50, its image thrown away: the check that lets
    an AR lost after the load go took only a ticket still READY or CONSUMING, not one the DiT had
    already released. Now a Prefill that fails once the image is here ends nothing: SUCCEEDED,
    without prefill/transfer timings, one attempt."""

    async def body() -> None:
        async with cluster() as c:
            c.ar.reply_gate.clear()  # every write reported, the Prefill reply held
            call = c.api.Generate(request(request_id="r", seed=5, num_inference_steps=3), timeout=20)
            events: list[Any] = []
            await read_until(call, DENOISING, events)
            ticket_id = c.orchestrator.get("r").ticket_id
            # The DiT decodes and releases the ticket OK: the broker holds the image now.
            await wait_until(lambda: c.core.get_ticket(ticket_id).state is TicketState.RELEASED,
                             what="the DiT's release")
            if how == "killed":
                assert c.ar._server is not None
                await c.ar._server.stop(0)  # the AR goes away mid-call (kill -9), its reply never sent
            else:
                c.ar.fail_reply = KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", "rank 0 died")
                c.ar.reply_gate.set()
            events += await collect(call)
            final = events[-1]
            assert final.state == SUCCEEDED, final.error
            assert final.image.png and final.ticket_id == ticket_id and final.attempt == 1
            assert final.timings.denoise_seconds > 0 and final.timings.transfer_seconds == 0
            assert c.metric(RETRIES, {"reason": "REPLICA_UNAVAILABLE"}) == 0
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 0
            assert_forward_only(events)
            await c.wait_pool_free()

    run(body())
