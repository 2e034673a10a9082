"""Registration of one DiT replica with the broker, and its lease (heartbeats).

Owns the replica's identity (`dit-N`, a fresh `incarnation_id` per process start), the
ReplicaInfo it registers (geometry with the stage's page_size, parallelism, num_pages, one
MemoryRegion per rank, transport), and the heartbeat loop. A `fenced` answer, at registration or
on any heartbeat, is a broken invariant: it calls `on_fenced` and the process fails stop. A broker
that is unreachable is not a reason to stop (the lease is not proof of anything): heartbeats keep
trying, and a broker that forgot the replica gets it registered again with the same incarnation
and the tickets being read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvrelay import LAYOUT_VERSION, __version__
from kvrelay.broker_credential import BrokerCredentialWatch, credential_fix
from kvrelay.broker_wait import DEFAULT_REGISTER_WAIT_SECONDS, BrokerWait, IdInUseWait
from kvrelay.errors import reason_of
from kvrelay.logging import get_logger
from kvrelay.transfer.convert import geometry_to_proto, region_to_proto
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

log = get_logger(__name__)

# Every broker call has a deadline; registration may wait for a broker that is still starting.
RPC_TIMEOUT_S = 5.0

_TRANSPORT_KIND = {
    "mooncake": common_pb2.TRANSPORT_KIND_MOONCAKE,
    "grpc": common_pb2.TRANSPORT_KIND_GRPC_STREAM,
    "cuda_ipc": common_pb2.TRANSPORT_KIND_CUDA_IPC,
}


class RegistrationRefused(RuntimeError):
    """The broker refused the registration (fenced, incompatible geometry, bad token)."""


class BrokerUnreachable(RegistrationRefused):
    """The broker did not answer RegisterReplica within the retry window (not running, a wrong
    `--broker`, a firewall): nothing was refused, so the replica says where it looked."""

    def __init__(self, code: str, message: str, *, waited_s: float) -> None:
        super().__init__(f"the broker did not answer RegisterReplica for {waited_s:g} s (last: {code}: {message})")
        self.code = code
        self.message = message
        self.waited_s = waited_s


class ReplicaIdInUse(RegistrationRefused):
    """Another process of this replica id stays registered and answers the broker (another host,
    another lock folder): this one must not take the id (docs/operations.md, Across hosts). The
    message is the broker's."""


def replica_id_for(replica: int) -> str:
    return f"dit-{replica}"


@dataclass(frozen=True, slots=True)
class DitReplicaInfo:
    replica_id: str
    incarnation_id: str
    endpoint: str
    stage_id: int
    geometry: KvGeometry
    tensor_parallel_size: int
    sequence_parallel_size: int
    num_pages: int
    max_num_seqs: int
    transport: str
    regions: tuple[RegionDescriptor, ...]
    # CFG groups of tp * sp ranks each (regions: one per rank of every group).
    cfg_parallel_size: int = 1
    # The largest image width or height the model generates (0 = no limit of its own).
    max_image_side: int = 0

    def to_proto(self) -> broker_pb2.ReplicaInfo:
        return broker_pb2.ReplicaInfo(
            replica_id=self.replica_id,
            role=common_pb2.REPLICA_ROLE_DIT,
            incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION,
            version=__version__,
            endpoint=self.endpoint,
            regions=[region_to_proto(r) for r in self.regions],
            geometry=geometry_to_proto(self.geometry),
            parallelism=common_pb2.Parallelism(
                tensor_parallel_size=self.tensor_parallel_size, sequence_parallel_size=self.sequence_parallel_size,
                cfg_parallel_size=self.cfg_parallel_size,
            ),
            num_pages=self.num_pages,
            transport=_TRANSPORT_KIND[self.transport],
            stage_id=self.stage_id,
            max_num_seqs=self.max_num_seqs,
            max_image_side=self.max_image_side,
        )


def new_incarnation_id() -> str:
    return str(uuid.uuid4())


class Registration:
    """RegisterReplica, then heartbeats every `interval_s` until `stop()`."""

    def __init__(
        self,
        stub: broker_pb2_grpc.BrokerServiceStub,
        info: DitReplicaInfo,
        *,
        interval_s: float,
        token: str | None,
        on_fenced: Callable[[str], None],
        held_tickets: Callable[[], Sequence[str]] = lambda: (),
        owed_releases: Callable[[], Sequence[broker_pb2.OwedRelease]] = lambda: (),
        highest_sequence: Callable[[], int] = lambda: 0,
        credential: BrokerCredentialWatch | None = None,
        receiver_run: Callable[[], tuple[float, int]] | None = None,
    ) -> None:
        self.stub = stub
        # (stall-free seconds, ranks): the minimum over every receiving process of this replica of
        # how long it has run without a stall, and how many ranks it covers (docs/broker.md,
        # Draining); sent with the last probe the broker gave (`_probe`) in every heartbeat.
        self.receiver_run = receiver_run
        self._probe = 0
        self.info = info
        self.interval_s = interval_s
        self.token = token or ""
        self.on_fenced = on_fenced
        self.held_tickets = held_tickets
        self.owed_releases = owed_releases
        self.highest_sequence = highest_sequence
        self.lease_seconds = 0.0
        self._broker = ""  # its address, as register() was given it (re-registrations reuse it)
        # Set once a broker took this incarnation: every later registration says so, and a broker
        # that holds no record of it (its journal lost, replaced or older) answers fenced, since
        # writes it no longer knows of may still land in this memory (docs/broker.md, Journal and restart).
        self.registered_before = False
        self._task: asyncio.Task[None] | None = None
        self.credential = credential or BrokerCredentialWatch(info.replica_id)

    async def register(
        self, *, broker: str, wait_s: float = DEFAULT_REGISTER_WAIT_SECONDS, in_use_wait_s: float = 0.0
    ) -> None:
        """Register, retrying while the broker at `broker` is unreachable for up to `wait_s`
        seconds (kvrelay.broker_wait: progress logged every few seconds), and while it answers
        `REPLICA_ID_IN_USE` for up to `in_use_wait_s` (kvrelay.broker_wait.IdInUseWait), then
        raising ReplicaIdInUse."""
        self._broker = broker
        wait = BrokerWait(broker, wait_s, first_delay_s=0.1, max_delay_s=1.0)
        in_use = IdInUseWait(self.info.replica_id, in_use_wait_s)
        while True:
            try:
                reply = await self.stub.RegisterReplica(
                    broker_pb2.RegisterReplicaRequest(
                        replica=self.info.to_proto(), token=self.token, held_ticket_ids=list(self.held_tickets()),
                        owed_releases=list(self.owed_releases()), registered_before=self.registered_before,
                        highest_ticket_sequence=self.highest_sequence(),
                    ),
                    timeout=RPC_TIMEOUT_S,
                    wait_for_ready=True,
                )
                await self.credential.accepted()
                break
            except grpc.aio.AioRpcError as err:
                _, reason, message = reason_of(err)
                if reason == "REPLICA_ID_IN_USE":
                    delay = in_use.refused(message)
                    if delay is None:
                        raise ReplicaIdInUse(message) from None
                    await asyncio.sleep(delay)
                    continue
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    fix = ""
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                        fix = f"; {credential_fix(self.info.replica_id, reason_of(err)[1])}"
                    raise RegistrationRefused(
                        f"RegisterReplica {self.info.replica_id} failed: {err.code().name}: {err.details()}{fix}"
                    ) from err
                delay = wait.unanswered(err.code().name, err.details() or "")
                if delay is None:
                    raise BrokerUnreachable(err.code().name, err.details() or "", waited_s=wait_s) from None
                await asyncio.sleep(delay)
        if reply.fenced:
            self.on_fenced("registration answered fenced")
            raise RegistrationRefused(f"replica {self.info.replica_id} is fenced")
        self.registered_before = True
        self.lease_seconds = reply.lease_seconds
        log.info("replica_registered", replica_id=self.info.replica_id, incarnation_id=self.info.incarnation_id,
                 num_pages=self.info.num_pages, transport=self.info.transport, lease_seconds=reply.lease_seconds)

    def start_heartbeats(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop(), name="dit-heartbeat")

    def heartbeat_request(self) -> broker_pb2.HeartbeatRequest:
        """This replica's heartbeat. Its receiver run is measured now, after the probe it echoes
        arrived: so it holds at a moment after the broker made that probe's reply."""
        request = broker_pb2.HeartbeatRequest(replica_id=self.info.replica_id, incarnation_id=self.info.incarnation_id)
        if self.receiver_run is not None:
            stall_free, ranks = self.receiver_run()
            request.receiver_run.CopyFrom(
                broker_pb2.ReceiverRun(probe=self._probe, stall_free_seconds=stall_free, ranks=ranks)
            )
        return request

    def next_delay(self, reply: broker_pb2.HeartbeatResponse | None) -> float:
        """The usual interval, or sooner when the broker waits for proof that the receivers drained
        (HeartbeatResponse.next_heartbeat_seconds; it asks no more often than every 0.2 s)."""
        if reply is not None and 0 < reply.next_heartbeat_seconds < self.interval_s:
            return max(reply.next_heartbeat_seconds, 0.05)
        return self.interval_s

    async def _heartbeat_loop(self) -> None:
        delay = self.interval_s
        while True:
            await asyncio.sleep(delay)
            delay = self.interval_s
            try:
                reply = await self.stub.Heartbeat(self.heartbeat_request(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                if await self.credential.answered("Heartbeat", err):
                    # A rotated replica secret, or another id's token: logged with the fix (rate
                    # limited), health NOT_SERVING. Beating on lets a broker given back its secret
                    # take this replica again at once; stopping would not fix the token.
                    continue
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    # The broker lost us (e.g. a fresh journal): register again, same incarnation.
                    try:
                        await self.register(broker=self._broker, wait_s=RPC_TIMEOUT_S)
                    except RegistrationRefused as refused:
                        cause = refused.__cause__
                        if not (isinstance(cause, grpc.RpcError) and await self.credential.answered("RegisterReplica", cause)):
                            log.warning("reregistration_failed", error=str(refused))
                    continue
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Our incarnation is no longer the registered one: someone replaced us.
                    self.on_fenced(f"heartbeat refused: {err.details()}")
                    return
                log.warning("heartbeat_failed", code=err.code().name, details=err.details())
                continue
            await self.credential.accepted()
            if reply.probe:
                self._probe = reply.probe
            delay = self.next_delay(reply)
            if reply.credential_superseded:
                # The broker rotated its credentials: take the new token from the file before its grace ends.
                await self.credential.superseded(reply.credential_grace_seconds)
            if reply.fenced:
                self.on_fenced(reply.fence_reason or "heartbeat answered fenced")
                return

    async def stop(self, *, deregister: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping; nothing to report
                pass
            self._task = None
        if deregister:
            try:
                await self.stub.DeregisterReplica(
                    broker_pb2.DeregisterReplicaRequest(
                        replica_id=self.info.replica_id, incarnation_id=self.info.incarnation_id
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as err:
                log.warning("deregister_failed", code=err.code().name, details=err.details())
