"""BrokerService.CreateTicket (operator, debugging) next to the orchestrator: it refuses a request
id that names a generation (the orchestrator makes that generation's tickets under it) and more
rows than a request has (2 CFG rows), docs/broker.md, gRPC status codes and reasons."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2

from .harness import cluster, collect, request, run


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
