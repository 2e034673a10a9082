"""BrokerService.CreateTicket (operator, debugging) next to the orchestrator: it refuses a request
id that names a generation (the orchestrator makes that generation's tickets under it) and more
rows than a request has (2 CFG rows); Generate refuses the id of a live hand-made ticket, race-free
and across a restart; docs/broker.md, gRPC status codes and reasons."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvrelay.broker.tickets import AlreadyExists, TicketOutcome, TicketState, WriteStatus
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2

from .harness import cluster, collect, request, run
from .test_replica_retry import _reopened

SUCCEEDED = generation_pb2.GENERATION_STATE_SUCCEEDED


async def _refused(call: object) -> tuple[str, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return reason_of(info.value)


def test_create_ticket_refuses_a_generations_request_id_and_more_than_two_rows() -> None:
    async def body() -> None:
        async with cluster() as c:
            stub = broker_pb2_grpc.BrokerServiceStub(c.channel)

            def create(request_id: str, counts: list[int]) -> object:
                return stub.CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id=request_id, ar_replica_id=c.ar.replica_id, dit_replica_id=c.dit.replica_id,
                    row_token_counts=counts), timeout=10)  # fmt: skip

            free = c.pool().free
            c.dit.step_gate.clear()
            live = c.api.Generate(request(request_id="req-live", seed=1), timeout=20)
            assert (await live.read()).state == generation_pb2.GENERATION_STATE_QUEUED
            await c.dit.loaded.wait()
            # The generation holds its ticket: the same rows would have returned that ticket to
            # the caller, other rows TICKET_EXISTS; either way the id is the generation's.
            (held,) = [t for t in c.core.list_tickets() if t.request_id == "req-live"]
            code, reason, message = await _refused(create("req-live", [r.num_tokens for r in held.rows]))
            assert (code, reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED"), message
            assert "'req-live' names a generation" in message, message
            assert any(f"({state})" in message for state in ("TRANSFERRING", "DENOISING")), message
            c.dit.step_gate.set()
            assert (await collect(live))[-1].state == generation_pb2.GENERATION_STATE_SUCCEEDED
            # Finished and still held (result_ttl_seconds): a Generate of it attaches, so it stays taken.
            code, reason, message = await _refused(create("req-live", [4]))
            assert (code, reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED") and "SUCCEEDED" in message, message
            await c.wait_pool_free()

            # Rows: at most 2 (prompt, negative prompt); nothing is reserved for a refused call.
            for counts in ([4, 4, 4], [1] * 9):
                code, reason, message = await _refused(create("req-rows", counts))
                assert (code, reason) == ("INVALID_ARGUMENT", "INVALID_ROWS"), message
                assert f"{len(counts)} rows" in message and "at most 2 CFG rows" in message, message
            assert c.pool().free == free
            # An id of its own and 1 or 2 rows: a ticket; the same call again returns it, other rows refuse.
            one = (await create("req-own", [4, 4])).ticket  # type: ignore[attr-defined]
            assert [r.num_tokens for r in one.rows] == [4, 4]
            assert (await create("req-own", [4, 4])).ticket.ticket_id == one.ticket_id  # type: ignore[attr-defined]
            code, reason, message = await _refused(create("req-own", [4]))
            assert (code, reason) == ("ALREADY_EXISTS", "TICKET_EXISTS"), message
            assert (await create("req-single", [4])).ticket.rows[0].num_tokens == 4  # type: ignore[attr-defined]

    run(body())


def test_generate_refuses_a_request_id_held_by_a_live_hand_made_ticket_and_takes_it_once_that_is_over() -> None:
    """The other way round: Generate (and every resubmission of it, as an SDK retries) refuses the
    id of a ticket made with CreateTicket while that ticket's request is live, ALREADY_EXISTS
    REQUEST_ID_REUSED, accepting nothing and holding no queue; once its request is over (released,
    or ended while its pages drain) the id is free, and the generation gets pages of its own."""

    async def body() -> None:
        async with cluster() as c:
            stub = broker_pb2_grpc.BrokerServiceStub(c.channel)

            async def create(request_id: str) -> Any:
                return (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id=request_id, ar_replica_id=c.ar.replica_id, dit_replica_id=c.dit.replica_id,
                    row_token_counts=[4]), timeout=10)).ticket  # fmt: skip

            hand = await create("req-hand")
            for _ in range(2):  # a resubmission is refused the same way
                code, reason, message = await _refused(c.api.Generate(request(request_id="req-hand", seed=1), timeout=10).read())
                assert (code, reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED"), message
                assert hand.ticket_id in message and "CreateTicket" in message and "RESERVED" in message, message
            # Nothing was accepted under the id, the ticket is untouched, and the queue moves on.
            code, reason, _ = await _refused(c.api.GetGeneration(generation_pb2.GetGenerationRequest(request_id="req-hand"), timeout=10))
            assert code == "NOT_FOUND", reason
            assert c.core.get_ticket(hand.ticket_id).state is TicketState.RESERVED
            assert (await create("req-hand")).ticket_id == hand.ticket_id
            assert (await collect(c.api.Generate(request(request_id="other", seed=2), timeout=20)))[-1].state == SUCCEEDED

            # Released (its operator cancels it, or it expires: the same core call): the id is free.
            await stub.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=hand.ticket_id), timeout=10)
            final = (await collect(c.api.Generate(request(request_id="req-hand", seed=1), timeout=20)))[-1]
            assert final.state == SUCCEEDED, final.error

            # Armed, then over while a write may still land (DRAINING): the id is free too, and the
            # generation's ticket takes other pages while the hand-made one keeps its own.
            drain = await create("req-drain")
            c.core.arm_ticket(drain.ticket_id, c.ar.replica_id, c.ar.incarnation_id)
            code, reason, message = await _refused(c.api.Generate(request(request_id="req-drain", seed=4), timeout=10).read())
            assert (code, reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED") and "WRITING" in message, message
            c.core.cancel_ticket(drain.ticket_id, TicketOutcome.CANCELLED, "by hand")
            assert c.core.get_ticket(drain.ticket_id).state is TicketState.DRAINING
            final = (await collect(c.api.Generate(request(request_id="req-drain", seed=4), timeout=20)))[-1]
            assert final.state == SUCCEEDED, final.error
            held = c.core.get_ticket(drain.ticket_id)
            assert held.state is TicketState.DRAINING and held.by_hand
            assert c.pool().reserved + c.pool().draining == len(held.page_ids)
            # The generation holds the id now: CreateTicket refuses it (its generation is held).
            code, reason, _ = await _refused(create("req-drain"))
            assert (code, reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED")
            for key in held.unresolved_writes():
                c.core.report_write(drain.ticket_id, key, replica_id=c.ar.replica_id,
                                    incarnation_id=c.ar.incarnation_id, status=WriteStatus.NOT_STARTED)  # fmt: skip
            await c.wait_pool_free()

    run(body())


def test_a_hand_made_ticket_and_a_generation_never_both_take_one_request_id_when_they_race() -> None:
    """CreateTicket and Generate of the same id at once, either first: exactly one wins."""

    async def body() -> None:
        async with cluster() as c:
            stub = broker_pb2_grpc.BrokerServiceStub(c.channel)
            c.dit.step_gate.clear()  # accepted generations stay live while the other call runs

            async def create(request_id: str) -> bool:
                try:
                    await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                        request_id=request_id, ar_replica_id=c.ar.replica_id, dit_replica_id=c.dit.replica_id,
                        row_token_counts=[4]), timeout=10)  # fmt: skip
                except grpc.aio.AioRpcError as err:
                    assert reason_of(err)[:2] == ("ALREADY_EXISTS", "REQUEST_ID_REUSED"), reason_of(err)
                    return False
                return True

            async def generate(request_id: str) -> bool:
                call = c.api.Generate(request(request_id=request_id, seed=1), timeout=20)
                try:
                    assert (await call.read()).state == generation_pb2.GENERATION_STATE_QUEUED
                except grpc.aio.AioRpcError as err:
                    assert reason_of(err)[:2] == ("ALREADY_EXISTS", "REQUEST_ID_REUSED"), reason_of(err)
                    return False
                calls.append(call)
                return True

            calls: list[Any] = []
            winners = []
            for i in range(8):
                rid = f"race-{i}"
                pair = [create(rid), generate(rid)] if i % 2 else [generate(rid), create(rid)]
                won = await asyncio.gather(*pair)
                winners.append(won)
                assert sum(won) == 1, (rid, won)
            assert calls, winners  # each side won some
            assert len(calls) < len(winners), winners
            c.dit.step_gate.set()
            for call in calls:
                assert (await collect(call))[-1].state == SUCCEEDED
            for t in c.core.list_tickets():
                assert t.by_hand, t
                c.core.cancel_ticket(t.ticket_id, TicketOutcome.CANCELLED, "by hand")
            await c.wait_pool_free()

    run(body())


def test_a_tickets_kind_is_journaled_so_ids_keep_their_owner_across_a_broker_restart(tmp_path: Any) -> None:
    """After a restart no request is live (the restart ends each, hand-made ones too), so no
    hand-made ticket refuses a generation; but the kind is restored: a generation goes beside a
    hand-made ticket that still drains, and the core itself refuses a CreateTicket of the id of a
    generation's ticket that drains (the generation's record may be gone: forgotten after
    result_ttl_seconds, or live at a kill)."""
    path = str(tmp_path / "journal.sqlite")

    async def body() -> tuple[str, str]:
        async with cluster(journal_path=path) as c:
            hand = c.core.create_ticket("hand", c.ar.replica_id, c.dit.replica_id, [4], by_hand=True)
            assert hand is not None
            c.core.arm_ticket(hand.ticket_id, c.ar.replica_id, c.ar.incarnation_id)
            # A generation's ticket (as the orchestrator makes it) whose write is in doubt when the
            # broker stops: it drains across the restart, its generation not held.
            gen = c.core.create_ticket("gen", c.ar.replica_id, c.dit.replica_id, [4])
            assert gen is not None
            c.core.arm_ticket(gen.ticket_id, c.ar.replica_id, c.ar.incarnation_id)
            c.core.cancel_ticket(gen.ticket_id, TicketOutcome.FAILED, "TRANSFER_TIMEOUT")
            return hand.ticket_id, gen.ticket_id

    hand_id, gen_id = run(body())
    core, store = _reopened(path)
    try:
        hand = core.get_ticket(hand_id)
        assert hand.by_hand and hand.request_over and hand.state is TicketState.DRAINING, hand
        gen = core.get_ticket(gen_id)
        assert not gen.by_hand and gen.state is TicketState.DRAINING, gen
        core.check_generation_id("hand")  # over: the id is free for a generation
        with pytest.raises(AlreadyExists) as info:
            core.create_ticket("gen", "ar-0", "dit-0", [4], by_hand=True)
        assert info.value.reason == "REQUEST_ID_REUSED" and gen_id in info.value.message
    finally:
        core.close()
