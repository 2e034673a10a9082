"""A replica whose token the broker no longer takes (security.replica_secret rotated and the broker
restarted; docs/operations.md, Rotating the replica secret) says so and shows it, instead of a
`heartbeat_failed` warning every heartbeat forever: one `broker_refuses_credential` error naming
the fix (`kvrelay token ID`), repeated at most every REPEAT_LOG_S, `kvrelay_ar_credential_refused`
1 and health NOT_SERVING (the process's `on_change`) until the broker takes it again. It keeps
heartbeating and is never fail-stopped: a broker given its old secret back takes it at once.
"""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path
from typing import Any

import grpc
from structlog.testing import capture_logs

from kvrelay.ar_service.registration import ArIdentity, ArRegistration
from kvrelay.ar_service.sender import WriteLedger, WriteReporter
from kvrelay.broker.authz import broker_checks
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.service import BrokerServicer
from kvrelay.broker_credential import BrokerCredentialWatch
from kvrelay.client import AsyncKvRelayClient
from kvrelay.client.cli import refusals_table
from kvrelay.dit_service.registration import DitReplicaInfo, Registration
from kvrelay.errors import KvRelayServerError, to_status
from kvrelay.security import (
    MAX_REFUSAL_LOG_IDS,
    MAX_REFUSAL_LOGS_PER_WINDOW,
    ChannelSecurity,
    CredentialRefusals,
    Credentials,
    make_channel,
    replica_token_for,
)
from kvrelay.server import GrpcServer
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import broker_pb2, broker_pb2_grpc

OLD, NEW = "the-old-secret-0123456789", "the-new-secret-9876543210"


def _error(code: grpc.StatusCode, reason: str, message: str) -> grpc.aio.AioRpcError:
    status = to_status(KvRelayServerError(code, reason, message))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), status.details)


def test_a_refusal_is_logged_with_its_fix_rate_limited_and_its_end_too() -> None:
    async def body() -> None:
        now = [100.0]
        changes: list[bool] = []

        async def on_change(refused: bool) -> None:
            changes.append(refused)

        watch = BrokerCredentialWatch("dit-0", on_change=on_change, repeat_log_s=60.0, clock=lambda: now[0])
        mismatch = _error(grpc.StatusCode.UNAUTHENTICATED, "REPLICA_TOKEN_MISMATCH", "Heartbeat: not dit-0's token")
        with capture_logs() as logs:
            # Not a refusal of the credential: the caller's to handle, nothing changes.
            assert not await watch.answered("Heartbeat", _error(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "down"))
            assert not await watch.answered(
                "Heartbeat", _error(grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", "not yours"))
            assert not watch.refused and changes == []
            for _ in range(30):  # a heartbeat every 2 s for a minute: one line, one change
                assert await watch.answered("Heartbeat", mismatch)
                now[0] += 2.0
            assert watch.refused and changes == [True]
            refusals = [e for e in logs if e["event"] == "broker_refuses_credential"]
            assert len(refusals) == 1
            first = refusals[0]
            assert first["log_level"] == "error" and first["reason"] == "REPLICA_TOKEN_MISMATCH"
            assert "`kvrelay token dit-0`" in first["fix"] and "replica_secret" in first["fix"]
            now[0] += 1.0  # 61 s after the first: said again, with how long and how often
            assert await watch.answered("RegisterReplica", mismatch)
            refusals = [e for e in logs if e["event"] == "broker_refuses_credential"]
            assert [(e["refusals"], e["refused_for_s"], e["call"]) for e in refusals[1:]] == [(31, 61.0, "RegisterReplica")]
            await watch.accepted()
            await watch.accepted()
            assert not watch.refused and changes == [True, False]
            ended = [e for e in logs if e["event"] == "broker_accepts_credential"]
            assert [(e["refusals"], e["refused_for_s"]) for e in ended] == [(31, 61.0)]
            # A shared token the broker does not take: the other cause, the other fix.
            assert await watch.answered("Heartbeat", _error(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", "no"))
            last = [e for e in logs if e["event"] == "broker_refuses_credential"][-1]
            assert "deployment's replica token" in last["fix"] and changes == [True, False, True]
        assert not [e for e in logs if e["event"] == "heartbeat_failed"]

    asyncio.run(body())


def test_a_server_logs_a_refused_replica_once_per_id_and_keeps_a_bounded_record() -> None:
    now = [1000.0]
    refusals = CredentialRefusals(clock=lambda: now[0], monotonic=lambda: now[0])
    heartbeat = "/kvrelay.v1.BrokerService/Heartbeat"
    with capture_logs() as logs:
        for _ in range(3):
            refusals.refused("ar-0", heartbeat, "REPLICA_TOKEN_MISMATCH", "x")
            now[0] += 1.0
        refusals.refused(None, heartbeat, "UNAUTHENTICATED", "x")  # declared no id
        refusals.refused("scanner", heartbeat, "UNAUTHENTICATED", "x")  # names no replica
        assert [(r.replica_id, r.refusals, r.first_time, r.last_time) for r in refusals.snapshot()] == [
            ("ar-0", 3, 1000.0, 1002.0)]
        # Any id may be declared: the record stays bounded (the least recently refused go), and
        # so do the lines logged in a minute.
        for i in range(2 * MAX_REFUSAL_LOG_IDS):
            now[0] += 0.001
            refusals.refused(f"dit-{i}", heartbeat, "UNAUTHENTICATED", "x")
        kept = refusals.snapshot()
        assert len(kept) == MAX_REFUSAL_LOG_IDS and "ar-0" not in {r.replica_id for r in kept}
    logged = [e["replica_id"] for e in logs if e["event"] == "replica_credential_refused"]
    assert logged[:2] == ["ar-0", "dit-0"] and len(logged) == MAX_REFUSAL_LOGS_PER_WINDOW
    assert logs[0]["method"] == "Heartbeat" and "`kvrelay token ar-0`" in logs[0]["fix"]
    # An id that authenticates again is dropped; a minute on, a refused one is logged again.
    refusals.authenticated("dit-511")
    assert "dit-511" not in {r.replica_id for r in refusals.snapshot()}
    now[0] += 61.0
    with capture_logs() as logs:
        refusals.refused("dit-510", heartbeat, "UNAUTHENTICATED", "x")
    assert [e["replica_id"] for e in logs] == ["dit-510"]


def test_a_failing_on_change_never_ends_the_heartbeats() -> None:
    async def body() -> None:
        async def broken(refused: bool) -> None:
            raise RuntimeError("health servicer gone")

        watch = BrokerCredentialWatch("ar-0", on_change=broken)
        mismatch = _error(grpc.StatusCode.UNAUTHENTICATED, "REPLICA_TOKEN_MISMATCH", "no")
        with capture_logs() as logs:
            assert await watch.answered("Heartbeat", mismatch)
            await watch.accepted()
        assert [e["event"] for e in logs if e["event"] == "credential_state_not_shown"] == ["credential_state_not_shown"] * 2
        assert not watch.refused

    asyncio.run(body())


class _Broker:
    """A real broker over loopback with bound replica tokens under `secret`; `restart` stops it and
    starts another with a new secret on the same port and journal (a rotation)."""

    def __init__(self, journal: Path) -> None:
        self.journal = journal
        self.port = 0
        self.server: GrpcServer | None = None
        self.core: BrokerCore | None = None

    async def start(self, secret: str) -> None:
        self.core = BrokerCore(self.journal, lease_seconds=600.0, drain_quiet_seconds=0.05)
        creds = Credentials(operator_token="op", bound_replica_tokens=True, replica_secret=secret,
                            rate_limit_per_second=0.0)  # fmt: skip
        refusals = CredentialRefusals()  # as broker/main.py shares it
        servicer = BrokerServicer(self.core, 5.0, credential_refusals=refusals)
        self.server = GrpcServer(
            name="broker", host="127.0.0.1", port=self.port, credentials=creds, checks=broker_checks(self.core),
            registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, servicer, "kvrelay.v1.BrokerService")],
            credential_refusals=refusals,
        )  # fmt: skip
        await self.server.start()
        self.port = self.server.bound_port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0.2)
        if self.core is not None:
            self.core.close()
        self.server = self.core = None


def test_ar_and_dit_replicas_show_a_rotated_secret_and_recover_when_the_broker_takes_them_again(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        broker = _Broker(tmp_path / "journal.sqlite")
        await broker.start(OLD)
        address = f"127.0.0.1:{broker.port}"
        states: dict[str, list[bool]] = {"ar-0": [], "dit-0": []}
        changed = {name: asyncio.Event() for name in states}

        def on_change(name: str) -> Any:
            async def record(refused: bool) -> None:
                states[name].append(refused)
                changed[name].set()

            return record

        async def settled(name: str, expected: list[bool]) -> None:
            while states[name] != expected:
                assert len(states[name]) < len(expected), states
                changed[name].clear()
                await asyncio.wait_for(changed[name].wait(), 30)

        stopped: list[str] = []
        channels = [make_channel(address, ChannelSecurity(token=replica_token_for(OLD, r), replica_id=r))
                    for r in ("ar-0", "dit-0")]  # fmt: skip
        ar_stub, dit_stub = (broker_pb2_grpc.BrokerServiceStub(c) for c in channels)
        ledger = WriteLedger()
        ar = ArRegistration(
            ar_stub, ArIdentity("ar-0", "inc-1", "127.0.0.1:1", 2, 2, 8, "float32", 4, 1, 64, "grpc", 0, 4),
            ledger, WriteReporter(ar_stub, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0),
            heartbeat_interval_s=0.05, token=None, on_fail_stop=stopped.append,
            credential=BrokerCredentialWatch("ar-0", on_change=on_change("ar-0")),
        )  # fmt: skip
        dit = Registration(
            dit_stub,
            DitReplicaInfo("dit-0", "inc-1", "127.0.0.1:2", 1, KvGeometry(2, 2, 8, "float32", 4), 1, 1, 16, 1,
                           "grpc", (RegionDescriptor(0, "grpc", "127.0.0.1:2", 0, 16 * 1024),)),
            interval_s=0.05, token=None, on_fenced=stopped.append,
            credential=BrokerCredentialWatch("dit-0", on_change=on_change("dit-0")),
        )  # fmt: skip
        beats: asyncio.Task[None] | None = None
        try:
            await ar.register(broker=address, wait_s=10.0)
            await dit.register(broker=address, wait_s=10.0)
            beats = asyncio.create_task(ar.run())
            dit.start_heartbeats()
            # The rotation: the broker restarts with a new secret; both replicas hold old tokens.
            await broker.stop()
            with capture_logs() as logs:
                await broker.start(NEW)
                await settled("ar-0", [True])
                await settled("dit-0", [True])
                assert ar.credential.refused and dit.credential.refused
                # Still refused, still beating, never stopped: a broker misconfiguration is no
                # reason to take the fleet down.
                refusals = ar.credential.refusals
                while ar.credential.refusals < refusals + 5 or dit.credential.refusals < 5:
                    await asyncio.sleep(0.05)
                assert stopped == [] and not beats.done()
                events = [(e["event"], e.get("replica_id")) for e in logs]
                assert events.count(("broker_refuses_credential", "ar-0")) == 1, events
                assert events.count(("broker_refuses_credential", "dit-0")) == 1, events
                # The broker's log says the same, once per replica id: which replicas hold old tokens.
                refused = [e for e in logs if e["event"] == "replica_credential_refused"]
                assert sorted(e["replica_id"] for e in refused) == ["ar-0", "dit-0"], refused
                assert all(e["reason"] == "REPLICA_TOKEN_MISMATCH" and f"kvrelay token {e['replica_id']}" in e["fix"]
                           for e in refused)  # fmt: skip
                # (While the broker restarted, heartbeats failed UNAVAILABLE: that warning stays.)
                unexplained = [e for e in logs if e["event"] in ("heartbeat_failed", "reregistration_failed")
                               and "UNAUTHENTICATED" in str(e)]  # fmt: skip
                assert unexplained == []
                # `kvrelay status` (ListReplicas, the SDK) lists both, with what to do.
                async with AsyncKvRelayClient(address, token="op") as operator:
                    listed = (await operator.get_replica_registry()).credential_refusals
                assert [(r.replica_id, r.reason, r.method) for r in listed] == [
                    ("ar-0", "REPLICA_TOKEN_MISMATCH", "Heartbeat"), ("dit-0", "REPLICA_TOKEN_MISMATCH", "Heartbeat")]
                assert all(r.refusals >= 5 and r.first_refusal_time and r.last_refusal_time for r in listed)
                table = refusals_table(listed, datetime.datetime.now(datetime.UTC))
                assert "ar-0" in table and "dit-0" in table and "`kvrelay token ID`" in table
                # ar-0 restarted with its new token (`kvrelay token ar-0`): no longer listed. (The
                # old ar-0 above still beats with its old token, so a refusal may come in between:
                # then ar-0 is listed again, but as a new record, begun after it authenticated.)
                authenticated_at = datetime.datetime.now(datetime.UTC)
                async with make_channel(address, ChannelSecurity(token=replica_token_for(NEW, "ar-0"),
                                                                 replica_id="ar-0")) as fixed:  # fmt: skip
                    try:
                        await broker_pb2_grpc.BrokerServiceStub(fixed).Heartbeat(
                            broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id="inc-1"), timeout=10)
                    except grpc.aio.AioRpcError as err:  # authenticated; "register again" is the broker's
                        assert err.code() == grpc.StatusCode.NOT_FOUND, err
                async with AsyncKvRelayClient(address, token="op") as operator:
                    listed = (await operator.get_replica_registry()).credential_refusals
                assert [r.replica_id for r in listed if r.replica_id != "ar-0"] == ["dit-0"]
                again = [r for r in listed if r.replica_id == "ar-0"]
                # (the old record began >= 5 refused beats, 0.25 s, before `authenticated_at`)
                begun_after = authenticated_at - datetime.timedelta(seconds=0.1)
                assert all(r.first_refusal_time is not None and r.first_refusal_time >= begun_after
                           for r in again), again  # fmt: skip
                # Given its old secret back, the broker takes both again at once.
                await broker.stop()
                await broker.start(OLD)
                await settled("ar-0", [True, False])
                await settled("dit-0", [True, False])
            assert stopped == []
            # ...and lists none once they authenticated again.
            async with AsyncKvRelayClient(address, token="op") as operator:
                assert (await operator.get_replica_registry()).credential_refusals == []
        finally:
            ar.stop()
            if beats is not None:
                await asyncio.wait_for(beats, 10)
            await dit.stop(deregister=False)
            for channel in channels:
                await channel.close()
            await broker.stop()

    asyncio.run(body())
