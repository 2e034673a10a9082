"""The AR replica's membership with the broker: RegisterReplica, heartbeats, polls and fences.

Owns the replica's description (ReplicaInfo: incarnation, geometry, parallelism, max tokens,
transport) and the lease loop. Each heartbeat carries the writes the broker asked about last
time that are still unresolved; when the reply lists `poll_writes`, the ledger answers them
(report what resolved, list what is in flight, NOT_STARTED for what this incarnation never began).
A `fenced` reply, a refused registration that says fenced, or a newer incarnation registered
under our id (STALE_INCARNATION) means this process must fail stop: it calls `on_fail_stop` and
never heartbeats again. A broker that restarted (REPLICA_NOT_REGISTERED) gets a re-registration
with the same incarnation and the writes still unresolved.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvrelay import LAYOUT_VERSION, __version__
from kvrelay.ar_service.sender import RETRYABLE, WriteId, WriteLedger, WriteReporter, write_key_proto
from kvrelay.broker_credential import BrokerCredentialWatch
from kvrelay.broker_wait import DEFAULT_REGISTER_WAIT_SECONDS, BrokerWait, IdInUseWait
from kvrelay.errors import reason_of
from kvrelay.logging import get_logger
from kvrelay.transfer.transport import WriteOutcome
from kvrelay.v1 import broker_pb2, common_pb2

log = get_logger(__name__)

_DTYPES = {
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
}
_TRANSPORTS = {
    "mooncake": common_pb2.TRANSPORT_KIND_MOONCAKE,
    "grpc": common_pb2.TRANSPORT_KIND_GRPC_STREAM,
    "cuda_ipc": common_pb2.TRANSPORT_KIND_CUDA_IPC,
}
RPC_TIMEOUT_S = 5.0


class Fenced(Exception):
    """The broker refuses this incarnation for good: fail stop."""


@dataclass(frozen=True, slots=True)
class ArIdentity:
    replica_id: str
    incarnation_id: str
    endpoint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    tensor_parallel_size: int
    max_tokens: int
    transport: str
    stage_id: int
    max_num_seqs: int

    def to_proto(self) -> broker_pb2.ReplicaInfo:
        return broker_pb2.ReplicaInfo(
            replica_id=self.replica_id,
            role=common_pb2.REPLICA_ROLE_AR,
            incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION,
            version=__version__,
            endpoint=self.endpoint,
            geometry=common_pb2.KvGeometry(
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=_DTYPES[self.dtype],
                page_size=self.page_size,
            ),
            parallelism=common_pb2.Parallelism(
                tensor_parallel_size=self.tensor_parallel_size, sequence_parallel_size=1
            ),
            max_tokens=self.max_tokens,
            transport=_TRANSPORTS[self.transport],
            stage_id=self.stage_id,
            max_num_seqs=self.max_num_seqs,
        )


class ArRegistration:
    def __init__(
        self,
        stub: object,
        identity: ArIdentity,
        ledger: WriteLedger,
        reporter: WriteReporter,
        *,
        heartbeat_interval_s: float,
        token: str | None,
        on_fail_stop: Callable[[str], None],
        credential: BrokerCredentialWatch | None = None,
    ) -> None:
        self.stub = stub
        self.identity = identity
        self.ledger = ledger
        self.reporter = reporter
        self.heartbeat_interval_s = heartbeat_interval_s
        self.token = token or ""
        self.on_fail_stop = on_fail_stop
        self.lease_seconds = 0.0
        self._asked: set[WriteId] = set()
        self._stopped = asyncio.Event()
        self._reporting: asyncio.Task[None] | None = None
        self._failed = False
        self.credential = credential or BrokerCredentialWatch(identity.replica_id)

    async def register(
        self, *, broker: str, wait_s: float = DEFAULT_REGISTER_WAIT_SECONDS, in_use_wait_s: float = 0.0
    ) -> None:
        """Register, retrying while the broker at `broker` is unreachable (a replica may start
        first) for up to `wait_s` (kvrelay.broker_wait: progress logged every few seconds), and
        while it answers `REPLICA_ID_IN_USE` for up to `in_use_wait_s` (kvrelay.broker_wait.IdInUseWait).
        Raises Fenced when the broker says so, ReplicaIdInUse when another process of the id stays
        registered and alive, KvRelay errors on a refusal (bad geometry...)."""
        wait = BrokerWait(broker, wait_s)
        in_use = IdInUseWait(self.identity.replica_id, in_use_wait_s)
        while True:
            try:
                await self._register_once()
                return
            except grpc.aio.AioRpcError as err:
                code, reason, message = reason_of(err)
                if reason == "REPLICA_ID_IN_USE":
                    delay = in_use.refused(message)
                    if delay is None:
                        raise ReplicaIdInUse(code, reason, message) from None
                    await asyncio.sleep(delay)
                    continue
                delay = wait.unanswered(code, message) if err.code() in RETRYABLE else None
                if delay is None:
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise BrokerUnreachable(code, reason, message, waited_s=wait_s) from None
                    raise RegistrationRefused(code, reason, message) from None
            await asyncio.sleep(delay)

    async def _register_once(self) -> None:
        request = broker_pb2.RegisterReplicaRequest(
            replica=self.identity.to_proto(),
            token=self.token,
            unresolved_writes=[write_key_proto(w) for w in self.ledger.in_flight()],
        )
        reply = await self.stub.RegisterReplica(request, timeout=RPC_TIMEOUT_S)  # type: ignore[attr-defined]
        await self.credential.accepted()
        self.lease_seconds = reply.lease_seconds
        if reply.fenced:
            raise Fenced(f"replica {self.identity.replica_id} is fenced")
        log.info(
            "replica_registered",
            replica_id=self.identity.replica_id,
            incarnation=self.identity.incarnation_id,
            lease_seconds=reply.lease_seconds,
        )

    async def heartbeat_once(self) -> broker_pb2.HeartbeatResponse:
        """One heartbeat. The reports a poll asks for are sent in the background: a ReportWrite
        that hangs or is retried must never delay the next heartbeat (the lease would lapse
        and the broker would mark a healthy writer down)."""
        unresolved = [w for w in self.ledger.in_flight() if w in self._asked]
        request = broker_pb2.HeartbeatRequest(
            replica_id=self.identity.replica_id,
            incarnation_id=self.identity.incarnation_id,
            unresolved_writes=[write_key_proto(w) for w in unresolved],
        )
        reply: broker_pb2.HeartbeatResponse = await self.stub.Heartbeat(request, timeout=RPC_TIMEOUT_S)  # type: ignore[attr-defined]
        await self.credential.accepted()
        if reply.credential_superseded:
            # The broker rotated its credentials: take the new token from the file before its grace ends.
            await self.credential.superseded(reply.credential_grace_seconds)
        if reply.fenced:
            raise Fenced(reply.fence_reason or "fenced by the broker")
        polled = [(k.ticket_id, k.row, k.src_rank, k.dst_rank) for k in reply.poll_writes]
        unresolved_now, to_report = self.ledger.answer_poll(polled)
        self._asked = set(unresolved_now)
        self._send_reports(to_report)
        return reply

    def _send_reports(self, to_report: list[tuple[str, WriteOutcome]]) -> None:
        """Report what a poll asked for, then retry what is still unacknowledged, in one
        background task at a time. What a busy task could not take now is asked again by the
        broker's next poll (it polls until the write is resolved) or is still pending then."""
        if self._reporting is not None and not self._reporting.done():
            return
        self._reporting = asyncio.get_running_loop().create_task(
            self._report(to_report), name=f"{self.identity.replica_id}-reports"
        )

    async def _report(self, to_report: list[tuple[str, WriteOutcome]]) -> None:
        try:
            if to_report:
                await asyncio.gather(
                    *(self.reporter.report(tid, o, budget_s=RPC_TIMEOUT_S) for tid, o in to_report)
                )
            await self.reporter.report_pending()
        except Exception:  # noqa: BLE001 - a reporting bug must not end the lease; heartbeats go on
            log.exception("report_writes_failed", replica_id=self.identity.replica_id)

    async def _stop_reports(self, grace_s: float) -> None:
        task, self._reporting = self._reporting, None
        if task is None or task.done():
            return
        # Give the reports in flight a moment (they are what the broker waits for), then stop.
        if grace_s > 0:
            await asyncio.wait({task}, timeout=grace_s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def run(self) -> None:
        """The heartbeat loop, until stop() or a fence."""
        try:
            await self._run()
        finally:
            # A fenced incarnation's reports prove nothing any more: no reason to wait for them.
            await asyncio.shield(self._stop_reports(0.0 if self._failed else RPC_TIMEOUT_S))

    async def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                await self.heartbeat_once()
                self._send_reports([])
            except Fenced as err:
                log.error("replica_fenced", replica_id=self.identity.replica_id, reason=str(err))
                self._fail_stop(f"fenced: {err}")
                return
            except grpc.aio.AioRpcError as err:
                _, reason, message = reason_of(err)
                if await self.credential.answered("Heartbeat", err):
                    # A rotated replica secret, or another id's token: logged with the fix (rate
                    # limited), health NOT_SERVING. Beating on lets a broker given back its secret
                    # take this replica again at once; stopping would not fix the token.
                    pass
                elif reason == "STALE_INCARNATION":
                    # Another process registered under our id: it took our lock, so either we are a
                    # zombie or the lock was bypassed; either way this incarnation must go.
                    log.error("replica_superseded", replica_id=self.identity.replica_id, message=message)
                    self._fail_stop(f"superseded: {message}")
                    return
                elif reason in ("REPLICA_NOT_REGISTERED", "UNKNOWN_REPLICA"):
                    # The broker restarted, or forgot us while our lease had lapsed (a full registry).
                    log.warning("broker_restarted_reregistering", replica_id=self.identity.replica_id)
                    try:
                        await self._register_once()
                    except Fenced as fenced:
                        self._fail_stop(f"fenced: {fenced}")
                        return
                    except grpc.aio.AioRpcError as again:
                        if not await self.credential.answered("RegisterReplica", again):
                            log.warning("reregistration_failed", code=again.code().name, details=again.details())
                elif reason == "TOO_MANY_ENTRIES" and self._asked:
                    # The writes the broker polled last time, still in flight, may since have
                    # outgrown its bound (their DiT restarted with fewer pages and their tickets
                    # were released under them). Kept, every heartbeat was refused until those
                    # calls returned and the lease lapsed. The listing is only informational: drop
                    # it and beat again now; the next poll asks about what is still live.
                    log.warning("heartbeat_listing_refused", replica_id=self.identity.replica_id,
                                listed=len(self._asked), details=message)  # fmt: skip
                    self._asked = set()
                    continue
                else:
                    log.warning("heartbeat_failed", code=err.code().name, reason=reason, details=message)
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout=self.heartbeat_interval_s)
            except TimeoutError:
                pass

    def _fail_stop(self, reason: str) -> None:
        self._failed = True
        self.on_fail_stop(reason)

    def stop(self) -> None:
        self._stopped.set()

    async def deregister(self) -> None:
        try:
            await self.stub.DeregisterReplica(  # type: ignore[attr-defined]
                broker_pb2.DeregisterReplicaRequest(
                    replica_id=self.identity.replica_id, incarnation_id=self.identity.incarnation_id
                ),
                timeout=2.0,
            )
        except grpc.aio.AioRpcError as err:
            log.warning("deregister_failed", code=err.code().name, details=err.details())


class RegistrationRefused(Exception):
    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


class BrokerUnreachable(RegistrationRefused):
    """The broker did not answer RegisterReplica within `waited_s` of retries (not running, a wrong
    `--broker`, a firewall): nothing was refused, so the replica says where it looked."""

    def __init__(self, code: str, reason: str, message: str, *, waited_s: float) -> None:
        super().__init__(code, reason, message)
        self.waited_s = waited_s


class ReplicaIdInUse(RegistrationRefused):
    """Another process of this replica id stays registered and answers the broker (another host,
    another lock folder): this one must not take the id (docs/operations.md, Across hosts)."""
