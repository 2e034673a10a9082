"""`kvrelay forget` / BrokerService.ForgetReplica against a real `kvrelay broker` process: a replica
gone for good is forgotten (memory and journal: a restart on the same journal does not bring it
back); one that is up, or that a live ticket names, is refused naming why; only an operator may
call it (docs/operations.md, Retiring a replica). Replicas are raw RegisterReplica calls."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import FailedPrecondition, TicketState
from kvrelay.client import AsyncKvRelayClient, KvRelayError
from kvrelay.config import BrokerConfig
from kvrelay.errors import reason_of
from kvrelay.node.cli import main
from kvrelay.security import AUTHORIZATION_METADATA, REPLICA_ID_METADATA
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.helpers import ManualClock, ar_spec, dit_spec
from tests.broker.test_grpc import replica
from tests.procs import ServiceProcess, start_service

REPLICA_TOKEN, OPERATOR_TOKEN = "replica-token-forget-1", "operator-token-forget-2"


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN"):
        monkeypatch.delenv(env, raising=False)


def _start_broker(
    repo_root: Path, tmp_path: Path, env: dict[str, str] | None = None, forget_after: float | None = None
) -> ServiceProcess:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    # A lease that outlasts a loaded runner's pauses: "up" stays up until the test deregisters it.
    cfg["broker"].update(journal_path=str(tmp_path / "journal.sqlite"), lease_seconds=60,
                         forget_down_replicas_after_seconds=forget_after)  # fmt: skip
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"],
                         cwd=repo_root, env=env)  # fmt: skip


def _md(token: str | None = None, replica_id: str | None = None) -> list[tuple[str, str]]:
    md = [(AUTHORIZATION_METADATA, f"Bearer {token}")] if token else []
    return md + ([(REPLICA_ID_METADATA, replica_id)] if replica_id else [])


def _register(stub: Any, info: broker_pb2.ReplicaInfo, token: str | None = None) -> None:
    stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info, token=token or ""), timeout=10,
                         metadata=_md(token, info.replica_id))  # fmt: skip


def _deregister(stub: Any, info: broker_pb2.ReplicaInfo, token: str | None = None) -> None:
    stub.DeregisterReplica(
        broker_pb2.DeregisterReplicaRequest(replica_id=info.replica_id, incarnation_id=info.incarnation_id),
        timeout=10, metadata=_md(token, info.replica_id),
    )  # fmt: skip


def _listed(stub: Any, token: str | None = None) -> dict[str, bool]:
    reply = stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10, metadata=_md(token))
    return {r.replica_id: r.up for r in reply.replicas}


def _forget_cli(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["forget", "--target", address, *args])
    out, err = capsys.readouterr()
    return code, out, err


def _status_ids(capsys: pytest.CaptureFixture[str], address: str) -> list[str]:
    capsys.readouterr()
    assert main(["status", "--target", address, "--json"]) == 0
    return [r["replica_id"] for r in json.loads(capsys.readouterr().out)["replicas"]]


def test_forget_a_down_replica_refuse_an_up_or_ticketed_one_and_the_journal_forgets_it_too(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    dit0 = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    dit1 = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for info in (ar, dit0, dit1):
                _register(stub, info)
            ticket = stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="req-1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]),
                timeout=10).ticket  # fmt: skip
            _deregister(stub, dit1)  # the scaled-down replica: down, named by no ticket

            # Up: refused, naming why.
            code, out, err = _forget_cli(capsys, broker.address, "ar-0")
            assert code == 1 and out == "", (out, err)
            assert err.startswith("ar-0 not forgotten: FAILED_PRECONDITION (REPLICA_UP):"), err

            # Down but named by a live ticket (its pages may still be written): refused.
            _deregister(stub, dit0)
            code, out, err = _forget_cli(capsys, broker.address, "dit-0", "dit-1", "no-such-replica")
            assert code == 1, (out, err)
            assert out.splitlines() == ["dit-1 forgotten"], out
            lines = err.splitlines()
            assert len(lines) == 2, err
            assert lines[0].startswith("dit-0 not forgotten: FAILED_PRECONDITION (REPLICA_HOLDS_TICKETS):"), err
            assert ticket.ticket_id in lines[0]
            assert lines[1].startswith("no-such-replica not forgotten: NOT_FOUND (UNKNOWN_REPLICA):"), err
            assert _listed(stub) == {"ar-0": True, "dit-0": False}
            assert _status_ids(capsys, broker.address) == ["ar-0", "dit-0"]

            # Again: NOT_FOUND, as for any id the broker does not hold (raw stub: the reason code).
            with pytest.raises(grpc.RpcError) as refused:
                stub.ForgetReplica(broker_pb2.ForgetReplicaRequest(replica_id="dit-1"), timeout=10)
            assert reason_of(refused.value)[:2] == ("NOT_FOUND", "UNKNOWN_REPLICA")  # type: ignore[arg-type]

            # In a development deployment an undeclared caller is the operator, a declared replica is not.
            with pytest.raises(grpc.RpcError) as refused:
                stub.ForgetReplica(broker_pb2.ForgetReplicaRequest(replica_id="dit-0"), timeout=10,
                                   metadata=_md(replica_id="ar-0"))  # fmt: skip
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]

            # The ticket ends (never armed: its pages are free at once): dit-0 may go now.
            stub.CancelTicket(broker_pb2.CancelTicketRequest(
                ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"), timeout=10)
            assert _forget_cli(capsys, broker.address, "dit-0")[:2] == (0, "dit-0 forgotten\n")
            assert _listed(stub) == {"ar-0": True}
    finally:
        assert broker.stop() == 0, broker.output()

    # Restarted on the same journal: the forgotten replicas stay forgotten; ar-0 is restored (down
    # until it registers again), and --all-down forgets it, for good too.
    broker = _start_broker(repo_root, tmp_path)
    try:
        assert _status_ids(capsys, broker.address) == ["ar-0"]
        code, out, err = _forget_cli(capsys, broker.address, "--all-down")
        assert (code, out, err) == (0, "ar-0 forgotten\n", "")
        assert _forget_cli(capsys, broker.address, "--all-down")[:2] == (0, "no replica is down\n")
    finally:
        assert broker.stop() == 0, broker.output()
    broker = _start_broker(repo_root, tmp_path)
    try:
        assert _status_ids(capsys, broker.address) == []
        # The broker process says how it authenticates replicas (a development config: nobody).
        assert main(["status", "--target", broker.address]) == 0
        assert "replicas authenticate with: none (development: every caller trusted)\n" in capsys.readouterr().out
    finally:
        assert broker.stop() == 0, broker.output()


def test_all_down_keeps_what_must_be_kept_and_says_why(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    dit0 = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    dit1 = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for info in (ar, dit0, dit1):
                _register(stub, info)
            stub.CreateTicket(broker_pb2.CreateTicketRequest(
                request_id="req-1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]), timeout=10)
            _deregister(stub, dit0)
            _deregister(stub, dit1)
            code, out, err = _forget_cli(capsys, broker.address, "--all-down")
            # dit-0 is kept (a live ticket names it) without failing the command; ar-0 is up: untouched.
            assert code == 0, (out, err)
            assert out == "dit-1 forgotten\n"
            assert err.startswith("dit-0 not forgotten: FAILED_PRECONDITION (REPLICA_HOLDS_TICKETS):"), err
            assert _listed(stub) == {"ar-0": True, "dit-0": False}
            # Neither ids nor --all-down, or both: a usage error before any call.
            assert _forget_cli(capsys, broker.address)[0] == 2
            assert _forget_cli(capsys, broker.address, "--all-down", "dit-0")[0] == 2
    finally:
        assert broker.stop() == 0, broker.output()


async def _async_sdk_forgets(address: str, replica_id: str) -> None:
    """The asyncio SDK's forget_replica: refusals are KvRelayError with the broker's code and reason."""
    async with AsyncKvRelayClient(address, token=REPLICA_TOKEN) as client:
        with pytest.raises(KvRelayError) as refused:
            await client.forget_replica(replica_id)
        assert refused.value.code == "PERMISSION_DENIED"
    async with AsyncKvRelayClient(address, token=OPERATOR_TOKEN) as client:
        with pytest.raises(KvRelayError) as refused:
            await client.forget_replica("no-such-replica")
        assert (refused.value.code, refused.value.reason) == ("NOT_FOUND", "UNKNOWN_REPLICA")


def test_only_an_operator_may_forget_when_tokens_are_configured(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dit = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    env = {"KVRELAY_REPLICA_TOKEN": REPLICA_TOKEN, "KVRELAY_OPERATOR_TOKEN": OPERATOR_TOKEN}
    broker = _start_broker(repo_root, tmp_path, env)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            _register(stub, dit, REPLICA_TOKEN)
            _deregister(stub, dit, REPLICA_TOKEN)
            request = broker_pb2.ForgetReplicaRequest(replica_id="dit-1")
            for metadata, expected in (
                (_md(), grpc.StatusCode.UNAUTHENTICATED),
                (_md(REPLICA_TOKEN, "dit-1"), grpc.StatusCode.PERMISSION_DENIED),  # even naming itself
                (_md("not-a-token"), grpc.StatusCode.UNAUTHENTICATED),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ForgetReplica(request, timeout=10, metadata=metadata)
                assert refused.value.code() == expected, metadata  # type: ignore[attr-defined]
            code, out, err = _forget_cli(capsys, broker.address, "dit-1")  # no token: refused, stops
            assert code == 1 and out == "" and "UNAUTHENTICATED" in err, (out, err)
            assert _listed(stub, OPERATOR_TOKEN) == {"dit-1": False}
            asyncio.run(_async_sdk_forgets(broker.address, "dit-1"))
            assert _listed(stub, OPERATOR_TOKEN) == {"dit-1": False}
            code, out, err = _forget_cli(capsys, broker.address, "--token", OPERATOR_TOKEN, "dit-1")
            assert (code, out) == (0, "dit-1 forgotten\n"), err
            assert _listed(stub, OPERATOR_TOKEN) == {}
    finally:
        assert broker.stop() == 0, broker.output()


# ------------------------------------------------------------------ broker.forget_down_replicas_after_seconds


def _core(path: Path, clock: ManualClock, after: float | None = 30.0) -> BrokerCore:
    return BrokerCore(path, clock=clock, lease_seconds=10.0, journal_synchronous="NORMAL",
                      forget_down_after_seconds=after)  # fmt: skip


def _ids(core: BrokerCore) -> list[str]:
    return sorted(r.spec.replica_id for r in core.registry)


def test_the_config_knob_is_off_by_default() -> None:
    assert BrokerConfig().forget_down_replicas_after_seconds is None  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        BrokerConfig(forget_down_replicas_after_seconds=0)  # type: ignore[call-arg]


def test_off_a_down_replica_is_kept_forever(tmp_path: Path) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock, after=None)
    core.register_replica(dit_spec("dit-1"))
    clock.advance(1e6)
    core.tick()
    assert _ids(core) == ["dit-1"]


def test_a_replica_down_that_long_is_forgotten_unless_a_ticket_names_it_or_it_is_fenced(tmp_path: Path) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    ar, dit0, dit1, dit2 = ar_spec("ar-0"), dit_spec("dit-0"), dit_spec("dit-1"), dit_spec("dit-2")
    for spec in (ar, dit0, dit1, dit2):
        core.register_replica(spec)
    ticket = core.create_ticket("req-1", "ar-0", "dit-0", [20])
    assert ticket is not None
    core.fence_replica("dit-2", "test")
    core.deregister_replica("dit-1", dit1.incarnation_id)  # down from now, its lease notwithstanding
    clock.advance(29)
    core.tick()
    assert _ids(core) == ["ar-0", "dit-0", "dit-1", "dit-2"]
    clock.advance(1)
    core.tick()
    assert _ids(core) == ["ar-0", "dit-0", "dit-2"]  # lapsed at 10 s, 20 s down, and a ticket names them
    clock.advance(10)
    core.tick()
    assert _ids(core) == ["ar-0", "dit-0", "dit-2"]  # down long enough, but the ticket still names them
    core.cancel_ticket(ticket.ticket_id)
    core.tick()
    assert _ids(core) == ["dit-2"]  # fenced: kept until a new incarnation registers
    with pytest.raises(FailedPrecondition) as refused:
        core.forget_replica("dit-2")  # the operator's call keeps it too, saying why
    assert refused.value.reason == "REPLICA_FENCED" and "test" in refused.value.message
    core.close()
    assert _ids(_core(tmp_path / "j.sqlite", clock, after=None)) == ["dit-2"]  # forgotten in the journal too


def test_a_restored_replica_that_never_registers_is_down_from_the_brokers_start(tmp_path: Path) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock, after=None)
    dit2 = dit_spec("dit-2")
    core.register_replica(dit_spec("dit-1"))
    core.register_replica(dit2)
    core.close()
    clock.advance(1e6)  # its lease lapsed long before the restart: that does not count
    core = _core(tmp_path / "j.sqlite", clock)
    clock.advance(20)
    core.register_replica(dit2)  # came back (same incarnation): up again
    clock.advance(9.5)
    core.tick()
    assert _ids(core) == ["dit-1", "dit-2"]
    clock.advance(0.5)
    core.tick()
    assert _ids(core) == ["dit-2"]
    clock.advance(29)  # dit-2's lease (renewed at +20) lapsed at +30: 29 s down
    core.tick()
    assert _ids(core) == ["dit-2"]
    clock.advance(1)
    core.tick()
    assert _ids(core) == []


def test_a_real_broker_forgets_a_deregistered_replica_after_the_configured_time(
    repo_root: Path, tmp_path: Path
) -> None:
    dit = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
    broker = _start_broker(repo_root, tmp_path, forget_after=0.5)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            _register(stub, dit)
            _register(stub, replica("ar-0", common_pb2.REPLICA_ROLE_AR))
            _deregister(stub, dit)
            deadline = time.monotonic() + 20
            while _listed(stub) != {"ar-0": True} and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _listed(stub) == {"ar-0": True}, broker.output()
    finally:
        assert broker.stop() == 0, broker.output()


def test_a_forget_while_a_registration_dials_its_endpoint_leaves_a_whole_new_registration(tmp_path: Path) -> None:
    """RegisterReplica dials the advertised endpoint before the core sees the registration: the one
    await in which a forget (the maintenance loop's here, or an operator's) can come between a
    replica's registration and the core, which is otherwise one step. A DiT restored from the
    journal, down and holding nothing, is forgotten meanwhile: its registration then lands as NEW,
    listed, with a whole pool, journaled, and a ticket can be made on it (no ticket names a
    replica that is gone, no page is left behind)."""
    from kvrelay.broker.service import BrokerServicer, spec_from_proto

    path, clock = tmp_path / "j.sqlite", ManualClock()
    dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=8)
    dit.endpoint = "10.255.0.1:1"  # not loopback: the broker dials it
    ar = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    first = _core(path, clock)
    first.register_replica(spec_from_proto(dit))
    first.close()

    async def scenario() -> None:
        core = _core(path, clock, after=30.0)
        dialling, answer = asyncio.Event(), asyncio.Event()

        async def probe(endpoint: str) -> str:
            dialling.set()
            await answer.wait()
            return ""

        server = grpc.aio.server()
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(BrokerServicer(core, endpoint_probe=probe), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                registering = asyncio.ensure_future(
                    stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=10))
                await asyncio.wait_for(dialling.wait(), 10)
                clock.advance(31)
                core.tick()  # down since the broker's start, nothing held: forgotten
                assert _ids(core) == []
                answer.set()
                await registering
                (listed,) = (await stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10)).replicas
                assert (listed.replica_id, listed.up, listed.incarnation_id) == ("dit-0", True, dit.incarnation_id)
                (pool,) = (await stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=10)).pools
                assert (pool.free_pages, pool.total_pages) == (8, 8)
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=ar), timeout=10)
                made = await stub.CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]), timeout=10)
                assert made.ticket.dit_replica_id == "dit-0"
                assert core.pool_status("dit-0")[0].reserved == 2
        finally:
            await server.stop(None)
            core.close()

    asyncio.run(scenario())
    again = _core(path, clock)
    try:
        assert _ids(again) == ["ar-0", "dit-0"]
        # The RESERVED ticket was journaled on it and rolled back by the restart: every page back.
        assert [t.reason for t in again.list_tickets({TicketState.RELEASED})] == ["BROKER_RESTARTED"]
        (pool,) = again.pool_status("dit-0")
        assert (pool.free, pool.total) == (8, 8)
    finally:
        again.close()


def test_a_consuming_ticket_a_restart_orphaned_on_a_dit_that_never_returns_holds_it_until_a_dit_registers(
    tmp_path: Path,
) -> None:
    """The broker is killed while a DiT reads a ticket; the DiT is retired meanwhile. Restored
    CONSUMING (its request over: BROKER_RESTARTED), the ticket waits for that DiT to say whether it
    still reads the pages, so nothing else releases it: CancelTicket changes nothing, the
    maintenance loop neither, and ForgetReplica refuses the DiT and the AR (REPLICA_HOLDS_TICKETS).
    A DiT registering under that id once does (a new incarnation: DIT_REPLICA_RESTARTED); then
    both can be forgotten. An operator who knows the DiT is gone for good forgets it with force
    instead (test_forget_by_force.py; docs/operations.md, Retiring a replica)."""
    from tests.broker.helpers import checksum_of, new_incarnation, write_all

    path, clock = tmp_path / "j.sqlite", ManualClock()
    core = _core(path, clock, after=None)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=8)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("r1", ar.replica_id, dit.replica_id, [16])
    assert t is not None
    core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id)
    t = write_all(core, core.get_ticket(t.ticket_id), ar)
    core.report_load(t.ticket_id, 0, 0, replica_id=dit.replica_id, incarnation_id=dit.incarnation_id,
                     verified={w.key: checksum_of(t.ticket_id, w.key) for w in t.writes})  # fmt: skip
    core.start_consuming(t.ticket_id, dit.replica_id, dit.incarnation_id)
    core.close()

    core = _core(path, clock, after=None)
    try:
        clock.advance(3600)
        assert core.cancel_ticket(t.ticket_id).state is TicketState.CONSUMING
        core.tick()
        for replica_id in (dit.replica_id, ar.replica_id):
            with pytest.raises(FailedPrecondition) as err:
                core.forget_replica(replica_id)
            assert err.value.reason == "REPLICA_HOLDS_TICKETS"
        assert core.pool_status(dit.replica_id)[0].reserved == 1
        once = new_incarnation(dit)
        core.register_replica(once)
        released = core.get_ticket(t.ticket_id)
        assert (released.state, released.reason) == (TicketState.RELEASED, "DIT_REPLICA_RESTARTED")
        core.deregister_replica(once.replica_id, once.incarnation_id)
        core.forget_replica(dit.replica_id)
        core.forget_replica(ar.replica_id)
        assert _ids(core) == []
    finally:
        core.close()
