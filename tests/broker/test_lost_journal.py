"""A broker that holds no record of a DiT incarnation registered before (its journal lost or
replaced, a new broker pointed at running replicas, a journal restored from a backup older than
the incarnation) cannot know which of its pages an AR's write may still land in: the DiT's
re-registration is answered fenced and kept nowhere, so that process fails stop and only its next
incarnation (new memory) gets a pool. Before, it came back with every page free and a new ticket
got pages a stopped writer still wrote into (tests/e2e/test_journal_lost_under_a_stopped_writer.py,
real processes). docs/broker.md, Journal and restart."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import Registration
from kvrelay.broker.service import BrokerServicer
from kvrelay.broker.tickets import InvalidArgument, NotFound, WriteKey, WriteStatus
from kvrelay.dit_service.fence import PageFence, Superseded
from kvrelay.dit_service.registration import DitReplicaInfo, RegistrationRefused
from kvrelay.dit_service.registration import Registration as DitRegistration
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, new_incarnation
from tests.orchestrator.harness import run


def _core(path: Path, clock: ManualClock) -> BrokerCore:
    return BrokerCore(path, clock=clock, drain_quiet_seconds=0.5, journal_synchronous="NORMAL")


def _in_doubt(core: BrokerCore, ar, dit) -> str:  # noqa: ANN001
    """A ticket whose AR write is in doubt (the sender's wait ended, its call still runs)."""
    t = core.create_ticket("req", ar.replica_id, dit.replica_id, [16])
    assert t is not None
    core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    key = WriteKey(row=0, src_rank=0, dst_rank=0)
    core.report_write(t.ticket_id, key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.IN_DOUBT)
    return t.ticket_id


def test_a_dit_registered_before_is_fenced_by_a_broker_on_a_lost_journal(tmp_path: Path) -> None:
    clock = ManualClock()
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    old = _core(tmp_path / "old.sqlite", clock)
    old.register_replica(ar)
    old.register_replica(dit)
    ticket_id = _in_doubt(old, ar, dit)
    assert old.pool_status("dit-0")[0].free == 7
    old.close()

    lost = _core(tmp_path / "new.sqlite", clock)  # the journal is gone
    reply = lost.register_replica(dit, registered_before=True)
    assert (reply.fenced, reply.registration) == (True, Registration.UNKNOWN)
    assert lost.registry.find("dit-0") is None  # kept nowhere: no record, no pool
    with pytest.raises(NotFound):
        lost.pool_status("dit-0")
    # The AR's listing of its write is refused until a DiT registers (no pool known: as before).
    listed = [(ticket_id, WriteKey(0, 0, 0))]
    with pytest.raises(InvalidArgument, match="TOO_MANY_ENTRIES|at most 0"):
        lost.register_replica(ar, unresolved_writes=listed)
    lost.register_replica(ar)
    with pytest.raises(NotFound):  # nothing is placed in that memory
        lost.create_ticket("next", "ar-0", "dit-0", [16])
    # Its next incarnation (new memory, new transport ports) gets the whole pool; the AR's write,
    # into the old process's memory, is an unknown ticket's here and changes nothing.
    again = lost.register_replica(new_incarnation(dit), registered_before=False)
    assert (again.fenced, again.registration) == (False, Registration.NEW)
    lost.register_replica(ar, unresolved_writes=listed)
    assert lost.pool_status("dit-0")[0].free == 8
    # A first registration (registered_before False) of an id the broker never saw is NEW, as before.
    assert lost.register_replica(dit_spec("dit-1"), registered_before=False).registration is Registration.NEW
    lost.close()


def test_a_journal_restored_from_an_older_backup_fences_a_dit_incarnation_it_does_not_hold(tmp_path: Path) -> None:
    clock = ManualClock()
    ar, first = ar_spec(), dit_spec(num_pages=8)
    path = tmp_path / "broker.sqlite"
    core = _core(path, clock)
    core.register_replica(ar)
    core.register_replica(first)
    core.close()
    shutil.copy(path, tmp_path / "backup.sqlite")  # the backup knows `first` only
    core = _core(path, clock)
    second = new_incarnation(first)
    core.register_replica(ar)
    core.register_replica(second)
    _in_doubt(core, ar, second)
    core.close()
    shutil.copy(tmp_path / "backup.sqlite", path)
    for wal in tmp_path.glob("broker.sqlite-*"):
        wal.unlink()

    restored = _core(path, clock)
    reply = restored.register_replica(second, registered_before=True)
    assert (reply.fenced, reply.registration) == (True, Registration.UNKNOWN)
    # The backup's own incarnation is not replaced by the refused one.
    assert restored.registry.get("dit-0").spec.incarnation_id == first.incarnation_id
    restored.close()


def test_a_journal_older_than_a_ticket_the_dit_saw_fences_its_same_incarnation(tmp_path: Path) -> None:
    """A backup that holds the DiT's incarnation but not the tickets reserved after it: the DiT
    tells the highest sequence whose pages it claimed (its page fence), above the journal's last."""
    clock = ManualClock()
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    path = tmp_path / "broker.sqlite"
    core = _core(path, clock)
    core.register_replica(ar)
    core.register_replica(dit)
    core.close()
    shutil.copy(path, tmp_path / "backup.sqlite")
    core = _core(path, clock)
    core.register_replica(ar)
    core.register_replica(dit, registered_before=True)
    seen = core.get_ticket(_in_doubt(core, ar, dit)).sequence
    core.close()
    # The journal as it is: the DiT's claim is one it knows.
    core = _core(path, clock)
    reply = core.register_replica(dit, registered_before=True, highest_ticket_sequence=seen)
    assert (reply.fenced, reply.registration) == (False, Registration.SAME_INCARNATION)
    core.close()
    shutil.copy(tmp_path / "backup.sqlite", path)
    for wal in tmp_path.glob("broker.sqlite-*"):
        wal.unlink()
    restored = _core(path, clock)
    reply = restored.register_replica(dit, registered_before=True, highest_ticket_sequence=seen)
    assert (reply.fenced, reply.registration) == (True, Registration.UNKNOWN)
    restored.close()


def test_the_page_fence_keeps_the_highest_sequence_it_claimed() -> None:
    fence = PageFence()
    assert fence.highest_sequence == 0
    fence.claim("b", 7, [(0, 1)])
    with pytest.raises(Superseded):
        fence.claim("a", 5, [(0, 1)])
    fence.claim("c", 6, [(0, 2)])
    assert fence.highest_sequence == 7


def test_a_journaled_incarnation_and_one_this_broker_forgot_idle_are_taken_back(tmp_path: Path) -> None:
    clock = ManualClock()
    ar, dit = ar_spec(), dit_spec(num_pages=8)
    path = tmp_path / "broker.sqlite"
    core = _core(path, clock)
    core.register_replica(ar)
    core.register_replica(dit)
    _in_doubt(core, ar, dit)
    core.close()
    core = _core(path, clock)  # restarted on its journal: it knows the incarnation and its ticket
    reply = core.register_replica(dit, registered_before=True)
    assert (reply.fenced, reply.registration) == (False, Registration.SAME_INCARNATION)
    assert core.pool_status("dit-0")[0].draining == 1
    core.close()

    idle = _core(tmp_path / "idle.sqlite", clock)
    other = dit_spec("dit-1", num_pages=8)
    idle.register_replica(other)
    idle.deregister_replica("dit-1", other.incarnation_id)
    idle.forget_replica("dit-1")  # nothing of it was in doubt: this broker knew it all
    reply = idle.register_replica(other, registered_before=True)
    assert (reply.fenced, reply.registration) == (False, Registration.NEW)
    assert idle.pool_status("dit-1")[0].free == 8
    idle.close()


def test_the_dit_says_it_was_registered_before_and_fails_stop_on_a_broker_that_lost_it(tmp_path: Path) -> None:
    """Through gRPC with the DiT's own registration client: a broker on its journal takes the
    re-registration, one on a new journal answers it fenced and the DiT fails stop."""

    async def endpoint_ok(endpoint: str) -> str:
        return ""

    async def never_alive(endpoint: str, incarnation_id: str) -> bool:
        return False

    async def broker(path: Path) -> tuple[BrokerCore, grpc.aio.Server, int]:
        core = BrokerCore(path, journal_synchronous="NORMAL", lease_seconds=30.0)
        server = grpc.aio.server()
        servicer = BrokerServicer(core, endpoint_probe=endpoint_ok, incarnation_probe=never_alive)
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return core, server, port

    async def body() -> None:
        fenced: list[str] = []
        info = DitReplicaInfo("dit-0", "inc-1", "127.0.0.1:2", 1, KvGeometry(2, 2, 8, "float32", 4), 1, 1, 16, 1,
                              "grpc", (RegionDescriptor(0, "grpc", "127.0.0.1:2", 0, 16 * 1024),))  # fmt: skip
        registration: DitRegistration | None = None
        # First start, a restart on the same journal, then a broker on a new one.
        for journal, answered_fenced in (("a.sqlite", False), ("a.sqlite", False), ("b.sqlite", True)):
            core, server, port = await broker(tmp_path / journal)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            if registration is None:
                registration = DitRegistration(stub, info, interval_s=1.0, token=None, on_fenced=fenced.append)
            registration.stub = stub
            try:
                if answered_fenced:
                    with pytest.raises(RegistrationRefused):
                        await registration.register(broker=f"127.0.0.1:{port}", wait_s=5.0)
                    assert fenced == ["registration answered fenced"]
                    assert core.registry.find("dit-0") is None
                else:
                    await registration.register(broker=f"127.0.0.1:{port}", wait_s=5.0)
                    assert fenced == []
                    assert core.pool_status("dit-0")[0].free == 16
            finally:
                await channel.close()
                await server.stop(0)
                core.close()

    run(body(), timeout=30)


def test_an_ar_registered_before_is_taken_by_a_broker_that_lost_it(tmp_path: Path) -> None:
    """An AR holds no pool (its in-doubt writes land in DiT memory, fenced above): a broker that
    lost it takes it back as NEW, whatever it says."""
    core = _core(tmp_path / "new.sqlite", ManualClock())
    reply = core.register_replica(ar_spec(), registered_before=True)
    assert (reply.fenced, reply.registration) == (False, Registration.NEW)
    core.close()



def test_the_dit_sends_what_it_saw_once_a_broker_took_it() -> None:
    sent: list[tuple[bool, int]] = []

    class Broker:
        async def RegisterReplica(self, request: Any, **kw: Any) -> Any:  # noqa: N802
            sent.append((request.registered_before, request.highest_ticket_sequence))
            return broker_pb2.RegisterReplicaResponse(lease_seconds=10.0)

    info = DitReplicaInfo("dit-0", "inc-1", "127.0.0.1:2", 1, KvGeometry(2, 2, 8, "float32", 4), 1, 1, 16, 1,
                          "grpc", (RegionDescriptor(0, "grpc", "127.0.0.1:2", 0, 16 * 1024),))  # fmt: skip
    fence = PageFence()
    registration = DitRegistration(Broker(), info, interval_s=1.0, token=None, on_fenced=lambda _r: None,  # type: ignore[arg-type]
                                   highest_sequence=lambda: fence.highest_sequence)  # fmt: skip

    async def body() -> None:
        await registration.register(broker="127.0.0.1:1", wait_s=1.0)
        fence.claim("t", 9, [(0, 0)])
        await registration.register(broker="127.0.0.1:1", wait_s=1.0)

    run(body(), timeout=10)
    assert sent == [(False, 0), (True, 9)]
