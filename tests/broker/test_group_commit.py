"""Group commit: the journal's writer thread writes the core's commits, several per fsync, and no
reply leaves the broker before the record behind it is on disk.

`kvrelay broker` runs its journal this way (`journal_group_commit=True`): the event loop only
encodes and queues each commit, so heartbeats and streams no longer wait behind fsyncs, and every
RPC reply (and every call to a replica) first awaits the journal: `Journal.durable()` (every commit
so far), or, for a reply that changed nothing, `Journal.durable_through` the commit behind what it
shows (`BrokerCore.commit_behind`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.journal import Journal, JournalWriteError
from kvrelay.broker.service import add_broker_servicer
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.helpers import ar_spec
from tests.broker.test_grpc import replica

TIMEOUT = 10.0


class Gate:
    """Holds the journal's writer thread before each transaction until a test opens it: an fsync
    that takes as long as the test wants."""

    def __init__(self, journal: Journal) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.transactions: list[int] = []  # statements per transaction, in order
        inner: Callable[[list[Any]], None] = journal._transaction  # noqa: SLF001 - the fault is injected here

        def gated(groups: list[Any]) -> None:
            self.entered.set()
            assert self.open.wait(TIMEOUT), "the test never opened the gate"
            inner(groups)
            self.transactions.append(len(groups))

        journal._transaction = gated  # type: ignore[method-assign]  # noqa: SLF001


def on_disk_tickets(path: Path) -> set[str]:
    """What a second connection reads: only committed transactions."""
    db = sqlite3.connect(path)
    try:
        return {row[0] for row in db.execute("SELECT ticket_id FROM tickets")}
    finally:
        db.close()


async def start_broker(core: BrokerCore) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    add_broker_servicer(core, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_a_reply_waits_until_its_record_is_on_disk_while_the_loop_serves_on(tmp_path: Path) -> None:
    """CreateTicket whose commit cannot reach the disk (the writer is held, as by a slow fsync)
    does not answer, and the ticket is not on disk; the event loop is free meanwhile (a health
    check answers). Once the write goes through, the reply comes and the ticket is on disk."""
    path = tmp_path / "j.sqlite"

    async def scenario() -> None:
        core = BrokerCore(path, lease_seconds=30.0, journal_synchronous="NORMAL", journal_group_commit=True)
        gate = Gate(core.journal)
        server, channel = await start_broker(core)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            for r in (replica("ar-0", common_pb2.REPLICA_ROLE_AR), replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)):
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
            gate.open.clear()
            gate.entered.clear()
            create = asyncio.ensure_future(stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]), timeout=TIMEOUT))
            # The core made the change and queued it; the writer is now inside the transaction.
            assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
            (ticket,) = core.list_tickets()
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.2)
            assert not create.done(), "CreateTicket answered before its record was on disk"
            assert ticket.ticket_id not in on_disk_tickets(path)
            assert core.journal.pending == 1
            gate.open.set()
            reply = await create
            assert reply.ticket.ticket_id == ticket.ticket_id
            assert ticket.ticket_id in on_disk_tickets(path)
        finally:
            gate.open.set()
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())


def test_commits_queued_behind_a_slow_fsync_share_the_next_one_in_order(tmp_path: Path) -> None:
    """Ten commits made while the writer syncs the first go to disk in one transaction, after it,
    and `durable()` returns for each only then; a second connection sees them in order."""
    path = tmp_path / "j.sqlite"

    async def scenario() -> None:
        journal = Journal(path, "FULL", group_commit=True)
        gate = Gate(journal)
        gate.open.clear()
        first = journal.commit(tickets={"t0": {"n": 0}})
        assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
        seqs = [journal.commit(tickets={f"t{n}": {"n": n}}, meta={"last": str(n)}) for n in range(1, 11)]
        assert seqs == list(range(first + 1, first + 11))
        waiting = asyncio.ensure_future(journal.durable())
        await asyncio.sleep(0.05)
        assert not waiting.done() and on_disk_tickets(path) == set()
        gate.open.set()
        await waiting
        assert journal.pending == 0
        assert gate.transactions == [1, 10]
        assert journal.stats.commits == 11 and journal.stats.transactions == 2 and journal.stats.largest_group == 10
        assert on_disk_tickets(path) == {f"t{n}" for n in range(11)}
        journal.close()

    asyncio.run(scenario())
    assert Journal(path).load().meta == {"last": "10"}


def test_a_failed_group_write_fails_every_waiter_and_refuses_later_commits(tmp_path: Path) -> None:
    """A disk-full write of state in the writer thread: the waiters get JournalWriteError, the
    broker's fail-stop hook runs on the event loop, nothing queued after it reaches the disk."""
    path = tmp_path / "j.sqlite"
    failures: list[tuple[str, bool]] = []

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        journal = Journal(path, "NORMAL", group_commit=True,
                          on_failure=lambda err: failures.append((err.reason, threading.get_ident() == loop_thread)))
        on_disk = journal.commit(tickets={"t0": {"state": "RESERVED"}})
        await journal.durable()
        pages = journal._db.execute("PRAGMA page_count").fetchone()[0]  # noqa: SLF001
        journal._db.execute(f"PRAGMA max_page_count={pages}")  # noqa: SLF001 - a full disk
        gate = Gate(journal)
        gate.open.clear()
        failing = journal.commit(tickets={"t1": {"state": "RESERVED", "pad": "x" * 50_000}})
        assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
        behind = journal.commit(tickets={"t2": {"state": "RESERVED"}})  # queued behind the one that fails
        await journal.durable_through(on_disk)  # on disk already: no wait for the held transaction
        waiting = [asyncio.ensure_future(journal.durable_through(seq)) for seq in (failing, behind)]
        gate.open.set()
        for waiter in waiting:
            with pytest.raises(JournalWriteError, match="database or disk is full"):
                await waiter
        with pytest.raises(JournalWriteError, match="database or disk is full"):
            await journal.durable()
        with pytest.raises(JournalWriteError, match="database or disk is full"):
            # Even a commit on disk before it: memory may since hold changes whose commit raised.
            await journal.durable_through(on_disk)
        await asyncio.sleep(0)  # the hook was scheduled onto the loop
        assert failures == [("database or disk is full", True)]
        with pytest.raises(JournalWriteError, match="database or disk is full"):
            journal.commit(tickets={"t0": None})
        journal.close()

    asyncio.run(scenario())
    assert Journal(path).load().tickets == {"t0": {"state": "RESERVED"}}


def test_a_failed_group_write_answers_the_rpc_journal_failed(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = BrokerCore(tmp_path / "j.sqlite", lease_seconds=30.0, journal_synchronous="NORMAL",
                          journal_group_commit=True)
        server, channel = await start_broker(core)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(
                replica=replica("dit-0", common_pb2.REPLICA_ROLE_DIT, heads=40, num_pages=16)), timeout=TIMEOUT)
            core.journal.flush()
            core.journal._db.execute("PRAGMA max_page_count=1")  # noqa: SLF001 - a full disk
            # A record that needs new pages (~40 KB: strings are bounded, FIELD_TOO_LONG, and a DiT has
            # one region a rank, so many ranks with long handles).
            big = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, tp=40, heads=40, num_pages=16)
            for region in big.regions:
                region.ipc_handle = b"\x01" * 1024
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=big), timeout=TIMEOUT)
            assert reason_of(err.value)[:2] == ("UNAVAILABLE", "JOURNAL_FAILED")
            assert core.journal.failure is not None
        finally:
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ kill -9 under load


def serve_until_killed(path: str, port_file: str) -> None:
    """The broker's side of the kill test, in a child process: a group-commit broker at FULL."""

    async def main() -> None:
        core = BrokerCore(path, lease_seconds=600.0, drain_quiet_seconds=0.0, journal_group_commit=True)
        server = grpc.aio.server()
        add_broker_servicer(core, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    asyncio.run(main())


_ORDER = ["RESERVED", "WRITING", "READY", "CONSUMING"]


async def _lifecycles(stub: broker_pb2_grpc.BrokerServiceStub, worker: int, acked: dict[str, str],
                      release_sent: set[str], released: set[str]) -> None:
    """Ticket lifecycles as the AR and DiT send them (batched reports), forever; `acked[t]` is the
    last state a reply confirmed, `release_sent` the tickets whose release left the client."""
    inc = {"ar-0": "ar-0-inc-1", "dit-0": "dit-0-inc-1"}
    n = 0
    while True:
        n += 1
        t = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id=f"w{worker}-{n}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[40, 3]),
            timeout=TIMEOUT)).ticket
        tid = t.ticket_id
        acked[tid] = "RESERVED"
        armed = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
            ticket_id=tid, ar_replica_id="ar-0", incarnation_id=inc["ar-0"]), timeout=TIMEOUT)
        acked[tid] = "WRITING"
        await stub.ReportWrite(broker_pb2.ReportWriteRequest(
            ticket_id=tid, replica_id="ar-0", incarnation_id=inc["ar-0"],
            writes=[broker_pb2.WriteReport(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                           status=common_pb2.WRITE_STATUS_OK, checksum=n) for w in armed.writes]),
            timeout=TIMEOUT)
        ready = await stub.ReportLoad(broker_pb2.ReportLoadRequest(
            ticket_id=tid, replica_id="dit-0", incarnation_id=inc["dit-0"],
            loads=[broker_pb2.LoadReport(row=ld.row, dst_rank=ld.dst_rank, verified=[
                broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=n)
                for w in armed.writes if w.row == ld.row and w.dst_rank == ld.dst_rank]) for ld in t.loads]),
            timeout=TIMEOUT)
        assert ready.ticket.state == broker_pb2.TICKET_STATE_READY
        acked[tid] = "READY"
        await stub.StartConsuming(broker_pb2.StartConsumingRequest(
            ticket_id=tid, replica_id="dit-0", incarnation_id=inc["dit-0"]), timeout=TIMEOUT)
        acked[tid] = "CONSUMING"
        release_sent.add(tid)
        await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
            ticket_id=tid, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0", incarnation_id=inc["dit-0"]),
            timeout=TIMEOUT)
        released.add(tid)


def test_a_broker_killed_mid_load_loses_no_acknowledged_change(repo_root: Path, tmp_path: Path) -> None:
    """Eight clients run lifecycles against a group-commit broker (FULL); it is SIGKILLed while
    RPCs are in flight. Every ticket a reply acknowledged and whose release was not sent is in
    the journal, in at least the acknowledged state; every acknowledged release is gone."""
    path, port_file = tmp_path / "broker.sqlite", tmp_path / "port"
    script = ("from tests.broker.test_group_commit import serve_until_killed; "
              f"serve_until_killed({str(path)!r}, {str(port_file)!r})")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=repo_root,
                             env={**os.environ, "PYTHONPATH": str(repo_root)})  # fmt: skip
    acked: dict[str, str] = {}
    release_sent: set[str] = set()
    released: set[str] = set()

    async def load() -> None:
        for _ in range(300):
            if port_file.exists() and port_file.read_text():
                break
            assert child.poll() is None, "the broker child exited"
            await asyncio.sleep(0.05)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port_file.read_text()}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for r in (replica("ar-0", common_pb2.REPLICA_ROLE_AR), replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=4096)):
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
        workers = [asyncio.ensure_future(_lifecycles(stub, w, acked, release_sent, released)) for w in range(8)]
        try:
            # Kill once enough went through and lifecycles are under way (not between two).
            give_up = asyncio.get_running_loop().time() + 60
            while len(released) < 40 or sum(t not in release_sent for t in acked) < 3:
                assert asyncio.get_running_loop().time() < give_up, f"only {len(released)} lifecycles in 60 s"
                await asyncio.sleep(0.003)
                for w in workers:
                    if w.done():
                        w.result()
            os.kill(child.pid, signal.SIGKILL)
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            for w in workers:
                w.cancel()
            await channel.close()

    try:
        asyncio.run(load())
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(TIMEOUT)
    assert child.returncode == -signal.SIGKILL
    # Requests were in flight at the kill: some acknowledged, some not.
    assert len(acked) > len(released) >= 40

    journal = Journal(path)
    journaled = journal.load().tickets
    journal.close()
    for tid, state in acked.items():
        if tid in released:
            assert tid not in journaled, f"{tid}: its release was acknowledged but the journal still holds it"
        elif tid not in release_sent:
            assert tid in journaled, f"{tid}: acknowledged {state}, lost by the kill"
            assert _ORDER.index(journaled[tid]["state"]) >= _ORDER.index(state), (tid, state, journaled[tid]["state"])
    # And the broker starts again from it: READY and CONSUMING tickets keep their pages until
    # their DiT registers again, WRITING ones drain (or end, every write reported OK), RESERVED
    # ones roll back.
    core = BrokerCore(path, journal_synchronous="NORMAL")
    try:
        held = {tid for tid, data in journaled.items() if data["state"] in ("READY", "CONSUMING")}
        assert held <= {t.ticket_id for t in core.list_tickets()} <= set(journaled)
        (pool,) = core.pool_status("dit-0")
        assert pool.reserved + pool.draining == sum(len(t.page_ids) for t in core.list_tickets())
    finally:
        core.close()


def test_a_replay_that_cannot_be_written_fails_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart's own commit (replicas back, tickets orphaned) is on disk before the broker
    serves; when it cannot be written the constructor raises, as without group commit, and
    `kvrelay broker` exits 1 instead of serving on a journal that failed."""
    path = tmp_path / "j.sqlite"
    core = BrokerCore(path, journal_synchronous="NORMAL")
    core.register_replica(ar_spec())
    core.close()

    def disk_error(self: Journal, groups: list[Any]) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Journal, "_transaction", disk_error)
    with pytest.raises(JournalWriteError, match="disk I/O error"):
        BrokerCore(path, journal_synchronous="NORMAL", journal_group_commit=True)


# ------------------------------------------------------------------ what a reply waits for


def test_a_reply_that_changed_nothing_waits_only_for_the_commits_behind_what_it_shows(tmp_path: Path) -> None:
    """The writer is held inside the transaction of a CreateTicket on ar-0/dit-0. Replies about
    other replicas and about a ticket already on disk answer meanwhile (a Heartbeat, GetPool,
    GetTicket, a WatchTicket's first event): before, every reply waited for the whole queue. Replies
    that show the queued ticket (GetTicket, its WatchTicket, its DiT's pool, every pool) wait for
    its record: a kill then would take back what they showed."""
    path = tmp_path / "j.sqlite"

    async def scenario() -> None:
        core = BrokerCore(path, lease_seconds=30.0, journal_synchronous="NORMAL", journal_group_commit=True)
        gate = Gate(core.journal)
        server, channel = await start_broker(core)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        parked_replies = 1  # CreateTicket's own wait on the journal

        async def parked(call: Any) -> None:
            """Until the reply waits for the journal (or, wrongly, answered): then it must not have."""
            nonlocal parked_replies
            parked_replies += 1
            while len(core.journal._waiters) < parked_replies and not call.done():  # noqa: SLF001
                await asyncio.sleep(0.005)
            assert not call.done(), "answered before the record it shows was on disk"
        try:
            for r in (replica("ar-0", common_pb2.REPLICA_ROLE_AR), replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16),
                      replica("ar-1", common_pb2.REPLICA_ROLE_AR), replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)):
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
            old = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r0", ar_replica_id="ar-1", dit_replica_id="dit-1", row_token_counts=[20]),
                timeout=TIMEOUT)).ticket
            gate.open.clear()
            gate.entered.clear()
            create = asyncio.ensure_future(stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]), timeout=TIMEOUT))
            assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
            (queued,) = [t for t in core.list_tickets() if t.request_id == "r1"]
            assert core.journal.pending == 1 and queued.ticket_id not in on_disk_tickets(path)

            # Unrelated: answered while the commit is held.
            for hb in (("ar-1", "ar-1-inc-1"), ("dit-1", "dit-1-inc-1")):
                reply = await stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id=hb[0], incarnation_id=hb[1]),
                                             timeout=TIMEOUT)
                assert not reply.fenced
            (pool,) = (await stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-1"), timeout=TIMEOUT)).pools
            assert pool.reserved_pages == 2
            got = await stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=old.ticket_id), timeout=TIMEOUT)
            assert got.ticket.state == broker_pb2.TICKET_STATE_RESERVED
            old_watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=old.ticket_id), timeout=TIMEOUT)
            assert (await old_watch.read()).ticket.ticket_id == old.ticket_id
            old_watch.cancel()
            assert not create.done() and core.journal.pending == 1

            # Showing the queued ticket: held until its record is on disk.
            held_ticket = asyncio.ensure_future(
                stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=queued.ticket_id), timeout=TIMEOUT))
            await parked(held_ticket)
            held_pool = asyncio.ensure_future(stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=TIMEOUT))
            await parked(held_pool)
            held_pools = asyncio.ensure_future(stub.GetPool(broker_pb2.GetPoolRequest(), timeout=TIMEOUT))
            await parked(held_pools)
            watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=queued.ticket_id), timeout=TIMEOUT)
            first_event = asyncio.ensure_future(watch.read())
            await parked(first_event)
            assert queued.ticket_id not in on_disk_tickets(path)

            gate.open.set()
            assert (await create).ticket.ticket_id == queued.ticket_id
            assert (await held_ticket).ticket.state == broker_pb2.TICKET_STATE_RESERVED
            assert (await held_pool).pools[0].reserved_pages == 2
            assert sorted(p.replica_id for p in (await held_pools).pools) == ["dit-0", "dit-1"]
            assert (await first_event).ticket.ticket_id == queued.ticket_id
            watch.cancel()
            assert queued.ticket_id in on_disk_tickets(path)
        finally:
            gate.open.set()
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())


def test_commit_behind_names_the_commit_that_last_changed_each_object(tmp_path: Path) -> None:
    """The core's bookkeeping behind the narrowed waits: a release (a queued commit) is behind the
    released ticket, its DiT's pool and its AR's polls, not behind another replica's record; a
    ticket dropped from the released history and an object unchanged since the load need nothing."""
    from tests.broker.helpers import dit_spec

    core = BrokerCore(tmp_path / "j.sqlite", journal_synchronous="NORMAL", journal_group_commit=True,
                      released_history=1)  # fmt: skip
    try:
        core.register_replica(ar_spec("ar-0"))
        core.register_replica(dit_spec("dit-0"))
        other = core.journal.submitted
        core.register_replica(ar_spec("ar-1"))
        assert core.commit_behind(replicas=["ar-1"]) == core.journal.submitted
        t = core.create_ticket("r1", "ar-0", "dit-0", [20])
        assert t is not None
        created = core.journal.submitted
        assert core.commit_behind(tickets=[t.ticket_id]) == created
        released = core.cancel_ticket(t.ticket_id)  # never armed: RELEASED at once
        assert released.state.value == "RELEASED" and core.journal.submitted == created + 1
        for behind in ({"tickets": [t.ticket_id]}, {"pools": ["dit-0"]}, {"polls_of": "ar-0"}):
            assert core.commit_behind(**behind) == created + 1, behind  # type: ignore[arg-type]
        assert core.commit_behind(replicas=["dit-0"]) == other
        assert core.commit_behind(replicas=["never-registered"], tickets=["unknown"]) == 0
        t2 = core.create_ticket("r2", "ar-0", "dit-0", [20])
        assert t2 is not None
        core.cancel_ticket(t2.ticket_id)  # pushes the first out of a history of one
        assert core.commit_behind(tickets=[t.ticket_id]) == 0
    finally:
        core.close()


def test_after_a_failed_write_no_narrowed_reply_shows_memory_ahead_of_the_disk(tmp_path: Path) -> None:
    """Once a write failed, the core still changes memory and only then finds its commit refused
    (never numbered): here a ticket armed and another cancelled after the failure. GetTicket and
    GetPool, whose records were on disk long before, must answer UNAVAILABLE JOURNAL_FAILED, not
    show the armed ticket or the freed pages (before, `durable_through` of a commit on disk
    returned: a kill then took back what they showed, as the journal below says)."""
    path = tmp_path / "j.sqlite"

    async def scenario() -> None:
        core = BrokerCore(path, lease_seconds=30.0, journal_synchronous="NORMAL", journal_group_commit=True)
        server, channel = await start_broker(core)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            for r in (replica("ar-0", common_pb2.REPLICA_ROLE_AR), replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)):
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
            armed, freed = [(await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id=f"r{n}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=TIMEOUT)).ticket for n in range(2)]

            def disk_error(groups: list[Any]) -> None:
                raise sqlite3.OperationalError("disk I/O error")

            core.journal._transaction = disk_error  # type: ignore[method-assign]  # noqa: SLF001
            core.register_replica(ar_spec("ar-1"))  # queued; the writer fails it
            while core.journal.failure is None:
                await asyncio.sleep(0.005)
            with pytest.raises(JournalWriteError):
                core.arm_ticket(armed.ticket_id, "ar-0", "ar-0-inc-1")
            with pytest.raises(JournalWriteError):
                core.cancel_ticket(freed.ticket_id)
            assert core.get_ticket(armed.ticket_id).armed and core.pool_status("dit-0")[0].reserved == 2

            for call in (stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=armed.ticket_id), timeout=TIMEOUT),
                         stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=freed.ticket_id), timeout=TIMEOUT),
                         stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=TIMEOUT)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert reason_of(err.value)[:2] == ("UNAVAILABLE", "JOURNAL_FAILED")
            watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=armed.ticket_id), timeout=TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch.read()
            assert reason_of(err.value)[:2] == ("UNAVAILABLE", "JOURNAL_FAILED")
        finally:
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())
    tickets = Journal(path).load().tickets
    assert sorted(t["state"] for t in tickets.values()) == ["RESERVED", "RESERVED"]
    assert not any(t["armed"] for t in tickets.values())


def test_a_watch_of_a_ticket_pushed_out_of_the_history_waits_for_its_release(tmp_path: Path) -> None:
    """With a history of one, a release still queued is pushed out by the next one: WatchTicket
    then finds no such ticket. That NOT_FOUND shows the release (a kill before its commit brings the
    ticket back, live), so it waits for the journal like every other refusal; before, the stream
    ended at once."""
    path = tmp_path / "j.sqlite"

    async def scenario() -> None:
        core = BrokerCore(path, lease_seconds=30.0, journal_synchronous="NORMAL", journal_group_commit=True,
                          released_history=1)  # fmt: skip
        gate = Gate(core.journal)
        server, channel = await start_broker(core)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            for r in (replica("ar-0", common_pb2.REPLICA_ROLE_AR), replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)):
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=r), timeout=TIMEOUT)
            gone = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="r0", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=TIMEOUT)).ticket.ticket_id
            gate.open.clear()
            gate.entered.clear()
            core.cancel_ticket(gone)  # never armed: RELEASED, its commit held by the writer
            assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
            later = core.create_ticket("r1", "ar-0", "dit-0", [20])
            assert later is not None
            core.cancel_ticket(later.ticket_id)  # pushes `gone` out of the history
            assert gone in on_disk_tickets(path)

            watch = stub.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=gone), timeout=TIMEOUT)
            first = asyncio.ensure_future(watch.read())
            while not core.journal._waiters and not first.done():  # noqa: SLF001
                await asyncio.sleep(0.005)
            assert not first.done(), "NOT_FOUND answered before the release it shows was on disk"
            gate.open.set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await first
            assert reason_of(err.value)[:2] == ("NOT_FOUND", "UNKNOWN_TICKET")
            assert gone not in on_disk_tickets(path)
        finally:
            gate.open.set()
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())
