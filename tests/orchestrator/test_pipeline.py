"""The orchestrator's pipeline over real gRPC: states, admission, placement, cancellation at every
stage (pages back only after draining), dropped streams, replica failures and deadlines."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.broker.tickets import TicketOutcome, TicketState
from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2

from .harness import Cluster, cluster, collect, error_info, pages_of, png_size, request, run, wait_until

S = generation_pb2
QUEUED, PREFILLING, TRANSFERRING, DENOISING = (
    S.GENERATION_STATE_QUEUED,
    S.GENERATION_STATE_PREFILLING,
    S.GENERATION_STATE_TRANSFERRING,
    S.GENERATION_STATE_DENOISING,
)
SUCCEEDED, FAILED, CANCELLED = (
    S.GENERATION_STATE_SUCCEEDED,
    S.GENERATION_STATE_FAILED,
    S.GENERATION_STATE_CANCELLED,
)


async def state_of(c: Cluster, request_id: str) -> int:
    got = await c.api.GetGeneration(S.GetGenerationRequest(request_id=request_id), timeout=5)
    return int(got.generation.state)


async def read_until(call: object, state: int) -> list[S.GenerationEvent]:
    events = []
    while True:
        event = await call.read()  # type: ignore[attr-defined]
        assert event is not grpc.aio.EOF, f"stream ended before state {state}: {events}"
        events.append(event)
        if event.state == state:
            return events


def test_states_image_and_timings_of_one_generation() -> None:
    async def body() -> None:
        async with cluster() as c:
            events = await collect(
                c.api.Generate(request(seed=11, num_inference_steps=3, width=96), timeout=10)
            )
            states = [(e.state, e.step) for e in events]
            assert states == [
                (QUEUED, 0),
                (PREFILLING, 0),
                (TRANSFERRING, 0),
                (DENOISING, 0),
                (DENOISING, 1),
                (DENOISING, 2),
                (DENOISING, 3),
                (SUCCEEDED, 3),
            ]
            final = events[-1]
            assert all(e.total_steps == 3 for e in events)
            assert png_size(final.image.png) == (96, 64)
            assert (final.image.width, final.image.height, final.image.seed) == (96, 64, 11)
            assert final.ticket_id and all(e.ticket_id == final.ticket_id for e in events[1:])
            t = final.timings
            for name in ("queue", "prefill", "transfer", "load", "denoise", "decode", "handoff", "total"):
                assert getattr(t, f"{name}_seconds") > 0, name
            # Handoff (reservation or DiT admission, the later, to loaded) is what of the KV
            # handoff is left on the request's path: a DiT may load while the call is queued, so
            # it is not bounded below by the load. Total contains queue and handoff.
            assert t.total_seconds >= t.queue_seconds + t.handoff_seconds
            assert not final.HasField("error")
            ticket = c.core.get_ticket(final.ticket_id)
            assert (ticket.state, ticket.outcome) == (TicketState.RELEASED, TicketOutcome.OK)
            assert c.pool().free == c.pool().total

    run(body())


def test_a_prompt_of_far_more_bytes_than_tokens_is_refused_before_tokenizing() -> None:
    # Found black-box: 1 MiB prompts that the demo's tokenizer turns into 3 tokens (accepted)
    # cost the AR 1-4 s each to tokenize; 12 at once made a 0.2 s generation take 21-31 s.
    from kvrelay.broker.admission import MAX_PROMPT_BYTES_PER_TOKEN

    async def body() -> None:
        async with cluster(max_tokens=16) as c:
            c.ar.tokenize_gate.clear()  # a Tokenize call would hang: none may be made
            limit = 16 * MAX_PROMPT_BYTES_PER_TOKEN
            for fields, field in (
                ({"prompt": "x" + " " * limit}, "prompt"),
                ({"prompt": "ok", "negative_prompt": "y" * (limit + 1)}, "negative_prompt"),
            ):
                prompt = fields.pop("prompt")
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(c.api.Generate(request(prompt, seed=1, **fields), timeout=5))
                code, reason, metadata = error_info(exc.value)
                assert (code, reason, metadata["field"]) == (
                    grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG", field
                )
                assert f"at most {limit} bytes" in exc.value.details()
            assert c.orchestrator.list_generations() == []

    run(body())


def test_prompt_too_long_for_the_ar_names_the_field() -> None:
    async def body() -> None:
        async with cluster(max_tokens=16) as c:
            for fields, field in (
                ({"prompt": "x" * 16}, "prompt"),
                ({"prompt": "ok", "negative_prompt": "y" * 16}, "negative_prompt"),
            ):
                prompt = fields.pop("prompt")
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(c.api.Generate(request(prompt, seed=1, **fields), timeout=5))
                code, reason, metadata = error_info(exc.value)
                assert (code, reason, metadata["field"]) == (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "PROMPT_TOO_LONG",
                    field,
                )
                assert "shorten it" in exc.value.details() and "max_model_len" in exc.value.details()
            # With guidance 1.0 there is no negative row, so a long negative prompt is not used.
            ok = await collect(
                c.api.Generate(
                    request("ok", negative_prompt="y" * 16, guidance_scale=1.0, seed=1), timeout=10
                )
            )
            assert ok[-1].state == SUCCEEDED
            # 15 bytes + BOS = 16 tokens: exactly the maximum.
            assert (await collect(c.api.Generate(request("x" * 15, seed=1), timeout=10)))[
                -1
            ].state == SUCCEEDED

    run(body())


def test_request_that_can_never_fit_is_invalid_argument() -> None:
    async def body() -> None:
        async with cluster(num_pages=4) as c:
            prompt = "p" * 15  # 16 tokens = 4 pages, plus 1 page for the unconditional row
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(prompt, seed=1), timeout=5))
            code, reason, metadata = error_info(exc.value)
            assert (code, reason, metadata["field"]) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "NEVER_FITS",
                "prompt",
            )
            assert c.core.list_tickets() == [] and c.orchestrator.list_generations() == []
            # One row (no CFG) of the same prompt fits the whole pool.
            one_row = await collect(c.api.Generate(request(prompt, guidance_scale=1.0, seed=1), timeout=10))
            assert one_row[-1].state == SUCCEEDED

    run(body())


def test_request_that_does_not_fit_now_waits_then_runs_in_fifo_order() -> None:
    async def body() -> None:
        # 6 pages. "a cat" = 2 pages + 1 (unconditional row) = 3.
        async with cluster(num_pages=6) as c:
            assert pages_of("a cat") + pages_of("") == 3
            c.ar.prefill_gate.clear()
            a = c.api.Generate(request(request_id="a", seed=1), timeout=20)
            b = c.api.Generate(request(request_id="b", seed=2), timeout=20)
            await wait_until(lambda: len(c.ar.prefills) == 2, what="a and b prefilling")
            assert c.pool().free == 0
            big = c.api.Generate(request("a cat!!", request_id="big", seed=3), timeout=20)  # 2 + 1 pages
            small = c.api.Generate(request("s", request_id="small", guidance_scale=1.0, seed=4), timeout=20)
            assert (await big.read()).state == QUEUED
            assert (await small.read()).state == QUEUED
            await asyncio.sleep(0.3)
            # Neither is placed: nothing fits, and `small` may not overtake `big` later either.
            assert await state_of(c, "big") == QUEUED and await state_of(c, "small") == QUEUED
            assert c.orchestrator.queue_depth() == 2
            assert c.metric("kvrelay_generations_queued") == 2
            c.ar.prefill_gate.set()
            results = await asyncio.gather(*(collect(x) for x in (a, b, big, small)))
            assert [r[-1].state for r in results] == [SUCCEEDED] * 4
            assert c.ar.prefills.index("big") < c.ar.prefills.index("small")
            assert results[2][-1].timings.queue_seconds > 0.25
            await c.wait_pool_free()

    run(body())


def test_fifo_head_is_not_starved_by_smaller_requests() -> None:
    async def body() -> None:
        async with cluster(num_pages=4) as c:
            c.ar.prefill_gate.clear()
            # A 1-page request holds a page; the 4-page head must wait for the whole pool, and
            # 1-page requests behind it must not keep taking the freed pages.
            first = c.api.Generate(request("s", request_id="first", guidance_scale=1.0, seed=1), timeout=20)
            await c.ar.prefill_started.wait()
            head = c.api.Generate(
                request("h" * 15, request_id="head", guidance_scale=1.0, seed=2), timeout=20
            )
            assert (await head.read()).state == QUEUED
            tail = [
                c.api.Generate(request("s", request_id=f"t{i}", guidance_scale=1.0, seed=3), timeout=20)
                for i in range(3)
            ]
            for call in tail:
                assert (await call.read()).state == QUEUED
            assert c.pool().free == 3  # the tail would fit now; FIFO keeps it behind the head
            c.ar.prefill_gate.set()
            results = await asyncio.gather(collect(first), collect(head), *(collect(t) for t in tail))
            assert all(r[-1].state == SUCCEEDED for r in results)
            assert c.ar.prefills[:2] == ["first", "head"]

    run(body())


def test_queued_head_that_no_longer_fits_any_dit_fails_and_unblocks_the_queue() -> None:
    async def body() -> None:
        async with cluster(num_pages=3) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await wait_until(lambda: "run" in c.ar.prefills, what="run prefilling")
            head = c.api.Generate(request(request_id="head", seed=2), timeout=20)  # 3 pages
            small = c.api.Generate(request("s", request_id="small", guidance_scale=1.0, seed=3), timeout=20)
            assert (await head.read()).state == QUEUED
            assert (await small.read()).state == QUEUED
            await c.dit.restart_with(num_pages=1)  # the DiT came back with a 1-page pool
            c.ar.memory = c.dit.memory  # the AR writes into the new incarnation's memory
            final = (await collect(head))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("INVALID_ARGUMENT", "NEVER_FITS")
            c.ar.prefill_gate.set()
            assert (await collect(small))[-1].state == SUCCEEDED  # not blocked behind the head
            # The running request lost its pages with the old DiT incarnation.
            assert (await collect(running))[-1].state == FAILED

    run(body())


def test_queue_full_is_resource_exhausted() -> None:
    async def body() -> None:
        async with cluster(num_pages=3, max_queue=2) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await c.ar.prefill_started.wait()
            waiting = [c.api.Generate(request(request_id=f"w{i}", seed=1), timeout=20) for i in range(2)]
            for call in waiting:
                assert (await call.read()).state == QUEUED
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(request_id="over", seed=1), timeout=5))
            assert error_info(exc.value)[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
            # A cancelled waiter leaves the queue at once (not when it reaches the head).
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="w1"), timeout=5)
            assert c.orchestrator.queue_depth() == 1
            replacement = c.api.Generate(request(request_id="w2", seed=1), timeout=20)
            assert (await replacement.read()).state == QUEUED
            assert (await collect(waiting.pop()))[-1].state == CANCELLED
            waiting.append(replacement)
            # The rejected request was never accepted: its id is free.
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.GetGeneration(S.GetGenerationRequest(request_id="over"), timeout=5)
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            c.ar.prefill_gate.set()
            results = await asyncio.gather(collect(running), *(collect(w) for w in waiting))
            assert all(r[-1].state == SUCCEEDED for r in results)

    run(body())


# ------------------------------------------------------------------- cancellation


async def cancel_and_check(c: Cluster, call: object, request_id: str) -> S.GenerationEvent:
    reply = await c.api.CancelGeneration(S.CancelGenerationRequest(request_id=request_id), timeout=5)
    assert reply.generation.state == CANCELLED
    events = await collect(call)
    final = events[-1]
    assert final.state == CANCELLED
    assert (final.error.code, final.error.reason) == ("CANCELLED", "CANCELLED_BY_CLIENT")
    assert await state_of(c, request_id) == CANCELLED
    return final


def test_cancel_while_tokenizing() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.tokenize_gate.clear()
            call = c.api.Generate(request(request_id="tok", seed=1), timeout=20)
            await wait_until(lambda: c.orchestrator.store.find("tok") is not None, what="admission")
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="tok"), timeout=5)
            c.ar.tokenize_gate.set()
            events = await collect(call)
            assert [e.state for e in events] == [CANCELLED]
            assert c.ar.prefills == [] and c.core.list_tickets() == []
            assert c.orchestrator.queue_depth() == 0
            assert c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1
            # Idempotent: cancelling it again answers the same cancelled generation.
            again = await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="tok"), timeout=5)
            assert again.generation.state == CANCELLED
            assert c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1

    run(body())


def test_dropped_stream_while_tokenizing_is_a_counted_cancel() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.tokenize_gate.clear()
            call = c.api.Generate(request(request_id="tokdrop", seed=1), timeout=20)
            await wait_until(lambda: c.orchestrator.store.find("tokdrop") is not None, what="admission")
            call.cancel()  # the client goes away before its request was admitted
            await wait_until(
                lambda: c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1, what="counted"
            )
            c.ar.tokenize_gate.set()
            snap = c.orchestrator.get("tokdrop")
            assert snap.state.name == "CANCELLED"
            assert snap.error is not None and snap.error.reason == "CLIENT_DISCONNECTED"
            assert c.ar.prefills == [] and c.core.list_tickets() == []
            assert c.orchestrator.queue_depth() == 0

    run(body())


def test_cancel_while_queued() -> None:
    async def body() -> None:
        async with cluster(num_pages=3) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await c.ar.prefill_started.wait()
            queued = c.api.Generate(request(request_id="q", seed=2), timeout=20)
            assert (await queued.read()).state == QUEUED
            await cancel_and_check(c, queued, "q")
            assert c.orchestrator.queue_depth() == 0
            c.ar.prefill_gate.set()
            assert (await collect(running))[-1].state == SUCCEEDED
            assert "q" not in c.ar.prefills  # never placed, never prefilled
            await c.wait_pool_free()

    run(body())


def test_cancel_while_prefilling_rolls_the_ticket_back() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.prefill_gate.clear()
            call = c.api.Generate(request(request_id="p", seed=1), timeout=20)
            await read_until(call, PREFILLING)
            await c.ar.prefill_started.wait()
            final = await cancel_and_check(c, call, "p")
            ticket = c.core.get_ticket(final.ticket_id)
            # Not armed yet: rolled back at once, nothing to drain.
            assert (ticket.state, ticket.outcome, ticket.armed) == (
                TicketState.RELEASED,
                TicketOutcome.CANCELLED,
                False,
            )
            assert c.pool().free == c.pool().total
            c.ar.prefill_gate.set()
            await asyncio.sleep(0.1)
            assert not c.ar.armed.is_set()  # the late prefill could not arm a rolled-back ticket

    run(body())


def test_cancel_while_transferring_drains_before_pages_come_back() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.write_gate.clear()  # armed, writes in flight and unreported
            call = c.api.Generate(request(request_id="t", seed=1), timeout=20)
            await read_until(call, TRANSFERRING)
            final = await cancel_and_check(c, call, "t")  # over for the client at once
            ticket = c.core.get_ticket(final.ticket_id)
            assert ticket.state is TicketState.DRAINING
            held = len(ticket.page_ids)
            await asyncio.sleep(0.2)
            assert c.pool().draining == held  # a remote write may still land: pages stay out
            c.ar.write_gate.set()  # the writes finish and report
            await c.wait_pool_free()
            ticket = c.core.get_ticket(final.ticket_id)
            assert (ticket.state, ticket.outcome) == (TicketState.RELEASED, TicketOutcome.CANCELLED)
            assert all(w.status.value == "OK" for w in ticket.writes)

    run(body())


def test_cancel_while_denoising_stops_the_dit() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="d", seed=1), timeout=20)
            events = await read_until(call, DENOISING)
            assert events[-1].step == 0
            assert c.core.get_ticket(events[-1].ticket_id).state is TicketState.CONSUMING
            final = await cancel_and_check(c, call, "d")
            # The DiT saw its stream cancelled and released the ticket CANCELLED.
            await c.wait_pool_free()
            assert c.dit.released == [(final.ticket_id, 2)]  # TICKET_OUTCOME_CANCELLED
            ticket = c.core.get_ticket(final.ticket_id)
            assert (ticket.state, ticket.outcome) == (TicketState.RELEASED, TicketOutcome.CANCELLED)

    run(body())


@pytest.mark.parametrize("stage", ["transferring", "denoising"])
def test_operator_cancel_ticket_ends_the_generation_cancelled(stage: str) -> None:
    # Found black-box: an operator's CancelTicket on a ticket the DiT was reading (CONSUMING) only
    # marked the ticket; the DiT read on and the generation ended SUCCEEDED.
    async def body() -> None:
        async with cluster() as c:
            if stage == "transferring":
                c.ar.write_gate.clear()
            else:
                c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="op", seed=1), timeout=20)
            events = await read_until(call, TRANSFERRING if stage == "transferring" else DENOISING)
            ticket_id = c.orchestrator.get("op").ticket_id
            broker = broker_pb2_grpc.BrokerServiceStub(c.channel)
            reply = await broker.CancelTicket(
                broker_pb2.CancelTicketRequest(ticket_id=ticket_id, reason="operator says stop"), timeout=5
            )
            # The cancel frees nothing the DiT may read or a write may still land in.
            held = TicketState.DRAINING if stage == "transferring" else TicketState.CONSUMING
            assert reply.ticket.state == broker_pb2.TicketState.Value(f"TICKET_STATE_{held.name}")
            final = (events + await collect(call))[-1]
            assert final.state == CANCELLED
            assert (final.error.code, final.error.reason) == ("CANCELLED", "TICKET_CANCELLED")
            assert "operator says stop" in final.error.message
            c.ar.write_gate.set()
            c.dit.step_gate.set()
            await c.wait_pool_free()
            ticket = c.core.get_ticket(ticket_id)
            assert (ticket.state, ticket.outcome) == (TicketState.RELEASED, TicketOutcome.CANCELLED)
            if stage == "denoising":
                assert c.dit.released == [(ticket_id, broker_pb2.TICKET_OUTCOME_CANCELLED)]
            assert c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1

    run(body())


def test_cancel_ticket_errors_are_unchanged_by_the_generation_hook() -> None:
    async def body() -> None:
        async with cluster() as c:
            broker = broker_pb2_grpc.BrokerServiceStub(c.channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await broker.CancelTicket(
                    broker_pb2.CancelTicketRequest(ticket_id="nope", outcome=broker_pb2.TICKET_OUTCOME_OK), timeout=5
                )
            assert error_info(info.value)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_OUTCOME")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await broker.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id="nope"), timeout=5)
            assert error_info(info.value)[:2] == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_TICKET")

    run(body())


@pytest.mark.parametrize("stage", ["queued", "prefilling", "transferring", "denoising"])
def test_dropped_stream_cancels_the_generation(stage: str) -> None:
    async def body() -> None:
        async with cluster(num_pages=3) as c:
            blocker = None
            if stage == "queued":
                c.ar.prefill_gate.clear()
                blocker = c.api.Generate(request(request_id="blocker", seed=9), timeout=20)
                await c.ar.prefill_started.wait()
            elif stage == "prefilling":
                c.ar.prefill_gate.clear()
            elif stage == "transferring":
                c.ar.write_gate.clear()
            else:
                c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="drop", seed=1), timeout=20)
            target = {"queued": QUEUED, "prefilling": PREFILLING, "transferring": TRANSFERRING}.get(
                stage, DENOISING
            )
            await read_until(call, target)
            call.cancel()  # the client goes away
            await wait_until(lambda: c.orchestrator.get("drop").state.name == "CANCELLED", what="cancelled")
            snap = c.orchestrator.get("drop")
            assert snap.error is not None and snap.error.reason == "CLIENT_DISCONNECTED"
            c.ar.prefill_gate.set()
            c.ar.write_gate.set()
            c.dit.step_gate.set()
            if blocker is not None:
                assert (await collect(blocker))[-1].state == SUCCEEDED
            await c.wait_pool_free()
            assert c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1

    run(body())


# ------------------------------------------------------------------ failures, deadlines


def test_ar_replica_unavailable_fails_the_generation() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.fail_prefill = KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "worker rank died"
            )
            events = await collect(c.api.Generate(request(request_id="f", seed=1), timeout=10))
            final = events[-1]
            assert final.state == FAILED
            assert final.error.code == "UNAVAILABLE"
            assert "ar-0" in final.error.message
            ticket = c.core.get_ticket(final.ticket_id)
            assert (ticket.outcome, ticket.reason) == (TicketOutcome.FAILED, "REPLICA_UNAVAILABLE")
            await c.wait_pool_free()
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 1

    run(body())


def test_ar_dying_mid_transfer_is_unavailable_not_transfer_failed() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.fail_after_arming = KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "rank 0 died during the write"
            )
            final = (await collect(c.api.Generate(request(request_id="mid", seed=1), timeout=10)))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
            assert c.core.get_ticket(final.ticket_id).outcome is TicketOutcome.FAILED
            await c.wait_pool_free()  # every write resolved (FAILED): released after the quiet period

    run(body())


def test_prefill_failure_is_named_not_the_dits_ticket_ended() -> None:
    async def body() -> None:
        async with cluster() as c:
            # The AR rolls its ticket back before its error reaches the broker: the DiT, watching
            # the ticket, fails TICKET_ENDED first. The request names the cause.
            c.ar.fail_prefill = KvRelayServerError(
                grpc.StatusCode.INTERNAL, "PREFILL_FAILED", "rank 0: the model raised"
            )
            c.ar.rollback_before_failing_s = 0.3
            final = (await collect(c.api.Generate(request(request_id="pf", seed=1), timeout=10)))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("INTERNAL", "PREFILL_FAILED")
            assert "the model raised" in final.error.message
            await c.wait_pool_free()

    run(body())


def test_dit_replica_down_fails_with_unavailable() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="down", seed=1), timeout=10)
            await read_until(call, DENOISING)
            await c.dit.stop()  # the DiT process goes away mid-request
            final = (await collect(call))[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
            assert "dit-0" in final.error.message
            assert c.core.get_ticket(final.ticket_id).outcome is TicketOutcome.FAILED

    run(body())


def test_image_is_served_when_the_prefill_reply_is_late(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.broker import pipeline

    monkeypatch.setattr(pipeline, "PREFILL_REPLY_GRACE_SECONDS", 0.2)

    async def body() -> None:
        async with cluster() as c:
            c.ar.reply_gate.clear()  # writes reported, the reply never comes
            events = await collect(c.api.Generate(request(request_id="late-reply", seed=1), timeout=10))
            final = events[-1]
            assert final.state == SUCCEEDED
            assert final.timings.prefill_seconds == 0 and final.timings.load_seconds > 0
            await c.wait_pool_free()

    run(body())


def test_transfer_timeout_is_deadline_exceeded() -> None:
    async def body() -> None:
        async with cluster(transfer_timeout=0.3) as c:
            c.ar.write_gate.clear()  # the rows never land within the DiT's transfer_timeout
            events = await collect(c.api.Generate(request(request_id="slow", seed=1), timeout=10))
            final = events[-1]
            assert final.state == FAILED
            assert (final.error.code, final.error.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT")
            ticket = c.core.get_ticket(final.ticket_id)
            assert ticket.state is TicketState.DRAINING  # armed writes are unresolved
            c.ar.write_gate.set()
            await c.wait_pool_free()

    run(body())


def test_client_deadline_travels_into_prefill_and_denoise() -> None:
    async def body() -> None:
        async with cluster() as c:
            await collect(c.api.Generate(request(seed=1), timeout=7))
            await collect(c.api.Generate(request(seed=1)))  # no client deadline
            (with_deadline, without) = c.ar.deadlines
            assert with_deadline is not None and 5.0 < with_deadline <= 7.1
            # Without one, the stage's request_timeout_seconds (20 in the test config).
            assert without is not None and 18.0 < without <= 20.1
            (dit_with, dit_without) = c.dit.deadlines
            assert dit_with is not None and 5.0 < dit_with <= 7.1
            assert dit_without is not None and 18.0 < dit_without <= 20.1

    run(body())


def test_deadline_while_queued_fails_deadline_exceeded() -> None:
    async def body() -> None:
        async with cluster(num_pages=3) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await c.ar.prefill_started.wait()
            # Long enough to reach the broker on a loaded CI machine (it must queue there).
            late = c.api.Generate(request(request_id="late", seed=1), timeout=2.0)
            try:
                events = await collect(late)
            except grpc.aio.AioRpcError as err:
                # The call's own deadline won the race with the broker's queue timer.
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                assert events[-1].state == FAILED
                assert events[-1].error.code == "DEADLINE_EXCEEDED"
            await wait_until(lambda: c.orchestrator.get("late").state.terminal, what="late ended")
            snap = c.orchestrator.get("late")
            assert snap.state.name == "FAILED" and snap.error is not None
            assert snap.error.code == "DEADLINE_EXCEEDED"
            c.ar.prefill_gate.set()
            assert (await collect(running))[-1].state == SUCCEEDED
            assert "late" not in c.ar.prefills
            await c.wait_pool_free()

    run(body())


def test_a_stream_ending_just_before_its_deadline_ended_with_it() -> None:
    """The client's deadline fires a little before the broker's copy (which runs from the call's
    arrival): a queued generation whose stream ends within CLIENT_DEADLINE_SLACK_S of its deadline
    is FAILED DEADLINE_EXCEEDED, not a client's cancel (seen on a loaded machine)."""
    from kvrelay.broker.generations import CLIENT_DEADLINE_SLACK_S

    async def body() -> None:
        async with cluster(num_pages=3) as c:
            c.ar.prefill_gate.clear()
            running = c.api.Generate(request(request_id="run", seed=1), timeout=20)
            await c.ar.prefill_started.wait()
            late = c.api.Generate(request(request_id="late", seed=1), timeout=3.0)
            await wait_until(lambda: c.orchestrator.store.find("late") is not None, what="late queued")
            # What a client's deadline looks like to the broker: the stream ends, its deadline
            # (the broker's copy) a moment ahead.
            await asyncio.sleep(3.0 - CLIENT_DEADLINE_SLACK_S / 2 - 0.05)
            late.cancel()
            await wait_until(lambda: c.orchestrator.get("late").state.terminal, what="late ended")
            snap = c.orchestrator.get("late")
            assert snap.state.name == "FAILED" and snap.error is not None, snap
            assert snap.error.code == "DEADLINE_EXCEEDED"
            c.ar.prefill_gate.set()
            assert (await collect(running))[-1].state == SUCCEEDED
            await c.wait_pool_free()

    run(body())


def test_no_replica_is_unavailable() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.core.deregister_replica(c.ar.replica_id, c.ar.incarnation_id)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(seed=1), timeout=5))
            assert error_info(exc.value)[:2] == (grpc.StatusCode.UNAVAILABLE, "NO_AR_REPLICA")

    run(body())


def test_many_concurrent_generations_all_succeed_and_pages_return() -> None:
    async def body() -> None:
        async with cluster(num_pages=7, max_queue=32, step_seconds=0.001) as c:
            calls = [
                c.api.Generate(request(f"prompt {i}", request_id=f"m{i}", seed=i), timeout=30)
                for i in range(20)
            ]
            results = await asyncio.gather(*(collect(x) for x in calls))
            assert [r[-1].state for r in results] == [SUCCEEDED] * 20
            assert sorted(c.ar.prefills) == sorted(f"m{i}" for i in range(20))
            await c.wait_pool_free()
            assert c.metric("kvrelay_generations_total", {"outcome": "succeeded"}) == 20

    run(body())


@pytest.mark.parametrize("order", ["prefill_first", "denoise_first"])
def test_the_ars_cause_wins_when_both_stages_fail_in_the_same_round(order: str) -> None:
    """Both stage calls finished before the pipeline looked (a loaded machine: the AR rolled its
    ticket back, the DiT answered TICKET_ENDED and the AR PREFILL_FAILED within a few ms): the
    request names the AR's cause, whatever order the tasks finished in. Before, the echo check ran
    only while the Prefill was still pending, and the set's order picked TICKET_ENDED (a vLLM
    node test failed so in CI)."""
    from kvrelay.broker.generations import ErrorInfo, RequestEnded
    from kvrelay.broker.pipeline import raise_first_failure

    async def fail(reason: str) -> None:
        raise RequestEnded(ErrorInfo("ABORTED" if reason == "TICKET_ENDED" else "INTERNAL", reason, reason))

    async def body() -> None:
        first, second = ("PREFILL_FAILED", "TICKET_ENDED") if order == "prefill_first" else ("TICKET_ENDED", "PREFILL_FAILED")
        tasks = {name: asyncio.create_task(fail(name)) for name in (first, second)}
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        prefill, denoise = tasks["PREFILL_FAILED"], tasks["TICKET_ENDED"]
        for done in ({prefill, denoise}, {denoise, prefill}):
            with pytest.raises(RequestEnded) as ended:
                await raise_first_failure(done, prefill, denoise)
            assert ended.value.error.reason == "PREFILL_FAILED"
        # The DiT's own failure (no echo of the writer) stays the DiT's.
        dit_down = asyncio.create_task(fail("REPLICA_UNAVAILABLE"))
        await asyncio.gather(dit_down, return_exceptions=True)
        with pytest.raises(RequestEnded) as ended:
            await raise_first_failure({dit_down, prefill}, prefill, dit_down)
        assert ended.value.error.reason == "REPLICA_UNAVAILABLE"

    asyncio.run(body())
