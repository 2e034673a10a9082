"""A second process of a replica id whose registered incarnation is alive is refused.

Found black-box: the replica lock stops a second process of a replica id only on its own host. A
`dit-0` started beside `kvrelay up`'s with another lock folder registered a new incarnation, which
the broker took as proof that the old process was gone: the old one's tickets ended, it failed
stop, its supervisor restarted it, it took the id back, and under two supervisors this repeated.
Now a new incarnation that would replace one within its lease first asks the old one's endpoint
(grpc.health.v1, the incarnation's own service name): while it answers, the newcomer is refused
ALREADY_EXISTS / REPLICA_ID_IN_USE; a dead, stopped, lapsed, fenced or deregistered one is replaced
at once, as before.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from typing import Any

import grpc
import pytest
import structlog.testing

from kvrelay.ar_service.registration import ArIdentity, ArRegistration
from kvrelay.ar_service.registration import ReplicaIdInUse as ArReplicaIdInUse
from kvrelay.ar_service.sender import WriteLedger, WriteReporter
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import Registration, takeover_needs_probe
from kvrelay.broker.service import BrokerServicer, grpc_incarnation_probe
from kvrelay.broker.tickets import AlreadyExists, FailedPrecondition
from kvrelay.dit_service.registration import DitReplicaInfo
from kvrelay.dit_service.registration import Registration as DitRegistration
from kvrelay.dit_service.registration import ReplicaIdInUse as DitReplicaIdInUse
from kvrelay.errors import KvRelayServerError, to_status
from kvrelay.server import GrpcServer, incarnation_health_service
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, new_incarnation
from tests.broker.test_grpc import TIMEOUT, expect_error, replica
from tests.orchestrator.harness import run


def _core(clock: ManualClock) -> BrokerCore:
    return BrokerCore(None, clock=clock, lease_seconds=10.0, journal_synchronous="OFF")


# --- the decision (pure) ---------------------------------------------------------------------


def test_only_a_live_other_incarnation_needs_the_probe() -> None:
    clock = ManualClock()
    core = _core(clock)
    try:
        first = replace(ar_spec(), endpoint="10.0.0.1:50061")
        assert not takeover_needs_probe(None, first, clock())  # never seen: NEW
        core.register_replica(first)
        old = core.registry.get(first.replica_id)
        assert not takeover_needs_probe(old, first, clock())  # same incarnation: re-registration
        second = new_incarnation(first)
        assert takeover_needs_probe(old, second, clock())  # within its lease, not fenced: may be alive
        old.fenced = True
        assert not takeover_needs_probe(old, second, clock())  # fenced: it must fail stop anyway
        old.fenced = False
        clock.advance(10.0)
        assert not takeover_needs_probe(old, second, clock())  # lease lapsed
        clock.advance(-10.0)
        old.needs_registration = True  # restored from the journal: its lease is the restarted broker's to renew
        old.lease_expire_time = float("-inf")
        assert takeover_needs_probe(old, second, clock())
        core.deregister_replica(first.replica_id, first.incarnation_id)
        assert not takeover_needs_probe(old, second, clock())  # stopped cleanly
    finally:
        core.close()


@pytest.mark.parametrize("spec", [replace(ar_spec(), endpoint="10.0.0.1:50061"), replace(dit_spec(), endpoint="10.0.0.1:50061")])
def test_a_new_incarnation_is_refused_while_the_registered_one_answers(spec: Any) -> None:
    clock = ManualClock()
    core = _core(clock)
    try:
        core.register_replica(spec)
        dup = replace(new_incarnation(spec), endpoint="10.0.0.2:50061")
        with structlog.testing.capture_logs() as events, pytest.raises(AlreadyExists) as err:
            core.register_replica(dup, alive_incarnation=spec.incarnation_id)
        assert err.value.reason == "REPLICA_ID_IN_USE"
        # Names the id and where the live one answers, never its incarnation id.
        assert spec.replica_id in err.value.message and "10.0.0.1:50061" in err.value.message
        assert "10.0.0.2:50061" in err.value.message
        assert spec.incarnation_id not in err.value.message
        refused = [e for e in events if e["event"] == "replica_id_in_use_refused"]
        assert refused and refused[0]["log_level"] == "warning"
        assert refused[0]["live_endpoint"] == "10.0.0.1:50061"
        # The live one keeps its registration: heartbeats go on, the newcomer's are stale.
        assert core.registry.get(spec.replica_id).spec.incarnation_id == spec.incarnation_id
        core.heartbeat(spec.replica_id, spec.incarnation_id)
        with pytest.raises(FailedPrecondition):
            core.heartbeat(dup.replica_id, dup.incarnation_id)
        assert core.registry.get(spec.replica_id).up(clock())
    finally:
        core.close()


def test_the_refusal_is_logged_at_most_once_a_minute_per_replica_id() -> None:
    clock = ManualClock()
    core = _core(clock)
    try:
        live = ar_spec()
        core.register_replica(live)

        def refusals() -> list[dict[str, Any]]:
            with structlog.testing.capture_logs() as events, pytest.raises(AlreadyExists):
                core.register_replica(new_incarnation(live), alive_incarnation=live.incarnation_id)
            return [e for e in events if e["event"] == "replica_id_in_use_refused"]

        assert [e["suppressed"] for e in refusals()] == [0]
        for _ in range(3):
            clock.advance(1.0)
            core.heartbeat(live.replica_id, live.incarnation_id)
            assert refusals() == []  # refused all the same, one line a minute
        clock.advance(60.0)
        core.heartbeat(live.replica_id, live.incarnation_id)
        assert [e["suppressed"] for e in refusals()] == [3]
    finally:
        core.close()


@pytest.mark.parametrize("case", ["no_answer", "other_incarnation", "lapsed", "fenced", "deregistered"])
def test_a_new_incarnation_takes_over_when_the_old_one_is_not_proven_alive(case: str) -> None:
    clock = ManualClock()
    core = _core(clock)
    try:
        first = ar_spec()
        core.register_replica(first)
        alive = first.incarnation_id
        if case == "no_answer":
            alive = ""
        elif case == "other_incarnation":
            alive = "someone-else"  # a probe that answered for another incarnation proves nothing
        elif case == "lapsed":
            clock.advance(10.0)
        elif case == "fenced":
            core.registry.get(first.replica_id).fenced = True
        else:
            core.deregister_replica(first.replica_id, first.incarnation_id)
        second = new_incarnation(first)
        reply = core.register_replica(second, alive_incarnation=alive)
        assert reply.registration is Registration.NEW_INCARNATION
        assert core.registry.get(first.replica_id).spec.incarnation_id == second.incarnation_id
    finally:
        core.close()


# --- the probe (real gRPC) -------------------------------------------------------------------


def test_the_probe_says_alive_only_for_the_incarnation_that_answers() -> None:
    async def body() -> None:
        server = GrpcServer(name="ar-0", host="127.0.0.1", port=0, registrations=[])
        await server.start()
        silent = socket.socket()  # accepts connections (the kernel does) and never answers: SIGSTOP
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        probe = grpc_incarnation_probe(timeout_s=1.0)
        try:
            assert not await probe(server.address, "inc-1")  # nothing announced yet: NOT_FOUND
            await server.announce_incarnation("inc-1")
            assert await probe(server.address, "inc-1")
            assert not await probe(server.address, "inc-2")  # another process on that address
            await server.set_serving(False)
            assert await probe(server.address, "inc-1")  # NOT_SERVING (stopping) is still alive
            assert not await probe(f"127.0.0.1:{closed}", "inc-1")  # nobody listens
            assert not await probe(f"127.0.0.1:{silent.getsockname()[1]}", "inc-1")  # no answer in time
            assert not await probe("", "inc-1")  # not a target
        finally:
            silent.close()
            await server.stop(0)

    run(body(), timeout=30)


def test_the_service_name_does_not_reveal_the_incarnation() -> None:
    name = incarnation_health_service("0123456789abcdef")
    assert "0123456789abcdef" not in name
    assert name == incarnation_health_service("0123456789abcdef") != incarnation_health_service("0123456789abcdeg")


# --- RegisterReplica over gRPC ---------------------------------------------------------------


def test_register_replica_asks_the_old_incarnation_only_when_it_may_be_alive() -> None:
    probed: list[tuple[str, str]] = []
    answer = {"alive": True}

    async def probe(endpoint: str, incarnation_id: str) -> bool:
        probed.append((endpoint, incarnation_id))
        return answer["alive"]

    async def endpoint_ok(endpoint: str) -> str:
        return ""

    async def body() -> None:
        core = BrokerCore(None, journal_synchronous="OFF", lease_seconds=30.0)
        server = grpc.aio.server()
        servicer = BrokerServicer(core, endpoint_probe=endpoint_ok, incarnation_probe=probe)
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            first = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
            first.endpoint = "127.0.0.1:50071"
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=first), timeout=TIMEOUT)
            assert probed == []  # a new id: nobody to ask
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=first), timeout=TIMEOUT)
            assert probed == []  # the same incarnation again
            dup = broker_pb2.ReplicaInfo()
            dup.CopyFrom(first)
            dup.incarnation_id = "dup-incarnation"
            dup.endpoint = "127.0.0.1:50171"
            await expect_error(
                stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dup), timeout=TIMEOUT),
                grpc.StatusCode.ALREADY_EXISTS, "REPLICA_ID_IN_USE",
            )  # fmt: skip
            assert probed == [("127.0.0.1:50071", first.incarnation_id)]
            # The live one is untouched: it heartbeats as before.
            await stub.Heartbeat(
                broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id=first.incarnation_id), timeout=TIMEOUT
            )
            # Once it no longer answers (killed, stopped), the next one takes over at once.
            answer["alive"] = False
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dup), timeout=TIMEOUT)
            assert core.registry.get("dit-0").spec.incarnation_id == "dup-incarnation"
            await expect_error(
                stub.Heartbeat(
                    broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id=first.incarnation_id),
                    timeout=TIMEOUT,
                ),
                grpc.StatusCode.FAILED_PRECONDITION, "STALE_INCARNATION",
            )  # fmt: skip
        finally:
            await channel.close()
            await server.stop(0)
            core.close()

    run(body(), timeout=30)


# --- the refused replica ---------------------------------------------------------------------


def _in_use_error() -> grpc.aio.AioRpcError:
    status = to_status(
        KvRelayServerError(grpc.StatusCode.ALREADY_EXISTS, "REPLICA_ID_IN_USE", "replica x is in use: at 10.0.0.1:1")
    )
    return grpc.aio.AioRpcError(
        grpc.StatusCode.ALREADY_EXISTS, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )  # fmt: skip


class _InUseBroker:
    """Refuses RegisterReplica REPLICA_ID_IN_USE `refusals` times, then takes it."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls = 0

    async def RegisterReplica(self, request: broker_pb2.RegisterReplicaRequest, **kw: Any) -> Any:
        self.calls += 1
        if self.calls <= self.refusals:
            raise _in_use_error()
        return broker_pb2.RegisterReplicaResponse(lease_seconds=10.0)


def _ar(broker: _InUseBroker) -> ArRegistration:
    ledger = WriteLedger()
    identity = ArIdentity("ar-0", "inc-1", "127.0.0.1:1", 2, 2, 8, "float32", 4, 1, 64, "grpc", 0, 4)
    return ArRegistration(
        broker, identity, ledger, WriteReporter(broker, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0),  # type: ignore[arg-type]
        heartbeat_interval_s=1.0, token=None, on_fail_stop=lambda _reason: None,
    )  # fmt: skip


def _dit(broker: _InUseBroker) -> DitRegistration:
    info = DitReplicaInfo("dit-0", "inc-1", "127.0.0.1:2", 1, KvGeometry(2, 2, 8, "float32", 4), 1, 1, 16, 1,
                          "grpc", (RegionDescriptor(0, "grpc", "127.0.0.1:2", 0, 16 * 1024),))  # fmt: skip
    return DitRegistration(broker, info, interval_s=1.0, token=None, on_fenced=lambda _reason: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_refused_replica_tries_again_while_the_old_one_may_be_leaving(role: str) -> None:
    async def body() -> None:
        broker = _InUseBroker(refusals=2)
        registration = _ar(broker) if role == "ar" else _dit(broker)
        with structlog.testing.capture_logs() as events:
            await registration.register(broker="b:1", wait_s=5.0, in_use_wait_s=30.0)
        assert broker.calls == 3
        assert [e["log_level"] for e in events if e["event"] == "replica_id_in_use"] == ["warning"]

    run(body(), timeout=30)


@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_refused_replica_gives_up_with_the_brokers_message(role: str) -> None:
    async def body() -> None:
        broker = _InUseBroker(refusals=1000)
        registration = _ar(broker) if role == "ar" else _dit(broker)
        expected = ArReplicaIdInUse if role == "ar" else DitReplicaIdInUse
        with pytest.raises(expected) as err:
            await registration.register(broker="b:1", wait_s=5.0, in_use_wait_s=1.5)
        assert "replica x is in use: at 10.0.0.1:1" in str(err.value)
        assert 2 <= broker.calls <= 4  # one try a second for the wait (tried again once), then it stops asking
        broker.calls = 0
        with pytest.raises(expected):
            await registration.register(broker="b:1", wait_s=5.0)  # no wait: the first refusal ends it
        assert broker.calls == 1

    run(body(), timeout=30)


def test_asyncio_sleep_is_what_the_wait_awaits() -> None:
    # The refused replica's wait is an asyncio sleep, so a stop request (a cancelled task) ends it.
    async def body() -> None:
        registration = _ar(_InUseBroker(refusals=1000))
        task = asyncio.ensure_future(registration.register(broker="b:1", wait_s=5.0, in_use_wait_s=60.0))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(body(), timeout=10)
