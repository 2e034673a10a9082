"""ReportWrite and ReportLoad carry several writes / loads of one ticket in one call and one
journal commit (the AR reports a ticket's outcomes at once, the DiT its verified loads), with the
same rules as one report each: a refused one leaves those before it applied and journaled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvrelay.broker.core import BrokerCore, ReportedWrite
from kvrelay.broker.service import BrokerServicer
from kvrelay.broker.tickets import BrokenInvariant, FailedPrecondition, LoadKey, TicketState, WriteStatus
from kvrelay.v1 import broker_pb2, common_pb2
from tests.broker.helpers import ManualClock, ar_spec, checksum_of, dit_spec


@pytest.fixture
def core(tmp_path: Any) -> BrokerCore:
    c = BrokerCore(str(tmp_path / "j.sqlite"), clock=ManualClock(), lease_seconds=10.0, drain_quiet_seconds=2.0,
                   journal_synchronous="OFF")  # fmt: skip
    yield c
    c.close()


@pytest.fixture
def specs(core: BrokerCore):
    ar, dit = ar_spec(tp=2), dit_spec(tp=2, num_pages=32)
    core.register_replica(ar)
    core.register_replica(dit)
    return ar, dit


def armed(core: BrokerCore, ar: Any) -> Any:
    t = core.create_ticket("req-1", ar.replica_id, "dit-0", [40, 3])
    assert t is not None
    return core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket


def count_commits(core: BrokerCore) -> list[int]:
    calls = [0]
    real = core.journal.commit

    def counting(**kw: Any) -> None:
        calls[0] += 1
        real(**kw)

    core.journal.commit = counting  # type: ignore[method-assign]
    return calls


def ok_reports(ticket: Any) -> list[ReportedWrite]:
    return [ReportedWrite(w.key, WriteStatus.OK, checksum_of(ticket.ticket_id, w.key), 100) for w in ticket.writes]


def verified_loads(ticket: Any) -> list[Any]:
    return [
        (ld.key, {w.key: checksum_of(ticket.ticket_id, w.key) for w in ticket.writes
                  if (w.key.row, w.key.dst_rank) == (ld.key.row, ld.key.dst_rank)})
        for ld in ticket.loads
    ]  # fmt: skip


def test_a_tickets_writes_and_loads_each_in_one_commit(core: BrokerCore, specs: Any) -> None:
    ar, dit = specs
    t = armed(core, ar)
    commits = count_commits(core)
    t = core.report_writes(t.ticket_id, ok_reports(t), replica_id=ar.replica_id, incarnation_id=ar.incarnation_id)
    assert len(t.writes) == 4 and all(w.status is WriteStatus.OK for w in t.writes)
    assert commits[0] == 1
    t = core.report_loads(t.ticket_id, verified_loads(t), replica_id=dit.replica_id,
                          incarnation_id=dit.incarnation_id)  # fmt: skip
    assert t.state is TicketState.READY
    assert commits[0] == 2
    # Retries of either batch change nothing and write nothing.
    core.report_writes(t.ticket_id, ok_reports(t), replica_id=ar.replica_id, incarnation_id=ar.incarnation_id)
    core.report_loads(t.ticket_id, verified_loads(t), replica_id=dit.replica_id, incarnation_id=dit.incarnation_id)
    assert commits[0] == 2
    # What a batch changed is on disk: a broker restarted from the journal sees every write OK.
    stored = core.journal.load().tickets[t.ticket_id]
    assert stored["state"] == "READY"


def test_a_refused_write_in_a_batch_keeps_those_before_it_journaled(core: BrokerCore, specs: Any) -> None:
    ar, _ = specs
    t = armed(core, ar)
    first = ok_reports(t)[0]
    core.report_write(t.ticket_id, first.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.OK, checksum=first.checksum, nbytes=100)  # fmt: skip
    second = ok_reports(t)[1]
    contradiction = ReportedWrite(first.key, WriteStatus.FAILED, 0, 0, "no")
    with pytest.raises(BrokenInvariant) as err:
        core.report_writes(t.ticket_id, [second, contradiction], replica_id=ar.replica_id,
                           incarnation_id=ar.incarnation_id)  # fmt: skip
    assert err.value.reason == "CONFLICTING_REPORT"
    stored = core.journal.load().tickets[t.ticket_id]
    journaled = {(w[0], w[1], w[2]): w[3] for w in stored["writes"]}
    assert journaled[(second.key.row, second.key.src_rank, second.key.dst_rank)] == WriteStatus.OK.value, (
        "applied before the refusal, so journaled")
    assert [r.fenced for r in core.list_replicas() if r.spec.replica_id == "ar-0"] == [True]


def test_a_mismatched_load_in_a_batch_keeps_those_before_it(core: BrokerCore, specs: Any) -> None:
    ar, dit = specs
    t = armed(core, ar)
    t = core.report_writes(t.ticket_id, ok_reports(t), replica_id=ar.replica_id, incarnation_id=ar.incarnation_id)
    loads = verified_loads(t)
    key, verified = loads[1]
    loads[1] = (key, {k: v ^ 1 for k, v in verified.items()})
    with pytest.raises(FailedPrecondition) as err:
        core.report_loads(t.ticket_id, loads, replica_id=dit.replica_id, incarnation_id=dit.incarnation_id)
    assert err.value.reason == "CHECKSUM_MISMATCH"
    loaded = {ld.key: ld.loaded for ld in core.get_ticket(t.ticket_id).loads}
    assert loaded[loads[0][0]] and not loaded[key]
    assert core.get_ticket(t.ticket_id).state is TicketState.WRITING


class _Context:
    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise AssertionError(f"aborted: {code} {details}")


def test_the_rpcs_take_a_batch_and_still_take_one(core: BrokerCore, specs: Any) -> None:
    ar, dit = specs
    t = armed(core, ar)
    servicer = BrokerServicer(core)
    reports = ok_reports(t)

    async def calls() -> broker_pb2.Ticket:
        single = reports[0]
        await servicer.ReportWrite(broker_pb2.ReportWriteRequest(
            ticket_id=t.ticket_id, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
            row=single.key.row, src_rank=single.key.src_rank, dst_rank=single.key.dst_rank,
            status=common_pb2.WRITE_STATUS_OK, checksum=single.checksum, bytes=100), _Context())
        await servicer.ReportWrite(broker_pb2.ReportWriteRequest(
            ticket_id=t.ticket_id, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
            writes=[broker_pb2.WriteReport(row=r.key.row, src_rank=r.key.src_rank, dst_rank=r.key.dst_rank,
                                           status=common_pb2.WRITE_STATUS_OK, checksum=r.checksum, bytes=100)
                    for r in reports[1:]]), _Context())
        reply = await servicer.ReportLoad(broker_pb2.ReportLoadRequest(
            ticket_id=t.ticket_id, replica_id=dit.replica_id, incarnation_id=dit.incarnation_id,
            loads=[broker_pb2.LoadReport(row=key.row, dst_rank=key.dst_rank, verified=[
                broker_pb2.WriteProgress(row=k.row, src_rank=k.src_rank, dst_rank=k.dst_rank, checksum=c)
                for k, c in verified.items()]) for key, verified in verified_loads(t)]), _Context())
        return reply.ticket

    ticket = asyncio.run(calls())
    assert ticket.state == broker_pb2.TICKET_STATE_READY
    assert all(w.status == common_pb2.WRITE_STATUS_OK for w in ticket.writes)
    assert servicer.rpc_counts["ReportWrite"] == 2 and servicer.rpc_counts["ReportLoad"] == 1
    assert LoadKey(0, 0) in {ld.key for ld in core.get_ticket(t.ticket_id).loads}
