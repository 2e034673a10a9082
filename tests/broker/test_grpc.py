"""BrokerService over real gRPC on loopback (port 0): every RPC, status codes and ErrorInfo reasons,
WatchTicket streaming, and the metrics the collector exposes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from kvrelay import LAYOUT_VERSION
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.metrics import register_broker_metrics
from kvrelay.broker.service import add_broker_servicer
from kvrelay.broker.tickets import TicketState
from kvrelay.broker.waiters import run_maintenance
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

TIMEOUT = 10.0


def replica(replica_id: str, role: int, *, tp: int = 1, num_pages: int = 0, heads: int = 4) -> broker_pb2.ReplicaInfo:
    return broker_pb2.ReplicaInfo(
        replica_id=replica_id,
        role=role,  # type: ignore[arg-type]
        incarnation_id=f"{replica_id}-inc-1",
        layout_version=LAYOUT_VERSION,
        version="test",
        endpoint="127.0.0.1:1",
        geometry=common_pb2.KvGeometry(num_layers=2, num_kv_heads=heads, head_dim=8,
                                       dtype=common_pb2.DTYPE_BFLOAT16, page_size=16),
        parallelism=common_pb2.Parallelism(tensor_parallel_size=tp, sequence_parallel_size=1),
        regions=[common_pb2.MemoryRegion(rank=r, transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
                                         endpoint=f"127.0.0.1:{7000 + r}", base_address=4096, length=1 << 20)
                 for r in range(tp if role == common_pb2.REPLICA_ROLE_DIT else 0)],
        num_pages=num_pages,
        max_tokens=1024,
    )


async def expect_error(call, code: grpc.StatusCode, reason: str) -> None:  # noqa: ANN001
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    got_code, got_reason, _ = reason_of(err.value)
    assert (got_code, got_reason) == (code.name, reason), err.value.details()


@pytest.mark.parametrize("group_commit", [False, True], ids=["per-commit", "group-commit"])
def test_broker_service_end_to_end_over_loopback(tmp_path: Path, group_commit: bool) -> None:
    async def scenario() -> None:
        core = BrokerCore(tmp_path / "j.sqlite", lease_seconds=30.0, drain_quiet_seconds=0.05,
                          journal_synchronous="NORMAL", journal_group_commit=group_commit)
        registry = register_broker_metrics(core)
        server = grpc.aio.server()
        add_broker_servicer(core, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        maintenance = asyncio.create_task(run_maintenance(core, 0.01))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR, tp=2)
            ar.geometry.page_size = 0  # the AR may leave the DiT's page_size unset
            dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, tp=2, num_pages=16)
            reg = await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=ar), timeout=TIMEOUT)
            assert reg.lease_seconds == 30.0 and not reg.fenced
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT)
            bad = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, tp=2, num_pages=16, heads=8)
            await expect_error(stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=bad), timeout=TIMEOUT),
                               grpc.StatusCode.INVALID_ARGUMENT, "GEOMETRY_MISMATCH")

            await expect_error(stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="big", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[16 * 17]),
                timeout=TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT, "NEVER_FITS")
            created = await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[40, 3]),
                timeout=TIMEOUT)
            ticket = created.ticket
            assert ticket.state == broker_pb2.TICKET_STATE_RESERVED
            assert [list(r.page_ids) for r in ticket.rows] == [[0, 1, 2], [3]]
            await expect_error(stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r2", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[16 * 13]),
                timeout=TIMEOUT), grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_FREE_PAGES")

            watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=ticket.ticket_id), timeout=TIMEOUT)
            seen: list[int] = []

            async def follow() -> None:
                async for msg in watch:
                    seen.append(msg.ticket.state)

            follower = asyncio.create_task(follow())

            armed = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=ticket.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-0-inc-1"), timeout=TIMEOUT)
            assert armed.ticket.state == broker_pb2.TICKET_STATE_WRITING and armed.verify_checksums
            assert [d.rank for d in armed.destinations] == [0, 1]
            assert sorted((w.row, w.src_rank, w.dst_rank) for w in armed.writes) == [
                (0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
            assert all(w.segments for w in armed.writes)
            assert armed.dit_parallelism.tensor_parallel_size == 2 and armed.dit_num_pages == 16

            # A wrong incarnation is refused without learning the right one: with a shared replica
            # token, anyone may name ar-0, and the incarnation is then all that keeps it from
            # reporting ar-0's writes (NOT_STARTED while one may land). Before, the answer named it.
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await stub.ReportWrite(broker_pb2.ReportWriteRequest(
                    ticket_id=ticket.ticket_id, row=0, src_rank=0, dst_rank=0, replica_id="ar-0",
                    incarnation_id="old", status=common_pb2.WRITE_STATUS_NOT_STARTED), timeout=TIMEOUT)
            assert reason_of(stale.value)[:2] == ("FAILED_PRECONDITION", "STALE_INCARNATION")
            assert "ar-0-inc-1" not in (stale.value.details() or "") + str(stale.value.debug_error_string())
            for w in armed.writes:
                req = broker_pb2.ReportWriteRequest(
                    ticket_id=ticket.ticket_id, row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                    replica_id="ar-0", incarnation_id="ar-0-inc-1", status=common_pb2.WRITE_STATUS_OK,
                    checksum=1000 + w.row * 10 + w.dst_rank, bytes=sum(s.length for s in w.segments))
                await stub.ReportWrite(req, timeout=TIMEOUT)
                await stub.ReportWrite(req, timeout=TIMEOUT)  # idempotent retry
            await expect_error(stub.ReportLoad(broker_pb2.ReportLoadRequest(
                ticket_id=ticket.ticket_id, row=0, dst_rank=0, replica_id="dit-0", incarnation_id="dit-0-inc-1",
                verified=[broker_pb2.WriteProgress(row=0, src_rank=0, dst_rank=0, checksum=1)]), timeout=TIMEOUT),
                grpc.StatusCode.FAILED_PRECONDITION, "CHECKSUM_MISMATCH")
            for row in (0, 1):
                for rank in (0, 1):
                    resp = await stub.ReportLoad(broker_pb2.ReportLoadRequest(
                        ticket_id=ticket.ticket_id, row=row, dst_rank=rank, replica_id="dit-0",
                        incarnation_id="dit-0-inc-1",
                        verified=[broker_pb2.WriteProgress(row=row, src_rank=rank, dst_rank=rank,
                                                           checksum=1000 + row * 10 + rank)]), timeout=TIMEOUT)
            assert resp.ticket.state == broker_pb2.TICKET_STATE_READY
            core.start_consuming(ticket.ticket_id)  # the orchestrator, in-process

            pools = await stub.GetPool(broker_pb2.GetPoolRequest(), timeout=TIMEOUT)
            assert [(p.replica_id, p.free_pages, p.reserved_pages, p.draining_pages) for p in pools.pools] == [
                ("dit-0", 12, 4, 0)]
            listed = await stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=TIMEOUT)
            assert [t.state for t in listed.tickets] == [broker_pb2.TICKET_STATE_CONSUMING]
            metrics = generate_latest(registry).decode()
            assert 'kvrelay_pages{replica="dit-0",state="reserved"} 4.0' in metrics
            assert 'kvrelay_tickets{state="CONSUMING"} 1.0' in metrics
            assert 'kvrelay_replica_up{replica="ar-0",role="ar"} 1.0' in metrics

            # A release from another process of dit-0 (an old incarnation, a replayed call, a
            # caller that only holds the replica token) must not free pages the ranks still read.
            for incarnation, reason in (("", "MISSING_FIELD"), ("dit-0-inc-0", "STALE_INCARNATION")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
                        ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
                        incarnation_id=incarnation), timeout=TIMEOUT)
                assert reason_of(info.value)[1] == reason
            assert core.get_ticket(ticket.ticket_id).state is TicketState.CONSUMING
            released = await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
                ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
                incarnation_id="dit-0-inc-1"), timeout=TIMEOUT)
            again = await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
                ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
                incarnation_id="dit-0-inc-1"), timeout=TIMEOUT)
            assert released.ticket == again.ticket
            assert released.ticket.state == broker_pb2.TICKET_STATE_RELEASED
            await asyncio.wait_for(follower, TIMEOUT)
            assert seen[0] == broker_pb2.TICKET_STATE_RESERVED and seen[-1] == broker_pb2.TICKET_STATE_RELEASED
            assert broker_pb2.TICKET_STATE_READY in seen and broker_pb2.TICKET_STATE_CONSUMING in seen

            # A cancelled armed ticket drains; the writer is polled, resolves, pages free after quiet.
            t2 = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r3", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=TIMEOUT)).ticket
            armed2 = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=t2.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-0-inc-1"), timeout=TIMEOUT)
            cancelled = await stub.CancelTicket(broker_pb2.CancelTicketRequest(
                ticket_id=t2.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=TIMEOUT)
            assert cancelled.ticket.state == broker_pb2.TICKET_STATE_DRAINING
            hb = await stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id="ar-0-inc-1"),
                                      timeout=TIMEOUT)
            assert sorted((k.row, k.src_rank, k.dst_rank) for k in hb.poll_writes) == sorted(
                (w.row, w.src_rank, w.dst_rank) for w in armed2.writes)
            for w in armed2.writes:
                await stub.ReportWrite(broker_pb2.ReportWriteRequest(
                    ticket_id=t2.ticket_id, row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, replica_id="ar-0",
                    incarnation_id="ar-0-inc-1", status=common_pb2.WRITE_STATUS_NOT_STARTED), timeout=TIMEOUT)
            final = core.get_ticket(t2.ticket_id)
            final = await core.waiters.wait_ticket_change(t2.ticket_id, final.version, timeout=TIMEOUT)
            assert final.state.value == "RELEASED"

            # A report outside the plan fences the AR; its heartbeat says so.
            t3 = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r4", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[5]),
                timeout=TIMEOUT)).ticket
            await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=t3.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-0-inc-1"), timeout=TIMEOUT)
            await expect_error(stub.ReportWrite(broker_pb2.ReportWriteRequest(
                ticket_id=t3.ticket_id, row=0, src_rank=3, dst_rank=0, replica_id="ar-0",
                incarnation_id="ar-0-inc-1", status=common_pb2.WRITE_STATUS_OK), timeout=TIMEOUT),
                grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_RANK")
            hb = await stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id="ar-0-inc-1"),
                                      timeout=TIMEOUT)
            assert hb.fenced and "UNKNOWN_RANK" in hb.fence_reason
            replicas = await stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=TIMEOUT)
            assert {(r.replica_id, r.fenced, r.up) for r in replicas.replicas} == {
                ("ar-0", True, True), ("dit-0", False, True)}
            assert 'kvrelay_replica_fenced{replica="ar-0"} 1.0' in generate_latest(registry).decode()

            await expect_error(stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id="nope"), timeout=TIMEOUT),
                               grpc.StatusCode.NOT_FOUND, "UNKNOWN_TICKET")
            await expect_error(stub.DeregisterReplica(broker_pb2.DeregisterReplicaRequest(
                replica_id="dit-0", incarnation_id="wrong"), timeout=TIMEOUT),
                grpc.StatusCode.FAILED_PRECONDITION, "STALE_INCARNATION")
            await stub.DeregisterReplica(broker_pb2.DeregisterReplicaRequest(
                replica_id="dit-0", incarnation_id="dit-0-inc-1"), timeout=TIMEOUT)
        finally:
            maintenance.cancel()
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())


def test_unknown_ids_and_filters_over_loopback() -> None:
    async def scenario() -> None:
        core = BrokerCore(None, journal_synchronous="OFF")
        server = grpc.aio.server()
        add_broker_servicer(core, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            async def watch_unknown() -> None:
                async for _ in stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id="nope"), timeout=TIMEOUT):
                    pass

            await expect_error(watch_unknown(), grpc.StatusCode.NOT_FOUND, "UNKNOWN_TICKET")
            await expect_error(stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-9", incarnation_id="x"),
                                              timeout=TIMEOUT), grpc.StatusCode.NOT_FOUND, "UNKNOWN_REPLICA")
            await expect_error(stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-9"), timeout=TIMEOUT),
                               grpc.StatusCode.NOT_FOUND, "UNKNOWN_REPLICA")
            no_role = broker_pb2.ReplicaInfo(replica_id="x", incarnation_id="i", layout_version=LAYOUT_VERSION)
            await expect_error(stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=no_role),
                                                    timeout=TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT,
                               "INVALID_ARGUMENT")
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(
                replica=replica("ar-0", common_pb2.REPLICA_ROLE_AR)), timeout=TIMEOUT)
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(
                replica=replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=8)), timeout=TIMEOUT)
            for i, rows in enumerate(([5], [5, 5])):
                await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id=f"r{i}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=rows),
                    timeout=TIMEOUT)
            first = (await stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=TIMEOUT)).tickets[0]
            await stub.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=first.ticket_id), timeout=TIMEOUT)
            live = await stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=TIMEOUT)
            assert [t.request_id for t in live.tickets] == ["r1"]
            released = await stub.ListTickets(broker_pb2.ListTicketsRequest(
                states=[broker_pb2.TICKET_STATE_RELEASED]), timeout=TIMEOUT)
            assert [(t.request_id, t.outcome) for t in released.tickets] == [("r0", broker_pb2.TICKET_OUTCOME_CANCELLED)]
            await expect_error(stub.ListTickets(broker_pb2.ListTicketsRequest(
                states=[broker_pb2.TICKET_STATE_UNSPECIFIED]), timeout=TIMEOUT),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
            # A state this build does not know is named as sent (it was called UNSPECIFIED).
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.ListTickets(broker_pb2.ListTicketsRequest(
                    states=[broker_pb2.TICKET_STATE_RELEASED, 42]), timeout=TIMEOUT)
            assert unknown.value.details() == "states: 42 is not a ticket state (0 = unspecified)"
            await expect_error(stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=first.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-0-inc-1"), timeout=TIMEOUT),
                grpc.StatusCode.FAILED_PRECONDITION, "TICKET_RELEASED")
        finally:
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())
