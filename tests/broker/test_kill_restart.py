"""A real `kvrelay broker` SIGKILLed under concurrent load and started again on the same journal:
nothing any reply showed before the kill un-happens (docs/broker.md, Journal and restart).

The in-process variant (tests/broker/test_group_commit.py) reads the journal file; this one asks the
restarted process over gRPC, and it also counts what the replies that changed nothing showed
(GetTicket, WatchTicket, ListTickets: `commit_behind` narrows their wait), not only the
acknowledgements of the calls that made the changes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import replica
from tests.procs import ServiceProcess, start_service

TIMEOUT = 10.0
AR, DIT = "ar-0", "dit-0"
INC = {AR: f"{AR}-inc-1", DIT: f"{DIT}-inc-1"}
_HOLDING = {broker_pb2.TICKET_STATE_READY, broker_pb2.TICKET_STATE_CONSUMING}


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN"):
        monkeypatch.delenv(env, raising=False)


@dataclass
class Seen:
    """What replies showed before the kill, per ticket id."""

    ids: set[str] = field(default_factory=set)
    armed: set[str] = field(default_factory=set)
    holding: set[str] = field(default_factory=set)  # shown READY or CONSUMING
    released: set[str] = field(default_factory=set)
    # Whose CancelTicket or ReleaseTicket left the client: a kill may have cut its answer only.
    release_sent: set[str] = field(default_factory=set)

    def note(self, t: broker_pb2.Ticket) -> None:
        self.ids.add(t.ticket_id)
        if t.armed:
            self.armed.add(t.ticket_id)
        if t.state in _HOLDING:
            self.holding.add(t.ticket_id)
        if t.state == broker_pb2.TICKET_STATE_RELEASED:
            self.released.add(t.ticket_id)


def _start(repo_root: Path, config: Path) -> ServiceProcess:
    return start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=repo_root)


async def _lifecycles(stub: broker_pb2_grpc.BrokerServiceStub, worker: int, seen: Seen, rng: random.Random) -> None:
    """AR and DiT calls of one ticket after another; some cancelled before or after arming."""
    for n in itertools.count():
        t = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id=f"w{worker}-{n}", ar_replica_id=AR, dit_replica_id=DIT, row_token_counts=[40, 3]),
            timeout=TIMEOUT)).ticket
        seen.note(t)
        tid = t.ticket_id
        if rng.random() < 0.15:
            seen.release_sent.add(tid)
            seen.note((await stub.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=tid), timeout=TIMEOUT)).ticket)
            continue
        armed = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
            ticket_id=tid, ar_replica_id=AR, incarnation_id=INC[AR]), timeout=TIMEOUT)
        seen.note(armed.ticket)
        written = await stub.ReportWrite(broker_pb2.ReportWriteRequest(
            ticket_id=tid, replica_id=AR, incarnation_id=INC[AR],
            writes=[broker_pb2.WriteReport(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                           status=common_pb2.WRITE_STATUS_OK, checksum=n) for w in armed.writes]),
            timeout=TIMEOUT)  # fmt: skip
        seen.note(written.ticket)
        if rng.random() < 0.15:
            seen.release_sent.add(tid)
            seen.note((await stub.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=tid), timeout=TIMEOUT)).ticket)
            continue
        ready = await stub.ReportLoad(broker_pb2.ReportLoadRequest(
            ticket_id=tid, replica_id=DIT, incarnation_id=INC[DIT],
            loads=[broker_pb2.LoadReport(row=ld.row, dst_rank=ld.dst_rank, verified=[
                broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=n)
                for w in armed.writes if w.row == ld.row and w.dst_rank == ld.dst_rank]) for ld in t.loads]),
            timeout=TIMEOUT)  # fmt: skip
        seen.note(ready.ticket)
        seen.note((await stub.StartConsuming(broker_pb2.StartConsumingRequest(
            ticket_id=tid, replica_id=DIT, incarnation_id=INC[DIT]), timeout=TIMEOUT)).ticket)
        if worker == 0:
            # A DiT still reading when the broker dies: this ticket is shown CONSUMING and never
            # released, so the kill always leaves one held (releases answered after the kill
            # signal could otherwise take every other held one out of `holding - released`).
            while True:  # ends when the killed broker stops answering
                seen.note((await stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=tid), timeout=TIMEOUT)).ticket)
                await asyncio.sleep(0.05)
        seen.release_sent.add(tid)
        seen.note((await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
            ticket_id=tid, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id=DIT, incarnation_id=INC[DIT]),
            timeout=TIMEOUT)).ticket)


async def _observer(stub: broker_pb2_grpc.BrokerServiceStub, seen: Seen, rng: random.Random) -> None:
    """Replies that change nothing: GetTicket and a WatchTicket's first event of a recent ticket
    (their wait narrowed to that ticket's commit), the whole listing now and then, heartbeats."""
    for n in itertools.count():
        if seen.ids:
            tid = rng.choice(sorted(seen.ids)[-32:])
            try:
                seen.note((await stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=tid), timeout=TIMEOUT)).ticket)
                watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=tid), timeout=TIMEOUT)
                seen.note((await watch.read()).ticket)
                watch.cancel()
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:  # pushed out of the released history
                    raise
        if n % 8 == 0:
            for t in (await stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=TIMEOUT)).tickets:
                seen.note(t)
        for rid in (AR, DIT):
            await stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id=rid, incarnation_id=INC[rid]), timeout=TIMEOUT)


@pytest.mark.slow
def test_a_killed_broker_restarted_on_its_journal_takes_back_nothing_a_reply_showed(
    repo_root: Path, tmp_path: Path
) -> None:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "journal.sqlite"), lease_seconds=60, drain_quiet_seconds=0)
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    seen = Seen()

    broker = _start(repo_root, config)
    try:

        async def load() -> None:
            channel = grpc.aio.insecure_channel(broker.address)
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for r in (replica(AR, common_pb2.REPLICA_ROLE_AR), replica(DIT, common_pb2.REPLICA_ROLE_DIT, num_pages=4096)):
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
            tasks = [asyncio.ensure_future(_lifecycles(stub, w, seen, random.Random(w))) for w in range(6)]
            tasks += [asyncio.ensure_future(_observer(stub, seen, random.Random(100 + w))) for w in range(2)]
            try:
                give_up = asyncio.get_running_loop().time() + 60
                while len(seen.released) < 40 or len(seen.holding - seen.released) < 2:
                    assert asyncio.get_running_loop().time() < give_up, f"{len(seen.released)} releases in 60 s"
                    await asyncio.sleep(0.005)
                    for task in tasks:
                        if task.done():
                            task.result()  # a worker's own failure, before the kill
                broker.proc.send_signal(signal.SIGKILL)  # calls in flight: some answered, some not
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                for task in tasks:
                    task.cancel()
                await channel.close()

        asyncio.run(load())
        assert broker.proc.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        broker.stop()

    assert seen.released and seen.armed and seen.holding - seen.released
    again = _start(repo_root, config)
    try:
        with grpc.insecure_channel(again.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            # Asked before any replica registers again (a DiT's reconciliation would end tickets).
            for tid in sorted(seen.ids):
                try:
                    t = stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=tid), timeout=TIMEOUT).ticket
                except grpc.RpcError as err:
                    assert reason_of(err)[:2] == ("NOT_FOUND", "UNKNOWN_TICKET"), err
                    # Unknown only once released: a release is deleted from the journal.
                    assert tid in seen.release_sent, f"{tid}: a reply showed it, the restarted broker lost it"
                    continue
                # Known: restored from the journal (the restart may have ended it since).
                assert tid not in seen.released, f"{tid}: a reply showed it RELEASED, the restart brought it back"
                assert t.reason == "BROKER_RESTARTED" or t.state != broker_pb2.TICKET_STATE_RELEASED, t
                if tid in seen.armed:
                    assert t.armed, f"{tid}: a reply showed it armed, the restarted broker has it unarmed"
                if tid in seen.holding:
                    assert t.state in _HOLDING, f"{tid}: shown READY/CONSUMING, restored {t.state}"
            (pool,) = stub.GetPool(broker_pb2.GetPoolRequest(replica_id=DIT), timeout=TIMEOUT).pools
            held = stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=TIMEOUT).tickets
            assert pool.reserved_pages + pool.draining_pages == sum(len(r.page_ids) for t in held for r in t.rows)
    finally:
        assert again.stop() == 0, again.output()
