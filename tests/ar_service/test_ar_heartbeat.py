"""The AR's lease does not depend on its reports: a ReportWrite that hangs (and is retried) never
delays a heartbeat, and the report still goes out once the broker answers again."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvrelay.ar_service.registration import ArIdentity, ArRegistration
from kvrelay.ar_service.sender import WriteLedger, WriteReporter
from kvrelay.transfer.transport import WriteOutcome
from kvrelay.v1 import broker_pb2, common_pb2

INTERVAL_S = 0.05


class _Broker:
    """Answers heartbeats at once, asking about one write every time; ReportWrite hangs until its
    deadline while `hang` is set, then answers."""

    def __init__(self) -> None:
        self.heartbeats: list[float] = []
        self.reports: list[broker_pb2.ReportWriteRequest] = []
        self.hang = True

    async def Heartbeat(self, request: broker_pb2.HeartbeatRequest, timeout: float) -> broker_pb2.HeartbeatResponse:
        self.heartbeats.append(asyncio.get_running_loop().time())
        return broker_pb2.HeartbeatResponse(
            poll_writes=[common_pb2.WriteKey(ticket_id="t1", row=0, src_rank=0, dst_rank=0)]
        )

    async def ReportWrite(self, request: broker_pb2.ReportWriteRequest, timeout: float) -> Any:
        if self.hang:
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "deadline"
            )
        self.reports.append(request)
        return broker_pb2.ReportWriteResponse()


def _identity() -> ArIdentity:
    return ArIdentity("ar-0", "inc-1", "127.0.0.1:1", 2, 2, 8, "float32", 4, 1, 64, "grpc", 0, 4)


def test_a_hanging_report_never_delays_heartbeats() -> None:
    async def body() -> None:
        broker = _Broker()
        ledger = WriteLedger()
        ledger.finish("t1", WriteOutcome(0, 0, 0, "OK", 64, 7))
        reporter = WriteReporter(broker, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0)  # type: ignore[arg-type]
        stopped: list[str] = []
        registration = ArRegistration(
            broker, _identity(), ledger, reporter,
            heartbeat_interval_s=INTERVAL_S, token=None, on_fail_stop=stopped.append,
        )  # fmt: skip
        task = asyncio.create_task(registration.run())
        await asyncio.sleep(1.0)
        beats = list(broker.heartbeats)
        # About every interval, even though each report hangs a full second.
        assert len(beats) >= 8, beats
        gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
        assert max(gaps) < 0.5, gaps
        assert broker.reports == []
        broker.hang = False
        for _ in range(100):
            if broker.reports:
                break
            await asyncio.sleep(0.05)
        assert [(r.ticket_id, r.status) for r in broker.reports][:1] == [("t1", common_pb2.WRITE_STATUS_OK)]
        assert ledger.pending_reports() == []
        registration.stop()
        await asyncio.wait_for(task, 5)
        assert stopped == []

    asyncio.run(body())


def test_a_tickets_outcomes_go_in_one_report_acknowledged_together() -> None:
    async def body() -> None:
        broker = _Broker()
        broker.hang = False
        ledger = WriteLedger()
        reporter = WriteReporter(broker, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0)  # type: ignore[arg-type]
        outcomes = [WriteOutcome(0, 0, 0, "OK", 64, 7), WriteOutcome(1, 0, 0, "FAILED", 0, 0, "boom")]
        assert await reporter.report_all("t1", outcomes)
        assert len(broker.reports) == 1
        sent = broker.reports[0]
        assert [(w.row, w.status, w.checksum, w.message) for w in sent.writes] == [
            (0, common_pb2.WRITE_STATUS_OK, 7, ""), (1, common_pb2.WRITE_STATUS_FAILED, 0, "boom")]
        assert (sent.ticket_id, sent.replica_id, sent.incarnation_id) == ("t1", "ar-0", "inc-1")
        assert ledger.pending_reports() == []

    asyncio.run(body())


class _RestartedBroker:
    """A broker that restarted: the first heartbeat is refused REPLICA_NOT_REGISTERED, and the
    re-registration it causes is held until `go` is set. ReportWrite is refused UNAVAILABLE
    while `dropped` is set."""

    def __init__(self) -> None:
        self.registering, self.go = asyncio.Event(), asyncio.Event()
        self.registered = False
        self.listed: list[list[tuple[str, int]]] = []
        self.dropped = True
        self.reports: list[broker_pb2.ReportWriteRequest] = []

    async def Heartbeat(self, request: broker_pb2.HeartbeatRequest, timeout: float) -> broker_pb2.HeartbeatResponse:
        if not self.registered:
            from kvrelay.errors import KvRelayServerError, to_status

            status = to_status(KvRelayServerError(grpc.StatusCode.NOT_FOUND, "REPLICA_NOT_REGISTERED", "register"))
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(*status.trailing_metadata), status.details)
        return broker_pb2.HeartbeatResponse()

    async def RegisterReplica(self, request: broker_pb2.RegisterReplicaRequest, timeout: float) -> Any:
        self.listed.append([(k.ticket_id, k.row) for k in request.unresolved_writes])
        self.registering.set()
        await self.go.wait()
        self.registered = True
        return broker_pb2.RegisterReplicaResponse(lease_seconds=10.0)

    async def ReportWrite(self, request: broker_pb2.ReportWriteRequest, timeout: float) -> Any:
        if self.dropped:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "dropped again"
            )
        self.reports.append(request)
        return broker_pb2.ReportWriteResponse()


def test_a_final_report_refused_while_a_reregistration_lists_it_in_flight_is_sent_again() -> None:
    """The AR side of the DiT's lost-release race: a re-registration lists write t1 as in flight;
    before it reaches the broker the write ends and its ReportWrite is refused (the broker
    dropped again). The report stays pending and goes out once the broker answers."""

    async def body() -> None:
        broker = _RestartedBroker()
        ledger = WriteLedger()
        ledger.start("t1", [])  # an empty plan: then mark the one write in flight by hand
        ledger.finish("t1", WriteOutcome(0, 0, 0, "IN_DOUBT", 64, 0, "still running"))
        reporter = WriteReporter(broker, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0)  # type: ignore[arg-type]
        stopped: list[str] = []
        registration = ArRegistration(
            broker, _identity(), ledger, reporter,
            heartbeat_interval_s=INTERVAL_S, token=None, on_fail_stop=stopped.append,
        )  # fmt: skip
        task = asyncio.create_task(registration.run())
        await asyncio.wait_for(broker.registering.wait(), 5)
        assert broker.listed == [[("t1", 0)]]
        # The write's call returns now; its final report is refused for its whole budget.
        assert not await reporter.report("t1", WriteOutcome(0, 0, 0, "OK", 64, 7), budget_s=0.2)
        assert [(tid, o.status) for tid, o in ledger.pending_reports()] == [("t1", "OK")]
        broker.go.set()
        broker.dropped = False
        for _ in range(100):
            if broker.reports:
                break
            await asyncio.sleep(0.05)
        assert [(r.ticket_id, r.status) for r in broker.reports][:1] == [("t1", common_pb2.WRITE_STATUS_OK)]
        assert ledger.pending_reports() == [] and ledger.in_flight() == []
        registration.stop()
        await asyncio.wait_for(task, 5)
        assert stopped == []

    asyncio.run(body())


class _ShrunkBroker:
    """Polls about two writes at the first heartbeat; then (their DiT restarted with fewer pages,
    the tickets released) its bound is one write: a heartbeat listing more is refused
    TOO_MANY_ENTRIES, as BrokerCore.check_listing does."""

    def __init__(self) -> None:
        self.listed: list[int] = []  # writes listed, per heartbeat
        self.refused = 0

    async def Heartbeat(self, request: broker_pb2.HeartbeatRequest, timeout: float) -> broker_pb2.HeartbeatResponse:
        from kvrelay.errors import KvRelayServerError, to_status

        self.listed.append(len(request.unresolved_writes))
        if len(self.listed) == 1:
            return broker_pb2.HeartbeatResponse(poll_writes=[
                common_pb2.WriteKey(ticket_id="t1", row=row, src_rank=0, dst_rank=0) for row in (0, 1)])
        if len(request.unresolved_writes) > 1:
            self.refused += 1
            status = to_status(KvRelayServerError(grpc.StatusCode.INVALID_ARGUMENT, "TOO_MANY_ENTRIES", "at most 1"))
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(*status.trailing_metadata), status.details)
        return broker_pb2.HeartbeatResponse()

    async def ReportWrite(self, request: broker_pb2.ReportWriteRequest, timeout: float) -> Any:
        return broker_pb2.ReportWriteResponse()


def test_a_heartbeat_whose_polled_writes_outgrew_the_bound_beats_again_without_them() -> None:
    """An honest AR lists the writes the broker polled at its last heartbeat while their calls
    run. When those outgrow the broker's bound meanwhile (a DiT restarted smaller), the refused
    heartbeat is sent again at once without the listing; before, every heartbeat listed them again
    and was refused until the calls returned, and the AR's lease lapsed."""

    async def body() -> None:
        broker = _ShrunkBroker()
        ledger = WriteLedger()
        ledger.start("t1", [])
        for row in (0, 1):  # two writes whose calls still run
            ledger.finish("t1", WriteOutcome(row, 0, 0, "IN_DOUBT", 64, 0, "still running"))
        reporter = WriteReporter(broker, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0)  # type: ignore[arg-type]
        stopped: list[str] = []
        registration = ArRegistration(
            broker, _identity(), ledger, reporter,
            heartbeat_interval_s=INTERVAL_S, token=None, on_fail_stop=stopped.append,
        )  # fmt: skip
        task = asyncio.create_task(registration.run())
        for _ in range(200):
            if len(broker.listed) >= 5:
                break
            await asyncio.sleep(0.02)
        registration.stop()
        await asyncio.wait_for(task, 5)
        # Polled, listed once (refused), then beats without it, each accepted.
        assert broker.listed[:4] == [0, 2, 0, 0] and broker.refused == 1, broker.listed
        assert stopped == [] and len(ledger.in_flight()) == 2

    asyncio.run(body())
