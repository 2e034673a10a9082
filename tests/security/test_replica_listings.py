"""What a holder of the replica token may list and report about tickets, against a real `kvrelay
broker` process with the replica and operator tokens set, over raw gRPC stubs (docs/broker.md,
Bounds on what a replica lists; docs/operations.md, Security).

A registration's `unresolved_writes`, `held_ticket_ids` and `owed_releases` (and a heartbeat's
`unresolved_writes`) were bounded only by the 8 MiB request: ~190k made-up entries, each looked up
and logged on its own line. They are now bounded by what the replica could hold, and a replica
listing exactly that much (every DiT page written by an AR, found again after a broker restart)
is never refused. A report about a ticket the caller is not armed for is refused without fencing
anyone or freeing a page a write may still land in. Each test fails without its fix.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.errors import reason_of
from kvrelay.security import AUTHORIZATION_METADATA, REPLICA_ID_METADATA
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import replica
from tests.procs import ServiceProcess, start_service

REPLICA_TOKEN, OPERATOR_TOKEN = "replica-token-listings", "operator-token-listings"
PAGES = 72  # above the 64 entries of a repeated message the interceptor looks into


def _config(repo_root: Path, tmp_path: Path) -> Path:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    cfg["broker"]["lease_seconds"] = 600  # no lease lapses while a slow CI host runs the test
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def _broker(repo_root: Path, config: Path) -> Iterator[ServiceProcess]:
    env = {"KVRELAY_REPLICA_TOKEN": REPLICA_TOKEN, "KVRELAY_OPERATOR_TOKEN": OPERATOR_TOKEN}
    broker = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"],
                           cwd=repo_root, env=env)  # fmt: skip
    try:
        yield broker
    finally:
        assert broker.stop() == 0, broker.output()


class _Caller:
    """A raw stub that presents a token (and a replica id) on every call."""

    def __init__(self, channel: grpc.Channel, token: str, replica_id: str | None = None) -> None:
        self.stub = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
        self.metadata = [(AUTHORIZATION_METADATA, f"Bearer {token}")]
        if replica_id is not None:
            self.metadata.append((REPLICA_ID_METADATA, replica_id))

    def __call__(self, method: str, request: object) -> object:
        if isinstance(request, broker_pb2.RegisterReplicaRequest):
            request.token = REPLICA_TOKEN  # the registration carries it too
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=10)

    def refused(self, method: str, request: object) -> tuple[str, str, str]:
        with pytest.raises(grpc.RpcError) as info:
            self(method, request)
        return reason_of(info.value)  # type: ignore[arg-type]


def _pool(operator: _Caller) -> broker_pb2.PoolStatus:
    reply = operator("GetPool", broker_pb2.GetPoolRequest(replica_id="dit-0"))
    return reply.pools[0]  # type: ignore[attr-defined, no-any-return]


def _write(ticket_id: str, row: int = 0, src: int = 0, dst: int = 0) -> common_pb2.WriteKey:
    return common_pb2.WriteKey(ticket_id=ticket_id, row=row, src_rank=src, dst_rank=dst)


def test_listings_are_bounded_by_what_the_replica_can_hold_and_a_full_one_is_kept(
    repo_root: Path, tmp_path: Path
) -> None:
    config = _config(repo_root, tmp_path)
    ar_info = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    dit_info = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=PAGES)
    with _broker(repo_root, config) as broker, grpc.insecure_channel(broker.address) as channel:
        ar, dit = _Caller(channel, REPLICA_TOKEN, "ar-0"), _Caller(channel, REPLICA_TOKEN, "dit-0")
        operator = _Caller(channel, OPERATOR_TOKEN)
        ar("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=ar_info))
        dit("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=dit_info))
        # Every page of the DiT reserved, one page a ticket, and every ticket armed by ar-0: the
        # most writes ar-0 can have in flight (one AR rank, one DiT rank, PAGES pages).
        tickets = []
        for i in range(PAGES):
            t = operator("CreateTicket", broker_pb2.CreateTicketRequest(
                request_id=f"req-{i}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[3]))  # fmt: skip
            ar("ReserveTicket", broker_pb2.ReserveTicketRequest(
                ticket_id=t.ticket.ticket_id, ar_replica_id="ar-0", incarnation_id=ar_info.incarnation_id))  # type: ignore[attr-defined]  # fmt: skip
            tickets.append(t.ticket.ticket_id)  # type: ignore[attr-defined]
        assert _pool(operator).free_pages == 0
    # The broker crashed and came back from its journal; ar-0 and dit-0 (the same processes)
    # register again with what they hold: their writes in flight, the tickets being read.
    with _broker(repo_root, config) as broker, grpc.insecure_channel(broker.address) as channel:
        ar, dit = _Caller(channel, REPLICA_TOKEN, "ar-0"), _Caller(channel, REPLICA_TOKEN, "dit-0")
        operator = _Caller(channel, OPERATOR_TOKEN)
        in_flight = [_write(t) for t in tickets]

        # One more than the AR could hold, made up or a duplicate: refused, naming the bound.
        code, reason, message = ar.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=ar_info, unresolved_writes=[*in_flight, _write("made-up")]))  # fmt: skip
        assert (code, reason) == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES"), message
        assert f"unresolved_writes: {PAGES + 1} entries, at most {PAGES}" in message
        assert ar.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=ar_info, unresolved_writes=[*in_flight, in_flight[0]]))[1] == "TOO_MANY_ENTRIES"  # fmt: skip
        # A long ticket id past the entries the interceptor reads is refused too (it was logged).
        long_id = [*in_flight[:70], _write("x" * 300), *in_flight[71:]]
        code, reason, message = ar.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=ar_info, unresolved_writes=long_id))  # fmt: skip
        assert (code, reason) == ("INVALID_ARGUMENT", "FIELD_TOO_LONG") and "unresolved_writes[70].ticket_id" in message
        # Exactly what it holds is never refused.
        ar("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=ar_info, unresolved_writes=in_flight))
        beat = broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id=ar_info.incarnation_id)
        beat.unresolved_writes.extend([*in_flight, _write("made-up")])
        assert ar.refused("Heartbeat", beat)[:2] == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES")
        del beat.unresolved_writes[-1]
        assert not ar("Heartbeat", beat).fenced  # type: ignore[attr-defined]
        # The DiT: as many tickets as it has pages, plus its max_num_seqs (1) calls whose ticket may
        # be released already, held or owed; not one more, and one release a ticket.
        made_up = ["made-up-0", "made-up-1"]
        assert dit.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=dit_info, held_ticket_ids=[*tickets, *made_up]))[:2] == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES")  # fmt: skip
        owed = [broker_pb2.OwedRelease(ticket_id=t, outcome=broker_pb2.TICKET_OUTCOME_FAILED) for t in tickets]
        code, reason, message = dit.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=dit_info, owed_releases=[*owed, *(broker_pb2.OwedRelease(ticket_id=t) for t in made_up)]))  # fmt: skip
        assert (code, reason) == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES") and "owed_releases" in message
        assert f"at most {PAGES + 1}" in message
        code, reason, message = dit.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=dit_info, owed_releases=[owed[0], broker_pb2.OwedRelease(ticket_id=tickets[0])]))  # fmt: skip
        assert (code, reason) == ("INVALID_ARGUMENT", "DUPLICATE_ENTRY") and "owed_releases[1].ticket_id" in message
        dit("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=dit_info, held_ticket_ids=[*tickets, "gone"]))
        # Nothing was lost to the refusals: every page is still held for the writes in flight ...
        pool = _pool(operator)
        assert (pool.free_pages, pool.reserved_pages + pool.draining_pages) == (0, PAGES)
        states = operator("ListTickets", broker_pb2.ListTicketsRequest()).tickets  # type: ignore[attr-defined]
        assert len(states) == PAGES and {t.state for t in states} == {broker_pb2.TICKET_STATE_DRAINING}
        # ... and nothing leaks: once ar-0 reports its writes never started, every page comes back.
        for t in tickets:
            ar("ReportWrite", broker_pb2.ReportWriteRequest(
                ticket_id=t, replica_id="ar-0", incarnation_id=ar_info.incarnation_id,
                writes=[broker_pb2.WriteReport(status=common_pb2.WRITE_STATUS_NOT_STARTED)]))  # fmt: skip
        deadline = time.monotonic() + 20
        while _pool(operator).free_pages != PAGES and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pool(operator).free_pages == PAGES, broker.output()
        # A DiT's held tickets are bounded by its pages, not by the interceptor's 1024 ids a field
        # (before: INVALID_ARGUMENT "at most 1024 ids" for a DiT of 2048 pages holding 1500).
        big = _Caller(channel, REPLICA_TOKEN, "dit-big")
        big_info = replica("dit-big", common_pb2.REPLICA_ROLE_DIT, num_pages=2048)
        big("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=big_info))
        held = [f"ticket-{i}" for i in range(2050)]
        big("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=big_info, held_ticket_ids=held[:1500]))
        code, reason, message = big.refused("RegisterReplica", broker_pb2.RegisterReplicaRequest(
            replica=big_info, held_ticket_ids=held))  # fmt: skip
        assert (code, reason) == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES") and "at most 2049" in message


def test_a_report_about_a_ticket_the_caller_is_not_armed_for_fences_no_one_and_frees_nothing(
    repo_root: Path, tmp_path: Path
) -> None:
    config = _config(repo_root, tmp_path)
    infos = {
        "ar-0": replica("ar-0", common_pb2.REPLICA_ROLE_AR),
        "ar-1": replica("ar-1", common_pb2.REPLICA_ROLE_AR),
        "dit-0": replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16),
        "dit-1": replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16),
    }
    with _broker(repo_root, config) as broker, grpc.insecure_channel(broker.address) as channel:
        callers = {rid: _Caller(channel, REPLICA_TOKEN, rid) for rid in infos}
        operator = _Caller(channel, OPERATOR_TOKEN)
        for rid, info in infos.items():
            callers[rid]("RegisterReplica", broker_pb2.RegisterReplicaRequest(replica=info))

        def report(rid: str, ticket_id: str, status: int) -> broker_pb2.ReportWriteRequest:
            return broker_pb2.ReportWriteRequest(
                ticket_id=ticket_id, replica_id=rid, incarnation_id=infos[rid].incarnation_id,
                writes=[broker_pb2.WriteReport(status=status)])  # type: ignore[arg-type]  # fmt: skip

        def fenced(rid: str) -> bool:
            beat = broker_pb2.HeartbeatRequest(replica_id=rid, incarnation_id=infos[rid].incarnation_id)
            return bool(callers[rid]("Heartbeat", beat).fenced)  # type: ignore[attr-defined]

        def ticket(ticket_id: str) -> broker_pb2.Ticket:
            return operator("GetTicket", broker_pb2.GetTicketRequest(ticket_id=ticket_id)).ticket  # type: ignore[attr-defined, no-any-return]

        def create(request_id: str) -> str:
            return operator("CreateTicket", broker_pb2.CreateTicketRequest(  # type: ignore[attr-defined, no-any-return]
                request_id=request_id, ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[3])).ticket.ticket_id  # fmt: skip

        # Not armed yet: "never started" is refused as such, recorded nowhere, and fences no one
        # (before, WRITE_BEFORE_ARM fenced ar-0). Nothing can have been written, so the ticket
        # still rolls back or arms as usual.
        unarmed = create("unarmed")
        code, reason, message = callers["ar-0"].refused(
            "ReportWrite", report("ar-0", unarmed, common_pb2.WRITE_STATUS_NOT_STARTED))
        assert (code, reason) == ("FAILED_PRECONDITION", "NOT_ARMED"), message
        assert not fenced("ar-0")
        assert ticket(unarmed).state == broker_pb2.TICKET_STATE_RESERVED
        assert ticket(unarmed).writes[0].status == common_pb2.WRITE_STATUS_UNSPECIFIED
        # Armed for ar-0 and its request over while ar-0's write may land: DRAINING, pages held.
        armed = create("armed")
        callers["ar-0"]("ReserveTicket", broker_pb2.ReserveTicketRequest(
            ticket_id=armed, ar_replica_id="ar-0", incarnation_id=infos["ar-0"].incarnation_id))  # fmt: skip
        callers["ar-0"]("ReserveTicket", broker_pb2.ReserveTicketRequest(
            ticket_id=unarmed, ar_replica_id="ar-0", incarnation_id=infos["ar-0"].incarnation_id))  # fmt: skip
        operator("CancelTicket", broker_pb2.CancelTicketRequest(ticket_id=armed))
        assert ticket(armed).state == broker_pb2.TICKET_STATE_DRAINING
        # Another AR (its own id and incarnation) reports ar-0's write, the DiT that is not the
        # ticket's reports its load: refused WRONG_REPLICA, nobody fenced, the write still unresolved.
        for status in (common_pb2.WRITE_STATUS_NOT_STARTED, common_pb2.WRITE_STATUS_FAILED):
            assert callers["ar-1"].refused("ReportWrite", report("ar-1", armed, status))[:2] == (
                "FAILED_PRECONDITION", "WRONG_REPLICA")
        assert callers["dit-1"].refused("ReportLoad", broker_pb2.ReportLoadRequest(
            ticket_id=armed, replica_id="dit-1", incarnation_id=infos["dit-1"].incarnation_id))[:2] == (
            "FAILED_PRECONDITION", "WRONG_REPLICA")  # fmt: skip
        time.sleep(0.5)  # past drain_quiet_seconds (0.2): nothing may have been freed meanwhile
        assert ticket(armed).state == broker_pb2.TICKET_STATE_DRAINING
        assert ticket(armed).writes[0].status == common_pb2.WRITE_STATUS_UNSPECIFIED
        pool = operator("GetPool", broker_pb2.GetPoolRequest(replica_id="dit-0")).pools[0]  # type: ignore[attr-defined]
        assert (pool.reserved_pages, pool.draining_pages) == (1, 1)
        assert not any(fenced(rid) for rid in infos)
        # A batch longer than the ticket's plan (one write) is refused before any of it applies.
        twice = report("ar-0", armed, common_pb2.WRITE_STATUS_NOT_STARTED)
        twice.writes.append(twice.writes[0])
        assert callers["ar-0"].refused("ReportWrite", twice)[:2] == ("INVALID_ARGUMENT", "TOO_MANY_ENTRIES")
        assert ticket(armed).writes[0].status == common_pb2.WRITE_STATUS_UNSPECIFIED
        # The real writer's word resolves it.
        callers["ar-0"]("ReportWrite", report("ar-0", armed, common_pb2.WRITE_STATUS_NOT_STARTED))
        deadline = time.monotonic() + 20
        while ticket(armed).state != broker_pb2.TICKET_STATE_RELEASED and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ticket(armed).state == broker_pb2.TICKET_STATE_RELEASED, broker.output()
