"""Hostile callers found black-box against a running node (docs/operations.md, Security).

Each test replays one finding against real servers and fails without its fix.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvrelay.broker.pipeline import LINK_DEADLINE_SLACK_SECONDS
from kvrelay.broker.tickets import TicketState
from kvrelay.errors import MAX_ERROR_MESSAGE_CHARS, reason_of
from kvrelay.security import REPLICA_ID_METADATA, CallerClass
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2, dit_pb2, dit_pb2_grpc, generation_pb2
from tests.dit_service.harness import ArWriter, inprocess_broker, start_dit, wait_serving, write_config
from tests.orchestrator.harness import cluster, collect, request, run
from tests.security.harness import CREDENTIALS, secured_deployment


async def _put(stub: dit_pb2_grpc.DitServiceStub, chunk: dit_pb2.PutKvRequest, replica_id: str) -> dit_pb2.PutKvResponse:
    async def one():  # type: ignore[no-untyped-def]
        yield chunk

    return await stub.PutKv(one(), metadata=((REPLICA_ID_METADATA, replica_id),), timeout=10.0)


@pytest.mark.slow
def test_putkv_from_another_ar_replica_lands_nothing(tmp_path: Path) -> None:
    """PutKv checked only that its caller was *an* AR replica: `ar-1` wrote into the pages of a
    ticket armed for `ar-0` while ar-0's writes ran (found black-box with the replica token and
    `kvrelay-replica-id: ar-1`; under mutual TLS, ar-1's own certificate). Now the caller must be
    the ticket's AR replica: FAILED_PRECONDITION WRONG_REPLICA, and nothing of it lands."""
    config = write_config(tmp_path, transport="grpc")

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "grpc")
                await writer.register()
                ticket = await writer.create_ticket([20])
                armed = await writer.arm(ticket.ticket_id)
                segment = armed.writes[0].segments[0]
                chunk = dit_pb2.PutKvRequest(ticket_id=ticket.ticket_id, row=0, dst_rank=0,
                                             dst_offset=segment.dst_offset, data=b"\x01" * 64)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    stub = dit_pb2_grpc.DitServiceStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _put(stub, chunk, "ar-1")
                    assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "WRONG_REPLICA")
                    assert "written by AR ar-0, not ar-1" in (info.value.details() or "")
                    # The ticket's own AR still writes (the refusal claimed no page for it).
                    reply = await _put(stub, chunk, "ar-0")
                    assert (reply.bytes_received, reply.chunks_received) == (64, 1)
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_a_client_deadline_that_cuts_a_transfer_short_does_not_make_the_link_suspect() -> None:
    """A public client sending requests with 0.3 s deadlines had every AR/DiT pair they were placed
    on marked suspect (the DiT's load wait, bounded by the deadline, ends TRANSFER_TIMEOUT), so
    placement could no longer tell a broken link from a healthy one. A transfer that fails within
    LINK_DEADLINE_SLACK_SECONDS of the client's deadline now judges nothing; one that fails with
    time left still marks the pair (the control)."""

    async def body() -> None:
        async with cluster(transfer_timeout=0.3) as c:
            c.ar.write_gate.clear()  # the KV never lands: the DiT's wait ends TRANSFER_TIMEOUT
            # Control: 30 s left when the DiT gives up after its 0.3 s transfer_timeout.
            events = await collect(c.api.Generate(request("a far deadline"), timeout=30))
            assert events[-1].error.reason == "TRANSFER_TIMEOUT"
            assert c.core.link_suspect("ar-0", "dit-0")
            c.core.note_transfer_ok("ar-0", "dit-0")
            # The client's deadline is about to pass as the DiT gives up: the orchestrator's clock
            # jumps to leave 0.5 s once the DiT began waiting, so it fails with ~0.2 s left.
            c.dit.denoise_started.clear()
            call = c.api.Generate(request("a near deadline"), timeout=30)
            events_task = asyncio.ensure_future(collect(call))
            await c.dit.denoise_started.wait()
            c.clock_offset[0] = 30 - 0.5
            events = await events_task
            final = events[-1]
            assert final.state == generation_pb2.GENERATION_STATE_FAILED
            assert final.error.reason == "TRANSFER_TIMEOUT"
            assert 0.5 - 0.3 <= LINK_DEADLINE_SLACK_SECONDS
            assert not c.core.link_suspect("ar-0", "dit-0")

    run(body(), timeout=60)


def test_a_release_or_cancel_with_no_real_outcome_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """ReleaseTicket with outcome UNSPECIFIED or 99 (found black-box with grpcurl as dit-0) released
    the ticket recorded OK, although it was never even armed; CancelTicket took 99 as CANCELLED.
    Both are now INVALID_ARGUMENT INVALID_OUTCOME, and the ticket keeps its pages."""
    with secured_deployment(tmp_path) as d:
        operator = d.operator()
        incarnation = d.core.get_replica("dit-0").spec.incarnation_id
        ticket = operator.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id="outcome-probe", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[3]),
            timeout=10).ticket  # fmt: skip
        with d.channel("broker", CREDENTIALS.channel(CallerClass.REPLICA, "dit-0")) as channel:
            dit = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            for outcome in (broker_pb2.TICKET_OUTCOME_UNSPECIFIED, 99):
                with pytest.raises(grpc.RpcError) as info:
                    dit.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
                        ticket_id=ticket.ticket_id, outcome=outcome, replica_id="dit-0",  # type: ignore[arg-type]
                        incarnation_id=incarnation), timeout=10)  # fmt: skip
                assert reason_of(info.value)[:2] == ("INVALID_ARGUMENT", "INVALID_OUTCOME")  # type: ignore[arg-type]
        with pytest.raises(grpc.RpcError) as info:
            operator.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=ticket.ticket_id, outcome=99),  # type: ignore[arg-type]
                                  timeout=10)  # fmt: skip
        assert reason_of(info.value)[:2] == ("INVALID_ARGUMENT", "INVALID_OUTCOME")  # type: ignore[arg-type]
        assert d.core.get_ticket(ticket.ticket_id).state is TicketState.RESERVED
        # Left out, CancelTicket's outcome is still CANCELLED.
        cancelled = operator.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=ticket.ticket_id), timeout=10)
        assert cancelled.ticket.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED


def test_a_detached_generation_that_ends_leaves_nothing_behind() -> None:
    """A Generate stream that ended early with detach_timeout_seconds 3600 left a timer holding its
    generation (the image included) for the whole hour, even after the generation finished and
    result_ttl_seconds/max_results forgot it: a client could pin an hour of images in the broker
    by dropping every stream at once. The wait now ends with the generation."""

    async def body() -> None:
        async with cluster(max_results=1, result_ttl_seconds=0) as c:
            assert c.generation is not None
            c.dit.step_gate.clear()  # hold the generation at DENOISING
            call = c.api.Generate(request("dropped at once", detach_timeout_seconds=3600), timeout=30)
            while (await call.read()).state != generation_pb2.GENERATION_STATE_DENOISING:
                pass
            call.cancel()
            for _ in range(200):
                if c.generation._detached:
                    break
                await asyncio.sleep(0.01)
            (request_id,) = c.generation._detached
            record = c.orchestrator.store.get(request_id)
            c.dit.step_gate.set()
            await asyncio.wait_for(record.done.wait(), 10)
            assert record.state.name == "SUCCEEDED"  # detached, not cancelled
            for _ in range(200):
                if not c.generation._detached:
                    break
                await asyncio.sleep(0.01)
            assert c.generation._detached == {}

    run(body(), timeout=60)


def test_an_error_that_echoes_a_huge_input_still_reaches_the_caller(tmp_path: Path) -> None:
    """RegisterReplica with a 100 kB `replica.endpoint` (found black-box): the broker's answer
    (UNREACHABLE_ENDPOINT, naming the endpoint) was bigger than the caller's metadata limit, so the
    caller got RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead. Status
    messages are now cut to MAX_ERROR_MESSAGE_CHARS, saying how much was cut. The endpoint itself is
    now bounded too (512 characters, FIELD_TOO_LONG before it is dialled); an endpoint within the
    bound still makes an answer longer than the cut."""
    from tests.broker.test_grpc import replica

    info = replica("ar-2", common_pb2.REPLICA_ROLE_AR, num_pages=0)
    with secured_deployment(tmp_path) as d:
        with d.channel("broker", CREDENTIALS.channel(CallerClass.REPLICA, "ar-2")) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            info.endpoint = "a" * 100_000 + ":1"
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=30)
            code, reason, message = reason_of(err.value)  # type: ignore[arg-type]
            assert (code, reason) == ("INVALID_ARGUMENT", "FIELD_TOO_LONG"), message
            assert message == "replica.endpoint: 100002 characters, at most 512"
            info.endpoint = "a" * 500 + ":1"
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=30)
        code, reason, message = reason_of(err.value)  # type: ignore[arg-type]
        assert (code, reason) == ("INVALID_ARGUMENT", "UNREACHABLE_ENDPOINT"), message
        assert message.startswith("replica.endpoint: ar-2 advertises aaaa")
        assert len(message) <= MAX_ERROR_MESSAGE_CHARS + 40 and message.endswith(" more characters)")
        assert "ar-2" not in {r.replica_id for r in d.operator().ListReplicas(
            broker_pb2.ListReplicasRequest(), timeout=10).replicas}  # fmt: skip


def test_a_replicas_huge_reason_is_kept_cut(tmp_path: Path) -> None:
    """ReleaseTicket with a 1 MB `reason` (found black-box as dit-0): the broker kept it whole in
    the ticket, its journal row and its released history (4096 tickets), and sent it in every
    GetTicket/ListTickets. Reasons and write messages are now kept cut as status messages are."""
    with secured_deployment(tmp_path) as d:
        operator = d.operator()
        incarnation = d.core.get_replica("dit-0").spec.incarnation_id
        ticket = operator.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id="reason-probe", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[3]),
            timeout=10).ticket  # fmt: skip
        with d.channel("broker", CREDENTIALS.channel(CallerClass.REPLICA, "dit-0")) as channel:
            dit = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            dit.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
                ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_FAILED, reason="r" * (1 << 20),
                replica_id="dit-0", incarnation_id=incarnation), timeout=10)  # fmt: skip
        kept = operator.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket.ticket_id), timeout=10).ticket
        assert kept.state == broker_pb2.TICKET_STATE_RELEASED
        assert kept.reason.startswith("r" * 100) and kept.reason.endswith(" more characters)")
        assert len(kept.reason) <= MAX_ERROR_MESSAGE_CHARS + 40


def test_a_peer_that_never_reads_its_images_cannot_starve_the_other_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One api client that left a few GetGeneration calls for a large image unread (a raw HTTP/2
    peer announcing a window of 0, from 127.0.0.2) held the whole image reply budget for as long
    as it kept its connection: every other client's image failed IMAGE_REPLY_BUDGET_EXHAUSTED.
    Now one peer host holds at most a quarter of the budget; the others are served."""
    import kvrelay.broker.generation as generation
    from tests.orchestrator.test_image_replies import _unread_calls

    monkeypatch.setattr(generation, "IMAGE_REPLY_WAIT_SECONDS", 0.2)

    async def body() -> None:
        async with cluster() as c:
            assert c.generation is not None
            events = await collect(c.api.Generate(request(request_id="img", seed=1), timeout=10))
            png = events[-1].image.png
            budget = c.generation.image_budget
            budget.limit_bytes = 4 * len(png)  # four images; one peer's share: one
            get = generation_pb2.GetGenerationRequest(request_id="img")
            host, port = c.target.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
            writer.write(_unread_calls(c.target, "/kvrelay.v1.GenerationService/GetGeneration",
                                       get.SerializeToString(), 6))  # fmt: skip
            await writer.drain()
            for _ in range(200):
                if budget.held_bytes:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the rest of its calls wait, then are refused
            assert budget.held_bytes == len(png)
            for _ in range(3):  # a client that reads gets its image, again and again
                got = await c.api.GetGeneration(get, timeout=5)
                assert got.generation.image.png == png
            final = (await collect(c.api.Generate(request(request_id="img", seed=1), timeout=5)))[-1]
            assert final.image.png == png
            writer.close()
            await writer.wait_closed()
            for _ in range(200):
                if not budget.held_bytes:
                    break
                await asyncio.sleep(0.01)
            assert budget.held_bytes == 0 and budget.held_by_peer == {}

    run(body(), timeout=60)
