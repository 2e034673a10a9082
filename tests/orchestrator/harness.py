"""A broker (real BrokerCore, BrokerServicer, Orchestrator, GenerationServicer on grpc.aio) with
protocol-honest AR and DiT replicas as grpc.aio servers in the same event loop.

The replicas follow docs/internals.md "The request protocol" over real gRPC against the real
broker: they register, arm tickets with ReserveTicket, write the planned segments' bytes into
the DiT's page memory (a bytearray standing in for a registered region), report each write with
the xxh3 checksum of its staging bytes, watch the ticket, verify destination bytes before
ReportLoad, stream steps and release the ticket. What they skip is the model: the KV bytes are
a deterministic function of (seed, row), the image a flat PNG. Gates let a test hold a request
in any state. Nothing here stands in for the product under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import yaml
from prometheus_client import CollectorRegistry

from kvrelay import LAYOUT_VERSION
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generation import GenerationServicer
from kvrelay.broker.orchestrator import Orchestrator
from kvrelay.broker.service import BrokerServicer
from kvrelay.broker.waiters import run_maintenance
from kvrelay.config import parse_config
from kvrelay.errors import KvRelayServerError, abort_with
from kvrelay.security import ChannelSecurity, Credentials, make_channel
from kvrelay.server import GRPC_OPTIONS, GrpcServer
from kvrelay.transfer.checksum import checksum_segments
from kvrelay.transfer.convert import geometry_to_proto, writes_from_proto
from kvrelay.transfer.layout import KvGeometry, PageLayout
from kvrelay.transfer.planner import PlannedWrite
from kvrelay.v1 import (
    ar_pb2,
    ar_pb2_grpc,
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    dit_pb2,
    dit_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from tests.tcp_proxy import TcpProxy

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)
RPC_TIMEOUT = 10.0


def tokens_of(text: str) -> int:
    """The test AR's tokenizer: one token per UTF-8 byte plus BOS (so "" is BOS alone)."""
    return len(text.encode()) + 1


def pages_of(text: str) -> int:
    return GEOMETRY.pages_for(tokens_of(text))


def make_png(width: int, height: int, shade: int) -> bytes:
    """A valid grayscale PNG of one shade (enough for the broker, which never decodes it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes([shade]) * width for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def _opened() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


# ------------------------------------------------------------------------ replicas


@dataclass
class DitMemory:
    """The DiT replica's one rank's page region (a registered region in the real service)."""

    num_pages: int
    layout: PageLayout = field(init=False)
    pool: bytearray = field(init=False)

    def __post_init__(self) -> None:
        self.layout = PageLayout(GEOMETRY, 1, 0)
        self.pool = bytearray(self.layout.page_bytes * self.num_pages)


class ArReplica(ar_pb2_grpc.ArServiceServicer):
    """Tokenize + Prefill as docs/internals.md specifies, writing straight into `memory`."""

    def __init__(
        self, broker_target: str, memory: DitMemory, *, replica_id: str = "ar-0", max_tokens: int = 64
    ):
        self.replica_id = replica_id
        self.incarnation_id = uuid.uuid4().hex
        self.broker_target = broker_target
        self.memory = memory
        self.max_tokens = max_tokens
        self.endpoint = ""
        # Gates: cleared = hold there. `prefill_gate` holds before arming (PREFILLING),
        # `write_gate` after arming with the writes in flight (TRANSFERRING).
        self.tokenize_gate = _opened()
        self.prefill_gate = _opened()
        self.write_gate = _opened()
        # Holds the Prefill reply after every write was reported.
        self.reply_gate = _opened()
        # After every write was reported (and the reply gate opened): fail the RPC with this
        # instead of replying (a rank died or hung after its writes: REPLICA_FAILED).
        self.fail_reply: KvRelayServerError | None = None
        self.prefill_started = asyncio.Event()
        self.armed = asyncio.Event()
        self.fail_prefill: KvRelayServerError | None = None
        # After arming: report every write FAILED, then fail the RPC with this (a rank died).
        self.fail_after_arming: KvRelayServerError | None = None
        # Write bytes other than those whose checksum is reported (a write corrupted on its way:
        # the DiT's checksum catches it).
        self.corrupt_writes = False
        # The faults `fail_after_arming`, `corrupt_writes` and the `write_gate` hold apply to the
        # first N Prefills only (a transient failure: the next attempt goes through); None: to all.
        self.faulty_prefills: int | None = None
        # False: `stop` leaves the writes held at `write_gate` unresolved (a broker stopped with
        # them in flight restores them so); the test cancels them (`abandon_writes`) afterwards.
        self.resolve_writes_on_stop = True
        self._abandoned = False
        # Before failing with `fail_prefill`: roll the ticket back (CancelTicket FAILED) and wait
        # this long, as the real AR does; the DiT sees the ticket end before the AR's reply.
        self.rollback_before_failing_s: float | None = None
        self.prefills: list[str] = []
        self.deadlines: list[float | None] = []
        self.writes_resolved = 0
        # The page memory of each further DiT replica, by replica id (`memory` is the first's).
        self.memories: dict[str, DitMemory] = {}
        self._writers: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def broker(self) -> broker_pb2_grpc.BrokerServiceStub:
        assert self._channel is not None
        return broker_pb2_grpc.BrokerServiceStub(self._channel)

    async def start(self) -> None:
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        ar_pb2_grpc.add_ArServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.endpoint = f"127.0.0.1:{port}"
        # As a real replica dials its broker: its replica id on every call (kvrelay-replica-id).
        self._channel = make_channel(self.broker_target, ChannelSecurity(replica_id=self.replica_id))
        info = broker_pb2.ReplicaInfo(
            replica_id=self.replica_id,
            role=common_pb2.REPLICA_ROLE_AR,
            incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION,
            version="test",
            endpoint=self.endpoint,
            geometry=geometry_to_proto(GEOMETRY),
            parallelism=common_pb2.Parallelism(tensor_parallel_size=1, sequence_parallel_size=1),
            max_tokens=self.max_tokens,
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
            stage_id=0,
        )
        await self.broker.RegisterReplica(
            broker_pb2.RegisterReplicaRequest(replica=info), timeout=RPC_TIMEOUT
        )

    async def stop(self) -> None:
        self.tokenize_gate.set()
        self.reply_gate.set()
        self.prefill_gate.set()
        if self.resolve_writes_on_stop:
            self.write_gate.set()
            if self._writers:
                await asyncio.wait(self._writers, timeout=5)
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()

    async def Tokenize(self, request: ar_pb2.TokenizeRequest, context: Any) -> ar_pb2.TokenizeResponse:
        await self.tokenize_gate.wait()
        return ar_pb2.TokenizeResponse(
            token_counts=[tokens_of(t) for t in request.texts], max_tokens=self.max_tokens
        )

    async def Prefill(self, request: ar_pb2.PrefillRequest, context: Any) -> ar_pb2.PrefillResponse:
        self.prefills.append(request.request_id)
        faulty = self.faulty_prefills is None or len(self.prefills) <= self.faulty_prefills
        self.deadlines.append(context.time_remaining())
        self.prefill_started.set()
        started = time.monotonic()
        await self.prefill_gate.wait()
        if self.fail_prefill is not None:
            if self.rollback_before_failing_s is not None:
                await self.broker.CancelTicket(
                    broker_pb2.CancelTicketRequest(
                        ticket_id=request.ticket_id,
                        outcome=broker_pb2.TICKET_OUTCOME_FAILED,
                        reason=self.fail_prefill.reason,
                    ),
                    timeout=RPC_TIMEOUT,
                )
                await asyncio.sleep(self.rollback_before_failing_s)
            await abort_with(context, self.fail_prefill)
        prefill_seconds = time.monotonic() - started
        arming = asyncio.ensure_future(self.broker.ReserveTicket(
            broker_pb2.ReserveTicketRequest(
                ticket_id=request.ticket_id, ar_replica_id=self.replica_id, incarnation_id=self.incarnation_id
            ),
            timeout=RPC_TIMEOUT,
        ))  # fmt: skip
        try:
            armed = await asyncio.shield(arming)
        except asyncio.CancelledError:
            # Cancelled while the broker may be arming (its reply waits for the journal): as the
            # real AR does, every write the broker expects still gets a report, or its pages
            # would drain for good.
            settle = asyncio.create_task(self._settle_cancelled_arming(request.ticket_id, arming))
            self._writers.add(settle)
            settle.add_done_callback(self._writers.discard)
            raise
        self.armed.set()
        writes = writes_from_proto(armed.writes)
        if self.fail_after_arming is not None and faulty:
            for w in writes:
                await self._report(request.ticket_id, w, common_pb2.WRITE_STATUS_FAILED, 0, 0)
            await asyncio.sleep(0.1)  # the RPC's failure reaches the broker after the reports
            await abort_with(context, self.fail_after_arming)
        staging = self._staging(request, writes)
        # Armed: the writes run to their final reports even if this RPC is cancelled.
        memory = self.memories.get(request.plan.ticket.dit_replica_id, self.memory)
        writer = asyncio.create_task(self._write_and_report(
            request.ticket_id, writes, staging, memory, gated=faulty, corrupt=self.corrupt_writes and faulty
        ))  # fmt: skip
        self._writers.add(writer)
        writer.add_done_callback(self._writers.discard)
        t0 = time.monotonic()
        total = await asyncio.shield(writer)
        await self.reply_gate.wait()
        if self.fail_reply is not None:
            await abort_with(context, self.fail_reply)
        return ar_pb2.PrefillResponse(
            token_counts=[tokens_of(t) for t in request.rows],
            bytes_written=total,
            prefill_seconds=prefill_seconds,
            transfer_seconds=time.monotonic() - t0,
        )

    async def abandon_writes(self) -> None:
        """After the cluster stopped: end the writes `stop` left held, unreported (no broker
        is left to report them to)."""
        self._abandoned = True
        writers = list(self._writers)
        for writer in writers:
            writer.cancel()
        await asyncio.gather(*writers, return_exceptions=True)

    def _staging(self, request: ar_pb2.PrefillRequest, writes: tuple[PlannedWrite, ...]) -> bytes:
        size = max((s.src_offset + s.length for w in writes for s in w.segments), default=0)
        pattern = f"{request.seed}:{'|'.join(request.rows)}".encode() or b"\x00"
        return (pattern * (size // len(pattern) + 1))[:size]

    async def _write_and_report(
        self,
        ticket_id: str,
        writes: tuple[PlannedWrite, ...],
        staging: bytes,
        memory: DitMemory,
        *,
        gated: bool = True,
        corrupt: bool = False,
    ) -> int:
        reported: set[int] = set()
        total = 0
        try:
            if gated:
                await self.write_gate.wait()
            for i, w in enumerate(writes):
                for seg in w.segments:
                    memory.pool[seg.dst_offset : seg.dst_offset + seg.length] = staging[
                        seg.src_offset : seg.src_offset + seg.length
                    ]
                if corrupt and w.segments:
                    memory.pool[w.segments[0].dst_offset] ^= 0xFF
                checksum = checksum_segments(staging, w.segments, side="src")
                await self._report(ticket_id, w, common_pb2.WRITE_STATUS_OK, checksum, w.num_bytes)
                reported.add(i)
                total += w.num_bytes
        finally:
            for i, w in enumerate(writes):
                if i not in reported and not self._abandoned:
                    await self._report(ticket_id, w, common_pb2.WRITE_STATUS_NOT_STARTED, 0, 0)
        return total

    async def _settle_cancelled_arming(self, ticket_id: str, arming: Any) -> None:
        try:
            armed = await arming
        except grpc.aio.AioRpcError:
            return  # refused: nothing armed
        for w in writes_from_proto(armed.writes):
            await self._report(ticket_id, w, common_pb2.WRITE_STATUS_NOT_STARTED, 0, 0)

    async def _report(self, ticket_id: str, w: PlannedWrite, status: int, checksum: int, nbytes: int) -> None:
        await self.broker.ReportWrite(
            broker_pb2.ReportWriteRequest(
                ticket_id=ticket_id,
                row=w.row,
                src_rank=w.src_rank,
                dst_rank=w.dst_rank,
                replica_id=self.replica_id,
                incarnation_id=self.incarnation_id,
                status=status,  # type: ignore[arg-type]
                checksum=checksum,
                bytes=nbytes,
            ),
            timeout=RPC_TIMEOUT,
        )
        self.writes_resolved += 1


class DitReplica(dit_pb2_grpc.DitServiceServicer):
    """Denoise as docs/internals.md specifies: wait for the rows, verify, report, step, decode."""

    def __init__(
        self,
        broker_target: str,
        memory: DitMemory,
        *,
        replica_id: str = "dit-0",
        transfer_timeout: float = 5.0,
        step_seconds: float = 0.0,
        server_options: list[tuple[str, Any]] | None = None,
    ):
        self.replica_id = replica_id
        self.incarnation_id = uuid.uuid4().hex
        self.broker_target = broker_target
        self.memory = memory
        self.transfer_timeout = transfer_timeout
        self.step_seconds = step_seconds
        self.endpoint = ""
        # Registered as ReplicaInfo.max_image_side (0 = no limit of the model's own).
        self.max_image_side = 0
        # Cleared = hold before the first step (DENOISING 0/n).
        self.step_gate = _opened()
        self.denoise_started = asyncio.Event()
        self.loaded = asyncio.Event()
        self.released: list[tuple[str, int]] = []
        self.deadlines: list[float | None] = []
        self.fail_denoise: KvRelayServerError | None = None
        self.dead = False  # killed (`kill`): releases nothing any more
        self.denoised: list[str] = []  # ticket ids of every Denoise call, in order
        self.server_options = server_options if server_options is not None else GRPC_OPTIONS
        # How the broker reaches this replica (set before start: e.g. through a TcpProxy).
        self.advertise: Callable[[str], Any] | None = None
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def broker(self) -> broker_pb2_grpc.BrokerServiceStub:
        assert self._channel is not None
        return broker_pb2_grpc.BrokerServiceStub(self._channel)

    async def start(self) -> None:
        self._server = grpc.aio.server(options=self.server_options)
        dit_pb2_grpc.add_DitServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.endpoint = f"127.0.0.1:{port}"
        if self.advertise is not None:
            self.endpoint = await self.advertise(self.endpoint)
        # As a real replica dials its broker: its replica id on every call (kvrelay-replica-id).
        self._channel = make_channel(self.broker_target, ChannelSecurity(replica_id=self.replica_id))
        await self.register()

    async def restart_with(self, num_pages: int) -> None:
        """What a restarted DiT process does: new incarnation, new (here smaller) page memory."""
        self.incarnation_id = uuid.uuid4().hex
        self.memory = DitMemory(num_pages)
        await self.register()

    async def register(self) -> None:
        info = broker_pb2.ReplicaInfo(
            replica_id=self.replica_id,
            role=common_pb2.REPLICA_ROLE_DIT,
            incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION,
            version="test",
            endpoint=self.endpoint,
            regions=[
                common_pb2.MemoryRegion(
                    rank=0,
                    transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
                    endpoint="127.0.0.1:1",
                    base_address=0,
                    length=len(self.memory.pool),
                )
            ],
            geometry=geometry_to_proto(GEOMETRY),
            parallelism=common_pb2.Parallelism(tensor_parallel_size=1, sequence_parallel_size=1),
            num_pages=self.memory.num_pages,
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
            stage_id=1,
            max_image_side=self.max_image_side,
        )
        await self.broker.RegisterReplica(
            broker_pb2.RegisterReplicaRequest(replica=info), timeout=RPC_TIMEOUT
        )

    async def stop(self) -> None:
        self.step_gate.set()
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()

    async def kill(self) -> None:
        """What `kill -9` of the DiT process looks like to the broker: its server goes away in the
        middle of its calls, and it releases nothing (its lease still runs)."""
        self.dead = True
        if self._server is not None:
            await self._server.stop(0)

    async def Denoise(
        self, request: dit_pb2.DenoiseRequest, context: Any
    ) -> AsyncIterator[dit_pb2.DenoiseEvent]:
        self.denoise_started.set()
        self.denoised.append(request.ticket_id)
        self.deadlines.append(context.time_remaining())
        ticket_id = request.ticket_id
        outcome = broker_pb2.TICKET_OUTCOME_CANCELLED
        reason = "DENOISE_CANCELLED"
        try:
            yield dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_LOADING)
            if self.fail_denoise is not None:
                outcome, reason = broker_pb2.TICKET_OUTCOME_FAILED, self.fail_denoise.reason
                await abort_with(context, self.fail_denoise)
            t0 = time.monotonic()
            remaining = context.time_remaining()
            wait = self.transfer_timeout if remaining is None else min(self.transfer_timeout, remaining)
            ticket = await self._wait_for_writes(ticket_id, wait)
            unwritten = ticket is not None and all(
                w.status == common_pb2.WRITE_STATUS_UNSPECIFIED for w in ticket.writes
            )
            if ticket is not None and ticket.state == broker_pb2.TICKET_STATE_RELEASED and unwritten:
                # Ended before any write (rolled back): what the real DiT answers (receiver.py).
                outcome, reason = broker_pb2.TICKET_OUTCOME_FAILED, "TICKET_ENDED"
                await abort_with(
                    context,
                    KvRelayServerError(grpc.StatusCode.ABORTED, "TICKET_ENDED", "ticket ended while loading"),
                )
            if ticket is None:
                outcome, reason = broker_pb2.TICKET_OUTCOME_TIMED_OUT, "TRANSFER_TIMEOUT"
                await abort_with(
                    context,
                    KvRelayServerError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT", "rows did not land in time"
                    ),
                )
            if any(w.status != common_pb2.WRITE_STATUS_OK for w in ticket.writes):
                outcome, reason = broker_pb2.TICKET_OUTCOME_FAILED, "TRANSFER_FAILED"
                await abort_with(
                    context,
                    KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED", "a write failed"),
                )
            if not await self._verify_and_report(ticket, t0 + wait):
                # As the real receiver: bytes reported written that never match their checksum
                # within the wait end the request as a timeout (dit_service/receiver.py).
                outcome, reason = broker_pb2.TICKET_OUTCOME_TIMED_OUT, "TRANSFER_TIMEOUT"
                await abort_with(
                    context,
                    KvRelayServerError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT",
                        "rows were reported written but never matched their checksums",
                    ),
                )  # fmt: skip
            load_seconds = time.monotonic() - t0
            # The DiT marks its ticket CONSUMING itself before reading the pages (issue 13).
            await self.broker.StartConsuming(
                broker_pb2.StartConsumingRequest(
                    ticket_id=ticket_id, replica_id=self.replica_id, incarnation_id=self.incarnation_id
                ),
                timeout=RPC_TIMEOUT,
            )
            self.loaded.set()
            yield dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_LOADED, load_seconds=load_seconds)
            t1 = time.monotonic()
            await self.step_gate.wait()
            for k in range(1, request.num_inference_steps + 1):
                await asyncio.sleep(self.step_seconds)
                yield dit_pb2.DenoiseEvent(
                    phase=dit_pb2.DENOISE_PHASE_STEP, step=k, total_steps=request.num_inference_steps
                )
            denoise_seconds = time.monotonic() - t1
            t2 = time.monotonic()
            png = make_png(request.width, request.height, request.seed % 256)
            image = common_pb2.Image(png=png, width=request.width, height=request.height, seed=request.seed)
            outcome, reason = broker_pb2.TICKET_OUTCOME_OK, ""
            await self._release(ticket_id, outcome, reason)
            yield dit_pb2.DenoiseEvent(
                phase=dit_pb2.DENOISE_PHASE_DECODED,
                image=image,
                denoise_seconds=denoise_seconds,
                decode_seconds=time.monotonic() - t2,
            )
        finally:
            if outcome != broker_pb2.TICKET_OUTCOME_OK:
                # Shielded: a cancelled stream must still hand the pages back.
                await asyncio.shield(self._release(ticket_id, outcome, reason))

    async def _wait_for_writes(self, ticket_id: str, timeout: float) -> broker_pb2.Ticket | None:
        watch = self.broker.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=ticket_id), timeout=timeout)
        try:
            async for reply in watch:
                t = reply.ticket
                if t.state in (broker_pb2.TICKET_STATE_DRAINING, broker_pb2.TICKET_STATE_RELEASED):
                    return t  # request over: let the caller fail it (its writes are not all OK)
                if t.writes and all(w.status != common_pb2.WRITE_STATUS_UNSPECIFIED for w in t.writes):
                    return t
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            raise
        finally:
            watch.cancel()
        return None

    async def _verify_and_report(self, ticket: broker_pb2.Ticket, deadline: float) -> bool:
        """Verify every row's bytes and report its load; a checksum the broker refuses (bytes may
        still be landing) is checked again until `deadline` (monotonic): False then."""
        rows = {(w.row, w.dst_rank) for w in ticket.writes}
        plan = await self._plan(ticket)
        for row, dst in sorted(rows):
            while not await self._verify_row(ticket, plan, row, dst):
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.05)
        return True

    async def _verify_row(
        self, ticket: broker_pb2.Ticket, plan: dict[tuple[int, int, int], PlannedWrite], row: int, dst: int
    ) -> bool:
        verified = []
        for w in ticket.writes:
            if (w.row, w.dst_rank) != (row, dst):
                continue
            planned = plan[(w.row, w.src_rank, w.dst_rank)]
            got = checksum_segments(self.memory.pool, planned.segments, side="dst")
            verified.append(
                broker_pb2.WriteProgress(
                    row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=got
                )
            )
        try:
            await self.broker.ReportLoad(
                broker_pb2.ReportLoadRequest(
                    ticket_id=ticket.ticket_id,
                    row=row,
                    dst_rank=dst,
                    replica_id=self.replica_id,
                    incarnation_id=self.incarnation_id,
                    verified=verified,
                ),
                timeout=RPC_TIMEOUT,
            )
        except grpc.aio.AioRpcError as err:
            if error_info(err)[1] == "CHECKSUM_MISMATCH":
                return False
            raise
        return True

    async def _plan(self, ticket: broker_pb2.Ticket) -> dict[tuple[int, int, int], PlannedWrite]:
        from kvrelay.transfer.planner import RowSpec, plan_transfer

        rows = [RowSpec(r.row, r.num_tokens, tuple(r.page_ids)) for r in ticket.rows]
        return {(w.row, w.src_rank, w.dst_rank): w for w in plan_transfer(GEOMETRY, 1, 1, rows)}

    async def _release(self, ticket_id: str, outcome: int, reason: str) -> None:
        if self.dead:
            return
        self.released.append((ticket_id, outcome))
        # UsageError: the test is tearing down and this replica's channel is already closed.
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await self.broker.ReleaseTicket(
                broker_pb2.ReleaseTicketRequest(
                    ticket_id=ticket_id,
                    outcome=outcome,  # type: ignore[arg-type]
                    reason=reason,
                    replica_id=self.replica_id,
                    incarnation_id=self.incarnation_id,
                ),
                timeout=RPC_TIMEOUT,
            )


# ------------------------------------------------------------------------- broker


def test_config(**broker: Any) -> Any:
    data = {
        "async_chunk": False,
        "broker": {"host": "127.0.0.1", "port": 0, "max_queue": 8, "result_ttl_seconds": 30, **broker},
        "stages": [
            {
                "stage_id": 0,
                "kind": "ar",
                "kv_cache_memory_bytes": 1 << 20,
                "request_timeout_seconds": 20,
                "model": {"preset": "tiny"},
            },
            {
                "stage_id": 1,
                "kind": "dit",
                "kv_cache_memory_bytes": 1 << 20,
                "request_timeout_seconds": 20,
                "model": {"preset": "tiny"},
            },
        ],
        "edges": [{"from": 0, "to": 1}],
    }
    return parse_config(yaml.safe_load(yaml.safe_dump(data)), "<test>")


@dataclass
class Cluster:
    core: BrokerCore
    orchestrator: Orchestrator
    registry: CollectorRegistry
    target: str
    channel: grpc.aio.Channel
    ar: ArReplica
    dit: DitReplica
    memory: DitMemory
    clock_offset: list[float]
    # Between the broker and the DiT replica, when the cluster was made with `dit_proxy=True`.
    dit_proxy: TcpProxy | None = None
    # The broker's GenerationService servicer (its detached generations, its image budget).
    generation: GenerationServicer | None = None
    # DiT replicas started with `add_dit`.
    extra_dits: list[DitReplica] = field(default_factory=list)

    @property
    def api(self) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(self.channel)

    def pool(self) -> Any:
        (pool,) = self.core.pool_status(self.dit.replica_id)
        return pool

    async def wait_pool_free(self, timeout: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            pool = self.pool()
            if pool.free == pool.total:
                return pool
            if time.monotonic() > deadline:
                # Who holds them, and what the DiT did: enough to tell a leak from a slow release.
                held = [
                    (t.ticket_id, t.request_id, t.state.name, t.outcome, t.reason)
                    for t in self.core.list_tickets(replica_id=self.dit.replica_id)
                ]
                raise AssertionError(
                    f"pages did not come back: {pool}; live tickets {held}; "
                    f"DiT denoised {self.dit.denoised}, released {self.dit.released}"
                )
            await asyncio.sleep(0.02)

    async def add_dit(self, replica_id: str, num_pages: int, **kw: Any) -> DitReplica:
        """Start and register a further DiT replica (its own page memory); the cluster stops it."""
        memory = DitMemory(num_pages)
        dit = DitReplica(self.target, memory, replica_id=replica_id, **kw)
        self.ar.memories[replica_id] = memory
        self.extra_dits.append(dit)
        await dit.start()
        return dit

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def cluster(
    *,
    num_pages: int = 32,
    max_tokens: int = 64,
    transfer_timeout: float = 5.0,
    step_seconds: float = 0.0,
    drain_quiet_seconds: float = 0.05,
    journal_path: str | None = None,
    credentials: Credentials | None = None,
    dit_proxy: bool = False,
    dit_server_options: list[tuple[str, Any]] | None = None,
    **broker: Any,
) -> AsyncIterator[Cluster]:
    cfg = test_config(**broker)
    clock_offset = [0.0]
    # Group commit, as `kvrelay broker` runs it: every reply and replica call waits for the journal.
    core = BrokerCore(
        journal_path, lease_seconds=60.0, drain_quiet_seconds=drain_quiet_seconds, journal_synchronous="OFF",
        journal_group_commit=True,
    )
    registry = CollectorRegistry()
    orchestrator = Orchestrator(
        core, cfg, registry, clock=lambda: time.monotonic() + clock_offset[0], credentials=credentials
    )
    generation = GenerationServicer(orchestrator)
    server = GrpcServer(
        name="broker",
        host="127.0.0.1",
        port=0,
        registrations=[
            (
                broker_pb2_grpc.add_BrokerServiceServicer_to_server,
                BrokerServicer(core, generation_state=orchestrator.generation_state),
                "kvrelay.v1.BrokerService",
            ),
            (
                generation_pb2_grpc.add_GenerationServiceServicer_to_server,
                generation,
                "kvrelay.v1.GenerationService",
            ),
        ],
        credentials=credentials,
    )
    await server.start()
    await server.set_serving(True)
    maintenance = asyncio.create_task(run_maintenance(core, interval=0.02))
    await orchestrator.start()
    memory = DitMemory(num_pages)
    ar = ArReplica(server.address, memory, max_tokens=max_tokens)
    dit = DitReplica(
        server.address, memory, transfer_timeout=transfer_timeout, step_seconds=step_seconds,
        server_options=dit_server_options,
    )
    proxy: TcpProxy | None = None
    if dit_proxy:

        async def through_proxy(endpoint: str) -> str:
            nonlocal proxy
            host, port = endpoint.rsplit(":", 1)
            proxy = await TcpProxy(host, int(port)).start()
            return proxy.address

        dit.advertise = through_proxy
    channel = grpc.aio.insecure_channel(server.address, options=GRPC_OPTIONS)
    made: Cluster | None = None
    try:
        await ar.start()
        await dit.start()
        made = Cluster(core, orchestrator, registry, server.address, channel, ar, dit, memory, clock_offset, proxy,
                       generation)
        yield made
    finally:
        if proxy is not None:
            await proxy.stop()
        await channel.close()
        await ar.stop()
        await dit.stop()
        if made is not None:
            for extra in made.extra_dits:
                await extra.stop()
        await orchestrator.stop()
        maintenance.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await maintenance
        await server.stop(grace=0)
        core.close()


def run(coro: Any, timeout: float = 60.0) -> Any:
    """Run one async test body on a fresh event loop, bounded so a hang fails instead of stalling."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(prompt: str = "a cat", **fields: Any) -> generation_pb2.GenerateRequest:
    fields.setdefault("width", 64)
    fields.setdefault("height", 64)
    return generation_pb2.GenerateRequest(prompt=prompt, **fields)


async def collect(call: Any) -> list[generation_pb2.GenerationEvent]:
    """Every remaining event of a Generate call (read() style, so a test may read() first)."""
    events = []
    while True:
        event = await call.read()
        if event is grpc.aio.EOF:
            return events
        events.append(event)


def error_info(err: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(code, ErrorInfo reason, ErrorInfo metadata) of a kvrelay error status."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"no rich status on {err}"
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return err.code(), info.reason, dict(info.metadata)
    raise AssertionError(f"no ErrorInfo in {err}")
