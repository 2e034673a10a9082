"""`ForgetReplica(force=True)` / `kvrelay forget --force`: forgetting a replica gone for good that a
plain forget must keep (fenced, or named by live tickets), without ever handing a page to another
ticket while a write may still land in it (docs/operations.md, Retiring a replica).

The rule under test: a forced forget ends the forgotten DiT's tickets (REPLICA_FORGOTTEN) and drops
its pool, and refuses that incarnation for good (a registration of it is answered fenced and kept
nowhere, across broker restarts), so its page ids only come back in a new incarnation's memory; an
AR whose writes may still land is refused (REPLICA_WRITES_IN_DOUBT), as is anything up."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import Registration
from kvrelay.broker.tickets import FailedPrecondition, NotFound, TicketOutcome, TicketState, WriteStatus
from kvrelay.client import AsyncKvRelayClient, ForgottenIncarnation
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2, generation_pb2
from tests.broker.helpers import (
    ManualClock,
    ar_spec,
    checksum_of,
    dit_spec,
    load_all,
    new_incarnation,
    write_all,
)
from tests.broker.test_forget_replica import _deregister, _forget_cli, _listed, _register, _start_broker
from tests.broker.test_grpc import replica


def _core(path: Path, clock: ManualClock) -> BrokerCore:
    return BrokerCore(path, clock=clock, lease_seconds=10.0, drain_quiet_seconds=2.0, journal_synchronous="NORMAL")


def _ids(core: BrokerCore) -> list[str]:
    return sorted(r.spec.replica_id for r in core.registry)


def _refusal(core: BrokerCore, replica_id: str, *, force: bool) -> str:
    with pytest.raises(FailedPrecondition) as refused:
        core.forget_replica(replica_id, force=force)
    return refused.value.reason


def _forgotten_meta(core: BrokerCore) -> dict[str, list[str]]:
    return dict(json.loads(core.journal.load().meta.get("forgotten_incarnations", "{}")))


def test_a_consuming_ticket_a_restart_orphaned_on_a_dit_gone_for_good_ends_with_a_forced_forget(
    tmp_path: Path,
) -> None:
    """The dead end of before: the broker is killed while a DiT reads a ticket, and that DiT never
    comes back. The ticket is restored CONSUMING and holds the DiT and its AR against a plain
    forget. Forced, the DiT goes with its ticket (RELEASED, FAILED, REPLICA_FORGOTTEN) and its
    pool; the AR then goes plainly; all of it journaled."""
    path, clock = tmp_path / "j.sqlite", ManualClock()
    core = _core(path, clock)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r1", ar.replica_id, dit.replica_id, [16, 16])
    assert t is not None
    core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    load_all(core, write_all(core, core.get_ticket(t.ticket_id), ar), dit)
    core.start_consuming(t.ticket_id, dit.replica_id, dit.incarnation_id)
    core.close()  # killed: nothing after the journal

    core = _core(path, clock)
    try:
        clock.advance(3600)
        for replica_id in (dit.replica_id, ar.replica_id):
            assert _refusal(core, replica_id, force=False) == "REPLICA_HOLDS_TICKETS"
        ended = core.forget_replica(dit.replica_id, force=True)
        assert [e.ticket_id for e in ended] == [t.ticket_id]
        released = core.get_ticket(t.ticket_id)
        assert (released.state, released.outcome, released.reason) == (
            TicketState.RELEASED, TicketOutcome.FAILED, "REPLICA_FORGOTTEN")  # fmt: skip
        assert core.pool_status() == [] and core.list_tickets() == []
        core.forget_replica(ar.replica_id)  # nothing names it any more: a plain forget
        assert _ids(core) == []
        assert _forgotten_meta(core) == {dit.replica_id: [dit.incarnation_id]}
    finally:
        core.close()
    core = _core(path, clock)
    try:
        assert _ids(core) == [] and core.list_tickets() == [] and core.pool_status() == []
    finally:
        core.close()


def test_a_forgotten_dit_incarnation_never_gets_its_pages_back_while_an_in_doubt_write_may_land(
    tmp_path: Path,
) -> None:
    """The DiT was only cut off (alive behind a partition) when the operator forced it out, and an
    AR's write into its pages is in doubt. That incarnation registering again (its heartbeat got
    UNKNOWN_REPLICA) is answered fenced and kept nowhere, before and after a broker restart: no
    pool, no ticket on it, so the in-doubt write can land in no page another ticket was given. A
    new incarnation (new memory, fresh transport ports) gets a whole pool, and lifts the refusal."""
    path, clock = tmp_path / "j.sqlite", ManualClock()
    core = _core(path, clock)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r1", ar.replica_id, dit.replica_id, [32])
    assert t is not None
    core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    (write,) = t.writes
    core.report_write(t.ticket_id, write.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.IN_DOUBT)  # fmt: skip
    core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT, "TRANSFER_TIMEOUT")
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    clock.advance(11)  # the DiT's lease lapses; the AR keeps beating
    core.heartbeat(ar.replica_id, ar.incarnation_id)
    assert _refusal(core, dit.replica_id, force=False) == "REPLICA_HOLDS_TICKETS"
    assert core.pool_status(dit.replica_id)[0].draining == 2

    assert [e.ticket_id for e in core.forget_replica(dit.replica_id, force=True)] == [t.ticket_id]
    gone = core.get_ticket(t.ticket_id)
    assert (gone.state, gone.outcome, gone.reason) == (TicketState.RELEASED, TicketOutcome.TIMED_OUT, "REPLICA_FORGOTTEN")
    # The writer's late word changes nothing.
    late = core.report_write(t.ticket_id, write.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                             status=WriteStatus.OK, checksum=checksum_of(t.ticket_id, write.key), nbytes=100)  # fmt: skip
    assert late.state is TicketState.RELEASED

    for restart in (False, True):
        if restart:
            core.close()
            core = _core(path, clock)
            core.register_replica(ar)
        reply = core.register_replica(dit)  # the cut-off process, back with its old memory
        assert (reply.fenced, reply.registration) == (True, Registration.FORGOTTEN)
        assert dit.replica_id not in _ids(core) and core.pool_status() == []
        with pytest.raises(NotFound):
            core.create_ticket("r2", ar.replica_id, dit.replica_id, [16])
        with pytest.raises(NotFound):  # its heartbeat: UNKNOWN_REPLICA, so it registers (fenced) again
            core.heartbeat(dit.replica_id, dit.incarnation_id)

    fresh = new_incarnation(dit)
    reply = core.register_replica(fresh)
    assert (reply.fenced, reply.registration) == (False, Registration.NEW)
    (pool,) = core.pool_status(dit.replica_id)
    assert (pool.free, pool.total) == (8, 8)
    assert core.create_ticket("r2", ar.replica_id, dit.replica_id, [16]) is not None
    # Still refused after a new incarnation registered (its lock proves nothing on another host):
    # the old process, cut off and coming back after the new one is forgotten too, stays fenced.
    assert _forgotten_meta(core) == {dit.replica_id: [dit.incarnation_id]}
    assert core.register_replica(dit).fenced
    core.close()


def test_an_ar_whose_writes_may_still_land_is_refused_even_by_force(tmp_path: Path) -> None:
    """An AR down with an in-doubt write into a live DiT may be alive behind a partition and still
    writing: no forget may free those pages (REPLICA_WRITES_IN_DOUBT, nothing changed). Forced, an
    AR without one goes: its unarmed ticket rolls back, its armed one with every write final ends
    (drains its quiet period), one its DiT reads is left to the DiT."""
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=16)
    core.register_replica(ar)
    core.register_replica(dit)
    doubt = core.create_ticket("doubt", ar.replica_id, dit.replica_id, [16])
    unarmed = core.create_ticket("unarmed", ar.replica_id, dit.replica_id, [16])
    written = core.create_ticket("written", ar.replica_id, dit.replica_id, [16])
    read = core.create_ticket("read", ar.replica_id, dit.replica_id, [16])
    assert doubt and unarmed and written and read
    for t in (doubt, written, read):
        core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    (write,) = doubt.writes
    core.report_write(doubt.ticket_id, write.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.IN_DOUBT)  # fmt: skip
    write_all(core, core.get_ticket(written.ticket_id), ar)
    load_all(core, write_all(core, core.get_ticket(read.ticket_id), ar), dit)
    core.start_consuming(read.ticket_id, dit.replica_id, dit.incarnation_id)
    core.deregister_replica(ar.replica_id, ar.incarnation_id)

    before = [core.get_ticket(t.ticket_id) for t in (doubt, unarmed, written, read)]
    refused = core.forget_refusal(core.registry.get(ar.replica_id), clock(), force=True)
    assert refused is not None and refused.reason == "REPLICA_WRITES_IN_DOUBT"
    assert doubt.ticket_id in refused.message and dit.replica_id in refused.message
    assert _refusal(core, ar.replica_id, force=True) == "REPLICA_WRITES_IN_DOUBT"
    assert [core.get_ticket(t.ticket_id) for t in (doubt, unarmed, written, read)] == before
    assert _ids(core) == [ar.replica_id, dit.replica_id]
    # The DiT is up: never forgotten, forced or not.
    assert _refusal(core, dit.replica_id, force=True) == "REPLICA_UP"

    # The in-doubt write resolves (the call returned): now the AR may go, by force.
    core.report_write(doubt.ticket_id, write.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.FAILED)  # fmt: skip
    ended = {e.ticket_id: e for e in core.forget_replica(ar.replica_id, force=True)}
    assert sorted(ended) == sorted([doubt.ticket_id, unarmed.ticket_id, written.ticket_id])
    assert (ended[unarmed.ticket_id].state, ended[unarmed.ticket_id].reason) == (TicketState.RELEASED, "REPLICA_FORGOTTEN")
    for armed in (doubt, written):
        assert (ended[armed.ticket_id].state, ended[armed.ticket_id].reason) == (TicketState.DRAINING, "REPLICA_FORGOTTEN")
    assert core.get_ticket(read.ticket_id).state is TicketState.CONSUMING
    assert _ids(core) == [dit.replica_id]
    clock.advance(2)
    core.tick()
    assert [t.ticket_id for t in core.list_tickets()] == [read.ticket_id]
    core.release_ticket(read.ticket_id, TicketOutcome.OK, "", dit.replica_id, dit.incarnation_id)
    (pool,) = core.pool_status(dit.replica_id)
    assert (pool.free, pool.total) == (16, 16)
    assert core.register_replica(ar).fenced  # that AR incarnation is refused for good
    core.close()


def test_a_fenced_replica_gone_for_good_is_forgotten_by_force_and_its_incarnation_stays_fenced(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    dit = dit_spec("dit-0", num_pages=8)
    core.register_replica(dit)
    core.fence_replica(dit.replica_id, "LOAD_NOT_IN_PLAN: test")
    assert _refusal(core, dit.replica_id, force=True) == "REPLICA_UP"
    clock.advance(11)
    assert _refusal(core, dit.replica_id, force=False) == "REPLICA_FENCED"
    assert core.forget_replica(dit.replica_id, force=True) == []
    assert _ids(core) == []
    # The fenced process must still fail stop if it ever comes back: answered fenced.
    assert core.register_replica(dit).fenced and _ids(core) == []
    fresh = new_incarnation(dit)
    assert not core.register_replica(fresh).fenced
    assert core.get_replica(dit.replica_id).up
    core.close()


def test_force_changes_nothing_for_a_replica_a_plain_forget_allows(tmp_path: Path) -> None:
    """Nothing to override: forgotten as before, its incarnation not refused (it may register again)."""
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    dit = dit_spec("dit-0", num_pages=8)
    core.register_replica(dit)
    clock.advance(11)
    assert core.forget_replica(dit.replica_id, force=True) == []
    assert _forgotten_meta(core) == {}
    assert core.register_replica(dit).registration is Registration.NEW
    core.close()


# ------------------------------------------------------------- the generation of a ticket it ends


def test_a_forced_forget_fails_the_generation_of_the_ticket_it_ends_at_once() -> None:
    """A generation whose DiT is forgotten while it reads (the DiT cut off: it neither steps nor
    ends) ends FAILED UNAVAILABLE REPLICA_FORGOTTEN at once, not after a stage timeout."""
    from tests.orchestrator.harness import cluster, collect, request, run

    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            call = c.api.Generate(request(request_id="f", seed=1), timeout=30)
            while (await call.read()).state != generation_pb2.GENERATION_STATE_DENOISING:  # type: ignore[attr-defined]
                pass
            ticket_id = c.orchestrator.get("f").ticket_id
            c.core.deregister_replica(c.dit.replica_id, c.dit.incarnation_id)
            broker = broker_pb2_grpc.BrokerServiceStub(c.channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await broker.ForgetReplica(broker_pb2.ForgetReplicaRequest(replica_id=c.dit.replica_id), timeout=5)
            assert reason_of(refused.value)[:2] == ("FAILED_PRECONDITION", "REPLICA_HOLDS_TICKETS")  # type: ignore[arg-type]
            reply = await broker.ForgetReplica(
                broker_pb2.ForgetReplicaRequest(replica_id=c.dit.replica_id, force=True), timeout=5)
            assert list(reply.ended_ticket_ids) == [ticket_id]
            final = (await asyncio.wait_for(collect(call), 10))[-1]
            assert final.state == generation_pb2.GENERATION_STATE_FAILED
            assert (final.error.code, final.error.reason) == ("UNAVAILABLE", "REPLICA_FORGOTTEN")
            assert c.dit.replica_id in final.error.message and ticket_id in final.error.message
            ticket = c.core.get_ticket(ticket_id)
            assert (ticket.state, ticket.reason) == (TicketState.RELEASED, "REPLICA_FORGOTTEN")
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 1

    run(body())


# ------------------------------------------------------------------------- a real broker process


def test_a_real_broker_killed_while_a_dit_reads_then_the_dit_is_forgotten_by_force(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 of `kvrelay broker` while a DiT reads a ticket; the DiT host is gone for good. After the
    restart `kvrelay forget` refuses it, `kvrelay forget --force` forgets it and ends the ticket,
    the AR then goes plainly, a second restart brings none of it back, and the DiT's old
    incarnation registering (a process that was only cut off) is answered fenced."""
    ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            _register(stub, ar)
            _register(stub, dit)
            ticket = stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="req-1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=10).ticket  # fmt: skip
            armed = stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=ticket.ticket_id, ar_replica_id="ar-0", incarnation_id=ar.incarnation_id), timeout=10)  # fmt: skip
            writes = [broker_pb2.WriteReport(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                             status=common_pb2.WRITE_STATUS_OK, checksum=7, bytes=10)
                      for w in armed.writes]  # fmt: skip
            stub.ReportWrite(broker_pb2.ReportWriteRequest(ticket_id=ticket.ticket_id, replica_id="ar-0",
                                                           incarnation_id=ar.incarnation_id, writes=writes), timeout=10)  # fmt: skip
            for row, dst in sorted({(w.row, w.dst_rank) for w in armed.writes}):
                verified = [broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=7)
                            for w in armed.writes if (w.row, w.dst_rank) == (row, dst)]  # fmt: skip
                stub.ReportLoad(broker_pb2.ReportLoadRequest(
                    ticket_id=ticket.ticket_id, row=row, dst_rank=dst, replica_id="dit-0",
                    incarnation_id=dit.incarnation_id, verified=verified), timeout=10)  # fmt: skip
            stub.StartConsuming(broker_pb2.StartConsumingRequest(
                ticket_id=ticket.ticket_id, replica_id="dit-0", incarnation_id=dit.incarnation_id), timeout=10)  # fmt: skip
        broker.proc.kill()
        broker.proc.wait(timeout=10)
    finally:
        broker.stop()

    broker = _start_broker(repo_root, tmp_path)
    try:
        code, out, err = _forget_cli(capsys, broker.address, "dit-0")
        assert code == 1 and err.startswith("dit-0 not forgotten: FAILED_PRECONDITION (REPLICA_HOLDS_TICKETS):"), err
        code, out, err = _forget_cli(capsys, broker.address, "--force", "--all-down")
        # The DiT first (it ends the ticket), then the AR, named by nothing any more.
        assert (code, err) == (0, ""), (out, err)
        assert out.splitlines() == [f"dit-0 forgotten (ended 1 ticket: {ticket.ticket_id})", "ar-0 forgotten"], out
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            got = stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket.ticket_id), timeout=10).ticket
            assert (got.state, got.reason) == (broker_pb2.TICKET_STATE_RELEASED, "REPLICA_FORGOTTEN")
            assert _listed(stub) == {}
    finally:
        assert broker.stop() == 0, broker.output()

    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _listed(stub) == {}
            assert stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=10).tickets == []
            reply = stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=10)
            assert reply.fenced
            assert _listed(stub) == {}
            _register(stub, ar)  # the AR was forgotten plainly: it may simply come back
            assert _listed(stub) == {"ar-0": True}
    finally:
        assert broker.stop() == 0, broker.output()


def test_a_forgotten_incarnation_is_answered_fenced_even_where_the_broker_cannot_reach_it(tmp_path: Path) -> None:
    """Behind a partial partition the cut-off DiT reaches the broker but not the other way round.
    Its registration must still be answered fenced, so that it fails stop, not refused as
    UNREACHABLE_ENDPOINT, which it retries for as long as it runs. Another incarnation at that
    endpoint is still refused, as ever."""
    from kvrelay.broker.service import BrokerServicer, spec_from_proto

    clock = ManualClock()
    dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=8)
    dit.endpoint = "10.255.0.1:1"  # not loopback: the broker dials it
    dialled: list[str] = []

    async def probe(endpoint: str) -> str:
        dialled.append(endpoint)
        return "connection refused"

    async def scenario() -> None:
        core = _core(tmp_path / "j.sqlite", clock)
        server = grpc.aio.server()
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(BrokerServicer(core, endpoint_probe=probe), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                core.register_replica(spec_from_proto(dit))  # registered while the broker reached it
                core.fence_replica("dit-0", "LOAD_NOT_IN_PLAN: test")
                clock.advance(11)
                core.forget_replica("dit-0", force=True)
                reply = await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=10)
                assert reply.fenced and dialled == [] and _ids(core) == []
                other = broker_pb2.ReplicaInfo()
                other.CopyFrom(dit)
                other.incarnation_id = "dit-0-inc-2"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=other), timeout=10)
                assert reason_of(refused.value)[:2] == ("INVALID_ARGUMENT", "UNREACHABLE_ENDPOINT")  # type: ignore[arg-type]
                assert dialled == [other.endpoint]
        finally:
            await server.stop(None)
            core.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_real_dit_cut_off_and_forgotten_by_force_fails_stop_when_it_comes_back(tmp_path: Path) -> None:
    """A real `kvrelay dit` process, alive, that the broker took for gone: deregistered (down) while
    an AR's writes into its pages are unresolved, then forgotten by force. Its next heartbeat gets
    UNKNOWN_REPLICA, it registers again with its incarnation, is answered fenced, and fails stop
    (exit 3, its page memory freed); the broker never kept a record or a pool of it again."""
    from tests.dit_service.harness import ArWriter, inprocess_broker, start_dit, wait_serving, write_config

    config = write_config(tmp_path, transport="mooncake", lease_seconds=0.6)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=0.6) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.create_ticket([5])
                await writer.arm(ticket.ticket_id)  # the writer holds the map; nothing reported yet
                incarnation = core.registry.get("dit-0").spec.incarnation_id
                core.deregister_replica("dit-0", incarnation)  # down; it goes on heartbeating
                ended = core.forget_replica("dit-0", force=True)
                assert [t.ticket_id for t in ended] == [ticket.ticket_id]
                gone = core.get_ticket(ticket.ticket_id)
                assert (gone.state, gone.reason) == (TicketState.RELEASED, "REPLICA_FORGOTTEN")
                deadline = time.monotonic() + 20.0
                while dit.proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert dit.proc.poll() == 3, "".join(dit.lines[-30:])
                assert list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*")) == []
                assert "dit-0" not in core.registry and core.pool_status() == []
                assert _forgotten_meta(core) == {"dit-0": [incarnation]}
                await writer.close()
            finally:
                await asyncio.to_thread(dit.stop)

    asyncio.run(scenario())


def test_the_maintenance_loop_never_forces_and_says_once_what_it_keeps(tmp_path: Path) -> None:
    """broker.forget_down_replicas_after_seconds forgets only what a plain forget would: a DiT
    holding an orphaned ticket, down however long, is kept (one warning per incarnation naming
    the reason, not one per pass) until an operator forces it."""
    import structlog.testing

    clock = ManualClock()
    core = BrokerCore(tmp_path / "j.sqlite", clock=clock, lease_seconds=10.0, journal_synchronous="NORMAL",
                      forget_down_after_seconds=30.0)  # fmt: skip
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r1", ar.replica_id, dit.replica_id, [16])
    assert t is not None
    core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    load_all(core, write_all(core, core.get_ticket(t.ticket_id), ar), dit)
    with structlog.testing.capture_logs() as events:
        for _ in range(3):
            clock.advance(3600)
            core.tick()
    kept = [e for e in events if e["event"] == "replica_down_too_long_kept"]
    assert sorted((e["replica_id"], e["reason"]) for e in kept) == [
        ("ar-0", "REPLICA_HOLDS_TICKETS"), ("dit-0", "REPLICA_HOLDS_TICKETS")]  # fmt: skip
    assert _ids(core) == ["ar-0", "dit-0"] and core.get_ticket(t.ticket_id).state is TicketState.READY
    core.forget_replica(dit.replica_id, force=True)
    core.tick()  # the AR is named by nothing now: forgotten by the loop
    assert _ids(core) == []
    core.close()


def test_forget_force_names_an_ar_with_writes_in_doubt_before_its_dit_and_both_go(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both hosts gone for good, an AR's write into the DiT in doubt. The AR alone is refused even by
    force (REPLICA_WRITES_IN_DOUBT: behind a partition it could still write); named before its DiT
    on one command line, it is tried again once the DiT (forgotten, its tickets ended) freed it."""
    ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            _register(stub, ar)
            _register(stub, dit)
            ticket = stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="req-1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=10).ticket  # fmt: skip
            armed = stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
                ticket_id=ticket.ticket_id, ar_replica_id="ar-0", incarnation_id=ar.incarnation_id), timeout=10)  # fmt: skip
            stub.ReportWrite(broker_pb2.ReportWriteRequest(
                ticket_id=ticket.ticket_id, replica_id="ar-0", incarnation_id=ar.incarnation_id,
                writes=[broker_pb2.WriteReport(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                               status=common_pb2.WRITE_STATUS_IN_DOUBT) for w in armed.writes]),
                timeout=10)  # fmt: skip
            _deregister(stub, ar)
            _deregister(stub, dit)
            code, out, err = _forget_cli(capsys, broker.address, "--force", "ar-0")
            assert (code, out) == (1, ""), (out, err)
            assert err.startswith("ar-0 not forgotten: FAILED_PRECONDITION (REPLICA_WRITES_IN_DOUBT):"), err
            assert ticket.ticket_id in err and "dit-0" in err
            code, out, err = _forget_cli(capsys, broker.address, "--force", "ar-0", "dit-0")
            assert (code, err) == (0, ""), (out, err)
            assert out.splitlines() == [f"dit-0 forgotten (ended 1 ticket: {ticket.ticket_id})", "ar-0 forgotten"]
            assert _listed(stub) == {}
    finally:
        assert broker.stop() == 0, broker.output()


def test_every_forgotten_incarnation_of_an_id_stays_refused_across_restarts_bounded(tmp_path: Path) -> None:
    """Each forced forget adds its incarnation; none is lifted by a later one registering (a lock
    proves the old process gone only on its own host), all survive a broker restart, and only
    the latest 16 per id are kept. A journal of before (one incarnation per id, as a string)
    still refuses its incarnation."""
    clock = ManualClock()
    path = tmp_path / "j.sqlite"
    core = _core(path, clock)
    dit = dit_spec("dit-0", num_pages=8)
    gone = []
    for _ in range(18):
        core.register_replica(dit)
        core.fence_replica(dit.replica_id, "LOAD_NOT_IN_PLAN: test")
        clock.advance(11)
        core.forget_replica(dit.replica_id, force=True)
        gone.append(dit)
        dit = new_incarnation(dit)
    core.close()
    core = _core(path, clock)
    assert _forgotten_meta(core) == {"dit-0": [s.incarnation_id for s in gone[-16:]]}
    assert all(core.register_replica(s).fenced for s in gone[-16:])
    assert not core.register_replica(dit).fenced  # a new incarnation registers normally
    core.close()
    # A journal written before this rule kept one incarnation per id, as a string.
    core = _core(path, clock)
    core.journal.commit(meta={"forgotten_incarnations": json.dumps({"dit-9": "inc-old"})})
    core.close()
    core = _core(path, clock)
    assert core.register_replica(dit_spec("dit-9", num_pages=8, incarnation="inc-old")).fenced
    assert not core.register_replica(dit_spec("dit-9", num_pages=8, incarnation="inc-new")).fenced
    core.close()


def test_kvrelay_status_shows_an_incarnation_forgotten_by_force_from_the_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator sees why a returning replica is answered fenced: `kvrelay status` (ListReplicas,
    the SDK's get_replica_registry) lists the incarnation forgotten by force, after a broker
    restart too (journaled), and a new incarnation of the id is listed as a replica."""
    from kvrelay.broker.service import BrokerServicer, spec_from_proto
    from kvrelay.node.cli import main

    clock = ManualClock()
    dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=8)
    journal = tmp_path / "j.sqlite"

    def status(address: str, *flags: str) -> str:
        capsys.readouterr()
        assert main(["status", "--target", address, *flags]) == 0
        return capsys.readouterr().out

    async def scenario(core: BrokerCore, check: Any, refused: list[ForgottenIncarnation]) -> None:
        server = grpc.aio.server()
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(BrokerServicer(core), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncKvRelayClient(f"127.0.0.1:{port}") as client:
                assert (await client.get_replica_registry()).forgotten_incarnations == refused
            await asyncio.to_thread(check, f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    core = _core(journal, clock)
    core.register_replica(spec_from_proto(dit))
    core.fence_replica("dit-0", "LOAD_NOT_IN_PLAN: test")
    clock.advance(11)
    core.forget_replica("dit-0", force=True)
    core.close()
    core = _core(journal, clock)  # a broker restart: the refusal is journaled

    def refused_shown(address: str) -> None:
        doc = json.loads(status(address, "--json"))
        assert doc["replicas"] == []
        assert doc["forgotten_incarnations"] == [{"replica_id": "dit-0", "incarnation_id": dit.incarnation_id}]
        lines = status(address).splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("REFUSED (FORGOTTEN WITH --force)"))
        assert lines[header + 1].split() == ["dit-0", "1", dit.incarnation_id[:8]]
        assert "is answered fenced and fails stop" in "\n".join(lines[header + 2 :])

    asyncio.run(scenario(core, refused_shown, [ForgottenIncarnation("dit-0", dit.incarnation_id)]))
    assert core.register_replica(spec_from_proto(dit)).fenced  # what the listing explains
    fresh = new_incarnation(spec_from_proto(dit))
    assert not core.register_replica(fresh).fenced

    def registered_again(address: str) -> None:
        doc = json.loads(status(address, "--json"))
        assert [(r["replica_id"], r["incarnation_id"]) for r in doc["replicas"]] == [("dit-0", fresh.incarnation_id)]

    shown = [ForgottenIncarnation(r, i) for r, i in core.forgotten_incarnations()]
    asyncio.run(scenario(core, registered_again, shown))
    core.close()
