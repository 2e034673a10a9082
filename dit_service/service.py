"""DitService: the grpc.aio servicer of one DiT replica (Denoise and the PutKv fallback).

Owns the request protocol of docs/internals.md on the DiT side: admission in reservation order,
the wait for every (row, dst_rank) to be written, verified by its rank and reported with
ReportLoad, the denoise with its step stream, and the release of the ticket with the outcome
that happened. Model work runs in the rank workers (dit_service/engine.py); every blocking
harness call goes through a thread so the event loop never stalls.

What it must never do: release a ticket while a rank may still read its pages (a cancelled
Denoise first stops the ranks, then releases), accept a PutKv chunk outside the pages the broker
reserved for the named ticket and row, or keep serving after a broken invariant (a rank died,
the broker fenced us): then it asks the process to fail stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np

from kvrelay.broker_credential import credential_refused_gauge
from kvrelay.config import StageConfig
from kvrelay.dit_service.batcher import DenoiseBatcher
from kvrelay.dit_service.engine import (
    CANCEL,
    SERIAL,
    STEP,
    DenoiseResult,
    RunDenoise,
    RunDenoiseBatch,
    VerifyWrites,
)
from kvrelay.dit_service.fence import PageFence, PageKey, Superseded, page_keys
from kvrelay.dit_service.memory import ReplicaMemory
from kvrelay.dit_service.receiver import Fail, Loaded, LoadProtocol, Verify, WriteReport
from kvrelay.dit_service.releases import OwedReleases
from kvrelay.dit_service.scheduler import AdmissionQueue, Place, replica_queue
from kvrelay.errors import (
    KvRelayServerError,
    abort_with,
    invalid_argument,
    reason_of,
    request_budget,
    timestamp_problem,
)
from kvrelay.logging import get_logger
from kvrelay.models.image import encode_png
from kvrelay.security import current_caller
from kvrelay.transfer.checksum import checksum_segments
from kvrelay.transfer.convert import writes_from_proto
from kvrelay.transfer.grpc_stream import PutKvRejected, apply_put_kv
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.planner import PlannedWrite, RowSpec, cfg_group, plan_transfer
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2, dit_pb2, dit_pb2_grpc
from kvrelay.worker import WorkerCommandError, WorkerGroup, WorkerGroupError

log = get_logger(__name__)

BROKER_RPC_TIMEOUT_S = 5.0
# Ends the load wait this much before the caller's deadline, so that our TRANSFER_TIMEOUT status
# (not a bare transport deadline) is what the caller sees.
DEADLINE_MARGIN_S = 0.25
# Checksum re-check backoff while bytes may still be landing (Mooncake TCP may report early).
RECHECK_FIRST_S = 0.01
RECHECK_MAX_S = 0.2
# A load whose reported bytes still fail their checksums this long after the first check is
# logged once (load_checksums_mismatching): the load keeps re-checking silently otherwise.
MISMATCH_WARN_S = 2.0
# The service reads a running denoise's step counter (shared memory) STEP_POLL_S after each step,
# then ever less often (doubling up to STEP_POLL_MAX_S) until the next: at 10 ms flat, the
# polls of the requests in a batch cost ~20 ms of the service's CPU per request on a 2-core host
# (steps there take ~1 s), CPU the model's steps needed (benchmarks/served_cpu.py). Step events
# are progress only: the result comes the moment the ranks return, whatever the poll.
STEP_POLL_S = 0.01
STEP_POLL_MAX_S = 0.16
# A single rank command (a whole denoise) may take this long before the group counts as hung.
WORKER_CALL_TIMEOUT_S = 3600.0

_OUTCOME_PB = {
    "OK": broker_pb2.TICKET_OUTCOME_OK,
    "CANCELLED": broker_pb2.TICKET_OUTCOME_CANCELLED,
    "TIMED_OUT": broker_pb2.TICKET_OUTCOME_TIMED_OUT,
    "FAILED": broker_pb2.TICKET_OUTCOME_FAILED,
}
_MAX_DIM, _MIN_DIM = 2048, 64


class DitMetrics:
    """Prometheus metrics of one DiT process, on its own registry (passed to GrpcServer)."""

    def __init__(self, replica_id: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.phase_seconds = Histogram(
            "kvrelay_dit_phase_seconds", "Seconds per request phase, measured where it happens",
            ["phase"], buckets=buckets, registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "kvrelay_dit_received_bytes_total", "KV bytes received and verified into DiT pages, by rank",
            ["rank", "transport"], registry=self.registry,
        )
        self.denoise_requests = Counter(
            "kvrelay_dit_requests_total", "Denoise calls by outcome", ["outcome"], registry=self.registry
        )
        self.denoise_steps = Counter(
            "kvrelay_dit_denoise_steps_total", "Denoising steps executed by the ranks", registry=self.registry
        )
        self.active = Gauge("kvrelay_dit_active_requests",
                            "Denoise calls admitted (denoising, or next in line with their ticket CONSUMING)", registry=self.registry)
        self.waiting = Gauge("kvrelay_dit_waiting_requests", "Denoise calls waiting for admission",
                             registry=self.registry)
        self.pages = Gauge("kvrelay_dit_pages_per_rank", "Pages in each rank's pool", ["replica"],
                           registry=self.registry)
        self.pages.labels(replica_id)
        self.credential_refused = credential_refused_gauge("dit", self.registry)


@dataclass
class DitReplicaState:
    """What the servicer serves with; filled by main.py once workers and memory are up."""

    replica_id: str
    incarnation_id: str
    stage: StageConfig
    geometry: KvGeometry
    memory: ReplicaMemory
    control: Any  # int64 [slots, 3] numpy view of the shared control block
    group: WorkerGroup
    broker: broker_pb2_grpc.BrokerServiceStub
    metrics: DitMetrics
    fail_stop: Callable[[str], None]
    # The ranks' registered regions (CUDA IPC: mapped here too, to verify off the ranks).
    regions: tuple[RegionDescriptor, ...] = ()
    scheduler: AdmissionQueue = field(init=False)

    def __post_init__(self) -> None:
        self.scheduler = replica_queue(self.stage.max_num_seqs)

    @property
    def world_size(self) -> int:
        return self.memory.world_size


def _validate(request: dit_pb2.DenoiseRequest) -> None:
    if not request.ticket_id:
        raise invalid_argument("ticket_id", "required")
    for name in ("width", "height"):
        value = getattr(request, name)
        if value % 16 or not _MIN_DIM <= value <= _MAX_DIM:
            raise invalid_argument(name, f"must be a multiple of 16 in [{_MIN_DIM}, {_MAX_DIM}], got {value}")
    if not 1 <= request.num_inference_steps <= 1000:
        raise invalid_argument("num_inference_steps", f"must be in [1, 1000], got {request.num_inference_steps}")
    g = request.guidance_scale
    if not math.isfinite(g) or g < 1.0:
        raise invalid_argument("guidance_scale", f"must be finite and >= 1.0, got {g}")
    if request.HasField("deadline_time") and (problem := timestamp_problem(request.deadline_time)):
        raise invalid_argument("deadline_time", problem)


def _rows_of(ticket: broker_pb2.Ticket) -> tuple[RowSpec, ...]:
    return tuple(
        RowSpec(row=r.row, num_tokens=r.num_tokens, page_ids=tuple(r.page_ids))
        for r in sorted(ticket.rows, key=lambda r: r.row)
    )


def _transfer_error(code: grpc.StatusCode, reason: str, message: str) -> KvRelayServerError:
    return KvRelayServerError(code, reason, message)


async def _reading_pages(read: Callable[[], Any]) -> Any:
    """`read()` on a thread. A cancelled caller still waits for the thread to return: it reads a
    ticket's pages (a rank command, a checksum), and the ticket is released only once nothing
    touches them any more."""
    call = asyncio.ensure_future(asyncio.to_thread(read))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await call
        raise


async def _admitted(place: Place, load: asyncio.Task[Any]) -> int:
    """The call's slot, once admitted. A load that fails first ends the wait at once: the call
    leaves the queue with the load's error rather than wait for a slot it could not use."""
    while True:
        if load.done() and (load.cancelled() or load.exception() is not None):
            load.result()  # raises the load's error
        if place.admitted.done():
            return place.admitted.result()
        await asyncio.wait({place.admitted} if load.done() else {place.admitted, load},
                           return_when=asyncio.FIRST_COMPLETED)


async def _stop_load(load: asyncio.Task[Any]) -> None:
    """Cancel a load that still runs and wait until it stopped (its ticket watch closed, its
    checksum threads returned), so that the ticket is released only after. Never raises: the
    load's error was raised already, or is moot once the call ended another way."""
    if not load.done():
        load.cancel()
        await asyncio.wait({load})
    if not load.cancelled():
        load.exception()  # retrieved: asyncio must not log it as never retrieved


_NOT_READY = KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NOT_READY",
                                "the DiT replica is starting or stopping (health is not SERVING)")


class DitServicer(dit_pb2_grpc.DitServiceServicer):
    """Registered with the server before the replica is ready (the port must be bound to describe
    gRPC-fallback regions); calls are refused UNAVAILABLE until `attach`."""

    def __init__(self, state: DitReplicaState | None = None) -> None:
        self._state = state
        self._serials = itertools.count(1)
        # Denoise handlers running now: at stop, main waits for them to release their tickets
        # before the workers and the broker channel go away.
        self.inflight: set[asyncio.Future[Any]] = set()
        # Tickets a Denoise call of this process holds now (queued, loading, denoising): a second
        # call for one of them is refused before it owns anything, or its end would release the
        # ticket while the first call's ranks read its pages.
        self._calls: set[str] = set()
        self._batcher: DenoiseBatcher | None = None
        self._ipc_mapped: list[Any] | Literal[False] | None = None
        self._ipc_endpoint: Any = None
        # The page fence (dit_service/fence.py, docs/dit_service.md "The page fence"): every PutKv
        # chunk must find its pages still claimed by its own ticket. A gRPC write's ticket claims
        # its row's pages at its first chunk, a ticket being loaded claims them before they are
        # verified, and a page only goes to tickets of a higher reservation sequence. So a chunk
        # of an ended ticket still in a socket (its sender gave up: deadline, keepalive, a stopped
        # DiT) lands at most before the pages' next ticket is verified, whose checksums see it,
        # never after; and a stale claim (a load of a ticket released under it) never refuses the
        # chunks of the ticket that holds the pages now.
        self.fence = PageFence()
        # Releases not yet heard by the broker, retried until it does (main stops it last).
        self.releases = OwedReleases(self._send_release)

    def _ipc_pools(self) -> list[Any] | None:
        """Each rank's device pool mapped into this process (CUDA IPC), once; None if unavailable."""
        if self._ipc_mapped is None:
            self._ipc_mapped = False
            regions = sorted(self.s.regions, key=lambda r: r.rank)
            if len(regions) == self.s.world_size and all(r.transport == "cuda_ipc" for r in regions):
                try:
                    from kvrelay.transfer.cuda_ipc import CudaIpcEndpoint

                    self._ipc_endpoint = CudaIpcEndpoint()
                    self._ipc_mapped = [self._ipc_endpoint.map_region(r) for r in regions]
                except Exception as err:  # noqa: BLE001 - the ranks verify instead
                    log.warning("ipc_verify_unavailable", error=str(err))
        return self._ipc_mapped or None

    @property
    def batcher(self) -> DenoiseBatcher:
        """Admitted denoises are batched into one rank command (up to max_num_seqs at a time)."""
        if self._batcher is None:
            world = self.s.world_size

            async def run(items: list[RunDenoise]) -> list[tuple[DenoiseResult, ...]]:
                per_rank: list[tuple[DenoiseResult, ...]] = await self._call_each(
                    [RunDenoiseBatch(tuple(items))] * world
                )
                return per_rank

            self._batcher = DenoiseBatcher(run, self.s.stage.max_num_seqs)
        return self._batcher

    def attach(self, state: DitReplicaState | None) -> None:
        self._state = state

    @property
    def s(self) -> DitReplicaState:
        if self._state is None:
            raise _NOT_READY
        return self._state

    # ======================================================================= broker calls

    async def _broker_call(self, method: Any, request: Any, *, attempts: int = 4) -> Any:
        """A unary broker RPC with a deadline, retried while the broker is unreachable (every
        broker RPC the DiT makes is idempotent)."""
        delay = 0.05
        for attempt in range(attempts):
            try:
                return await method(request, timeout=BROKER_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                retriable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retriable or attempt == attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _get_ticket(self, ticket_id: str) -> broker_pb2.Ticket:
        try:
            reply = await self._broker_call(self.s.broker.GetTicket, broker_pb2.GetTicketRequest(ticket_id=ticket_id))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise KvRelayServerError(grpc.StatusCode.NOT_FOUND, "TICKET_NOT_FOUND",
                                         f"unknown ticket {ticket_id!r}") from None
            raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "BROKER_UNAVAILABLE",
                                     f"GetTicket {ticket_id}: {err.code().name}: {err.details()}") from None
        return reply.ticket

    async def _start_consuming(self, ticket_id: str) -> None:
        """READY -> CONSUMING, marked by the DiT itself before any rank reads the pages."""
        try:
            await self._broker_call(
                self.s.broker.StartConsuming,
                broker_pb2.StartConsumingRequest(
                    ticket_id=ticket_id, replica_id=self.s.replica_id, incarnation_id=self.s.incarnation_id
                ),
            )
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # Unanswered on every try (a stopped or restarting broker): nothing ended the ticket.
                raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "BROKER_UNAVAILABLE",
                                         f"StartConsuming {ticket_id}: {err.code().name}: {err.details()}") from None
            # The ticket ended under us (cancelled, replica restarted): the request cannot go on.
            raise KvRelayServerError(grpc.StatusCode.ABORTED, "TICKET_ENDED",
                                     f"StartConsuming {ticket_id}: {err.code().name}: {err.details()}") from None

    async def _release(self, ticket_id: str, outcome: str, reason: str) -> None:
        """ReleaseTicket; never raises. Returns once the broker heard it or after a few tries;
        an undelivered release is retried in the background until the broker hears it
        (dit_service/releases.py): the pages are the broker's to account."""
        await self.releases.release(ticket_id, outcome, reason)

    async def _send_release(self, ticket_id: str, outcome: str, reason: str) -> None:
        """One ReleaseTicket try (OwedReleases retries)."""
        reply = await self.s.broker.ReleaseTicket(
            broker_pb2.ReleaseTicketRequest(
                ticket_id=ticket_id, outcome=_OUTCOME_PB[outcome], reason=reason, replica_id=self.s.replica_id,
                incarnation_id=self.s.incarnation_id,
            ),
            timeout=BROKER_RPC_TIMEOUT_S,
        )
        log.info("ticket_released", ticket_id=ticket_id, outcome=outcome, reason=reason,
                 state=broker_pb2.TicketState.Name(reply.ticket.state))

    def held_tickets(self) -> list[str]:
        """What a re-registration lists as held (`AdmissionQueue.held_tickets`), less the tickets
        whose release is owed: no call reads those any more, the broker may free them."""
        owed = self.releases.owed
        return [t for t in self.s.scheduler.held_tickets() if t not in owed]

    def owed_releases(self) -> list[broker_pb2.OwedRelease]:
        """What a re-registration reports beside `held_tickets`: each release the broker has not
        acknowledged, with the call's real outcome (the broker records it, not BROKER_RESTARTED)."""
        return [
            broker_pb2.OwedRelease(ticket_id=t, outcome=_OUTCOME_PB[outcome], reason=reason)
            for t, (outcome, reason) in sorted(self.releases.owed_outcomes().items())
        ]

    # ======================================================================= worker calls

    async def _call_each(self, commands: Sequence[object], timeout_s: float = WORKER_CALL_TIMEOUT_S) -> list[Any]:
        try:
            return await _reading_pages(lambda: self.s.group.call_each(list(commands), timeout_s))
        except WorkerCommandError:
            raise
        except WorkerGroupError as err:
            # A missing or hung rank: the replica can no longer keep its pages' invariants.
            self.s.fail_stop(f"worker group failed: {err}")
            raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", str(err)) from err

    # ======================================================================= Denoise

    async def Denoise(
        self, request: dit_pb2.DenoiseRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[dit_pb2.DenoiseEvent]:
        if self._state is None:
            await abort_with(context, _NOT_READY)
        task = asyncio.current_task()
        if task is not None:
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
        start = time.monotonic()
        deadline_time = request.deadline_time if request.HasField("deadline_time") else None
        deadline = start + request_budget(context, self.s.stage.request_timeout_seconds, deadline_time)
        outcome, reason = "CANCELLED", "denoise cancelled by the caller"
        ticket_id = request.ticket_id
        release = holding = False
        finished: tuple[DenoiseResult, float, int] | None = None
        error: KvRelayServerError | None = None
        self.s.metrics.waiting.inc()
        waiting = True
        try:
            _validate(request)
            # With the broker's plan in the request, nothing needs asking: it planned once for both.
            planned = request.HasField("plan")
            ticket = request.plan.ticket if planned else await self._get_ticket(ticket_id)
            if ticket.ticket_id != ticket_id:
                raise invalid_argument("plan", f"the plan is for ticket {ticket.ticket_id}, not {ticket_id}")
            if ticket.dit_replica_id != self.s.replica_id:
                raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA",
                                         f"ticket {ticket_id} is bound to {ticket.dit_replica_id}, "
                                         f"not {self.s.replica_id}")
            rows = _rows_of(ticket)
            want_rows = 1 if request.guidance_scale == 1.0 else 2
            if len(rows) != want_rows:
                raise invalid_argument("guidance_scale", f"{request.guidance_scale} needs {want_rows} CFG row(s); "
                                       f"ticket {ticket_id} has {len(rows)}")
            if ticket.state == broker_pb2.TICKET_STATE_RELEASED or ticket_id in self.releases.owed:
                raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "TICKET_RELEASED",
                                         f"ticket {ticket_id} is already released")
            if ticket_id in self._calls:
                # One call per ticket (the broker sends one): a second one (a replay, a caller
                # that holds the replica token) must not end, and so release, the first one's.
                raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "TICKET_BUSY",
                                         f"ticket {ticket_id} is being served by another Denoise call")
            self._calls.add(ticket_id)
            holding = True
            # From here on the ticket is ours to release, whatever happens.
            release = True
            async with self.s.scheduler.enter(ticket.sequence, ticket_id) as place:
                # The load starts while the call is queued (once the queue gives it a look-ahead
                # place, else at admission): by admission its rows are usually verified already.
                load = asyncio.ensure_future(self._load_in_turn(
                    place, ticket, rows, deadline, writes_from_proto(request.plan.writes) if planned else None
                ))
                try:
                    slot = await _admitted(place, load)
                    waiting = False
                    self.s.metrics.waiting.dec()
                    self.s.metrics.active.inc()
                    try:
                        loading = dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_LOADING,
                                                       total_steps=request.num_inference_steps)
                        # As a rule the load is done by admission: then every event before the
                        # first step is sent once the ranks have the command, so the stream's
                        # writes never stand between the previous denoise and this one.
                        early = not load.done()
                        if early:
                            yield loading
                        loaded_bytes, load_seconds = await load
                        # Only now may the ranks read the pages: READY -> CONSUMING after admission.
                        await self._start_consuming(ticket_id)
                        self.s.metrics.phase_seconds.labels("load").observe(load_seconds)
                        loaded = dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_LOADED, bytes_loaded=loaded_bytes,
                                                      load_seconds=load_seconds,
                                                      total_steps=request.num_inference_steps)
                        result: DenoiseResult | None = None
                        # aclosing: however this handler ends (even closed at a yield), the ranks are
                        # stopped and awaited before the `finally` below releases the ticket.
                        first = (loaded,) if early else (loading, loaded)
                        async with contextlib.aclosing(self._denoise(slot, request, rows, context, first)) as steps:
                            async for event in steps:
                                if isinstance(event, DenoiseResult):
                                    result = event
                                else:
                                    yield event
                        assert result is not None and result.pixels is not None
                        # The ranks are done with this call: the next admitted one may run while
                        # this one releases its ticket and sends its image.
                        self.s.scheduler.free_slot(place)
                        self.s.metrics.phase_seconds.labels("denoise").observe(result.denoise_seconds)
                        self.s.metrics.phase_seconds.labels("rank_idle").observe(result.idle_seconds)
                        log.info("denoised", ticket_id=ticket_id, steps=result.steps_done,
                                 load_ms=round(load_seconds * 1e3, 2),
                                 denoise_ms=round((result.denoise_seconds + result.copy_seconds) * 1e3, 2),
                                 decode_ms=round(result.decode_seconds * 1e3, 2),
                                 rank_idle_ms=round(result.idle_seconds * 1e3, 2))
                        # Release before the final event: the caller may act on DECODED at once (and
                        # tests check the pool right after it). A task of its own, awaited shielded:
                        # a caller cancelling now (the broker ending the generation just as its image
                        # is made) must not cut the ReleaseTicket off half-way, which left the ticket
                        # CONSUMING, its pages reserved for good.
                        outcome, reason = "OK", ""
                        releasing = self.releases.owe(ticket_id, "OK", "")
                        self.inflight.add(releasing)
                        releasing.add_done_callback(self.inflight.discard)
                        release = False
                        await asyncio.shield(releasing)
                        finished = (result, load_seconds, loaded_bytes)
                    finally:
                        self.s.metrics.active.dec()
                finally:
                    # A load still running (the call was cancelled or failed elsewhere) is stopped
                    # and awaited before the place, and then the ticket, is let go.
                    await _stop_load(load)
            # The slot is free again: the next admitted ticket (loaded already, as a rule) denoises
            # on the GPU while this image's PNG is encoded on a host thread (Pillow releases the
            # GIL while it encodes).
            assert finished is not None
            result, load_seconds, loaded_bytes = finished
            encode_start = time.monotonic()
            png = await asyncio.to_thread(encode_png, result.pixels)
            decode_seconds = result.decode_seconds + (time.monotonic() - encode_start)
            self.s.metrics.phase_seconds.labels("decode").observe(decode_seconds)
            yield dit_pb2.DenoiseEvent(
                phase=dit_pb2.DENOISE_PHASE_DECODED,
                step=request.num_inference_steps, total_steps=request.num_inference_steps,
                image=common_pb2.Image(png=png, width=result.width, height=result.height, seed=request.seed),
                load_seconds=load_seconds, denoise_seconds=result.denoise_seconds + result.copy_seconds,
                decode_seconds=decode_seconds, bytes_loaded=loaded_bytes,
            )
        except KvRelayServerError as err:
            error = err
            outcome = "TIMED_OUT" if err.reason == "TRANSFER_TIMEOUT" else "FAILED"
            reason = f"{err.reason}: {err.message}"
        except WorkerCommandError as err:
            error = KvRelayServerError(grpc.StatusCode.INTERNAL, "DENOISE_FAILED", str(err).splitlines()[0])
            outcome, reason = "FAILED", f"DENOISE_FAILED: {error.message}"
        finally:
            if waiting:
                self.s.metrics.waiting.dec()
            self.s.metrics.denoise_requests.labels(outcome if error is None else error.reason).inc()
            if release:
                # Shielded: a cancelled caller must not leave the ticket unreleased.
                # Owed before any await: a second cancellation here (the server stopping) must not
                # leave the release unstarted, unseen by the stop path's wait for releases.
                await asyncio.shield(self.releases.owe(ticket_id, outcome, reason))
            if holding:
                self._calls.discard(ticket_id)
        if error is not None:
            await abort_with(context, error)

    async def _denoise(
        self, slot: int, request: dit_pb2.DenoiseRequest, rows: tuple[RowSpec, ...], context: Any,
        first: Sequence[dit_pb2.DenoiseEvent] = (),
    ) -> AsyncGenerator[dit_pb2.DenoiseEvent | DenoiseResult, None]:
        """Run the denoise on every rank, streaming steps from the shared control block; `first`
        are sent once the command is on its way to the ranks. On any exit (cancel included) the
        ranks are told to stop and awaited before this returns, so no rank reads the pages after
        the ticket is released."""
        control = self.s.control[slot]
        serial = next(self._serials)
        control[STEP], control[CANCEL], control[SERIAL] = 0, 0, serial
        total = request.num_inference_steps
        command = RunDenoise(slot, serial, rows, request.width, request.height, total,
                             request.guidance_scale, request.seed)
        task = asyncio.ensure_future(self.batcher.submit(command))

        def on_rpc_done(_: Any) -> None:
            # A caller that cancels while a step event is being sent is not seen by this
            # coroutine until the generator is finalized: tell the ranks at once. Guarded by the
            # serial so a late callback never cancels the next request's denoise.
            if not task.done() and int(control[SERIAL]) == serial:
                control[CANCEL] = 1

        context.add_done_callback(on_rpc_done)
        sent = 0
        try:
            for event in first:
                yield event
            poll = STEP_POLL_S
            while not task.done():
                await asyncio.wait({task}, timeout=poll)
                done = int(control[STEP])
                poll = next_step_poll(poll, advanced=done > sent)
                while sent < done:
                    sent += 1
                    yield dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_STEP, step=sent, total_steps=total)
            results: list[DenoiseResult] = task.result()
            lead = results[0]
            self.s.metrics.denoise_steps.inc(lead.steps_done)
            if lead.cancelled:
                raise KvRelayServerError(grpc.StatusCode.CANCELLED, "CANCELLED", "denoise stopped")
            while sent < lead.steps_done:
                sent += 1
                yield dit_pb2.DenoiseEvent(phase=dit_pb2.DENOISE_PHASE_STEP, step=sent, total_steps=total)
            yield lead
        finally:
            if not task.done() and self.batcher.withdraw(command):
                # A standby whose batch had not started: no rank ever saw it.
                await asyncio.wait({task})
                log.info("denoise_withdrawn", total_steps=total)
            elif not task.done():
                control[CANCEL] = 1
                try:
                    results = await asyncio.shield(task)
                    self.s.metrics.denoise_steps.inc(results[0].steps_done)
                    aborted = results[0].aborted_at
                    log.info("denoise_cancelled", steps_done=results[0].steps_done, total_steps=total,
                             aborted_step=aborted[0] if aborted else None,
                             aborted_block=aborted[1] if aborted else None,
                             aborted_chunk=aborted[2] if aborted else None)
                except Exception as err:  # noqa: BLE001 - already ending; the group error fail-stops
                    log.warning("denoise_stop_failed", error=str(err))

    # ======================================================================= loading

    async def _load_in_turn(
        self,
        place: Place,
        ticket: broker_pb2.Ticket,
        rows: tuple[RowSpec, ...],
        deadline: float,
        broker_plan: Sequence[PlannedWrite] | None,
    ) -> tuple[int, float]:
        """`_load` once the queue gives the call its turn (a look-ahead place, or its slot): the
        bytes loaded and the load's own seconds (its start to every row reported, whatever part
        of it the call spent queued). Its transfer_timeout budget starts here, not at admission."""
        await asyncio.wait({place.load_turn})
        start = time.monotonic()
        loaded_bytes = await self._load(ticket, rows, deadline, broker_plan)
        return loaded_bytes, time.monotonic() - start

    async def _load(
        self,
        ticket: broker_pb2.Ticket,
        rows: tuple[RowSpec, ...],
        deadline: float,
        broker_plan: Sequence[PlannedWrite] | None = None,
    ) -> int:
        """Wait until every (row, dst_rank) of the ticket is written, verified and reported; return
        the bytes loaded. Raises KvRelayServerError TRANSFER_TIMEOUT / TRANSFER_FAILED / TICKET_ENDED."""
        s = self.s
        ticket_id = ticket.ticket_id
        loop_start = time.monotonic()
        budget_end = min(loop_start + s.stage.transfer_timeout, deadline - DEADLINE_MARGIN_S)
        src_shards = max((w.src_rank for w in ticket.writes), default=0) + 1
        # What is verified (each write's segments: offsets and lengths in this replica's pools) is
        # always this replica's own plan of the ticket's rows; a plan that came with Denoise is
        # only checked equal to it. Found black-box: a caller holding the replica token posing as
        # the broker sent the genuine ticket with writes whose segments lay outside the pool
        # (UNKNOWN, a ValueError traceback) or over pages of no ticket of its own (the bytes
        # never matched: TRANSFER_TIMEOUT after transfer_timeout, the AR/DiT pair made suspect).
        try:
            _check_rows_in_pool(rows, s.memory.num_pages)
            plan = plan_transfer(s.geometry, src_shards, s.stage.head_shards, rows, cfg_parallel=s.stage.cfg_parallel_size)
        except ValueError as err:
            # Rows or writes no plan of this replica can serve (a forged plan's ticket: a source
            # rank the heads do not split into, pages the tokens do not need, pages outside the pool).
            log.warning("plan_mismatch", ticket_id=ticket_id, mismatch=str(err))
            raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH",
                                     f"ticket {ticket_id}: its rows and writes cannot be planned on this replica "
                                     f"({src_shards} source ranks): {err}") from None
        if broker_plan is not None:
            mismatch = plan_writes_mismatch(broker_plan, plan)
            if mismatch:
                log.warning("plan_mismatch", ticket_id=ticket_id, mismatch=mismatch)
                raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH",
                                         f"ticket {ticket_id}: {mismatch}; nothing was verified or claimed")
        planned: dict[tuple[int, int, int], PlannedWrite] = {(w.row, w.src_rank, w.dst_rank): w for w in plan}
        listed = {(w.row, w.src_rank, w.dst_rank) for w in ticket.writes}
        if listed != set(planned):
            raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH",
                                     f"ticket {ticket_id}: the broker expects writes {sorted(listed)}, "
                                     f"the DiT plans {sorted(planned)}")
        total_bytes = sum(w.num_bytes for w in plan)
        # The decisions are the pure LoadProtocol's; this loop only carries them out.
        protocol = LoadProtocol(ticket_id, planned, budget_end, RECHECK_FIRST_S, RECHECK_MAX_S)
        latest: list[broker_pb2.Ticket] = [ticket]
        changed = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch(ticket_id, latest, changed, budget_end))
        seen: broker_pb2.Ticket | None = None
        # A ticket from GetTicket is the broker's word; one from the caller's plan is checked
        # against the broker's first snapshot before any page is claimed.
        confirmed = broker_plan is None
        mismatch_warned = False
        asked_broker = False
        try:
            while True:
                t = latest[0]
                if t is not seen:
                    protocol.on_ticket(
                        t.state,
                        {(w.row, w.src_rank, w.dst_rank): WriteReport(w.status, w.checksum) for w in t.writes},
                        [(ld.row, ld.dst_rank) for ld in t.loads if ld.loaded],
                    )
                    seen = t
                command = protocol.next_command(time.monotonic())
                if isinstance(command, (Verify, Loaded)) and not confirmed:
                    # The caller's plan names the pages and the sequence the fence claims them
                    # with: take them only once the broker's own snapshot agrees (a forged or
                    # mistaken plan would fence pages it does not own, with a sequence that shuts
                    # every later ticket out of them).
                    if latest[0] is ticket:
                        if time.monotonic() >= budget_end:
                            message = f"ticket {ticket_id}: no word from the broker in time"
                            if not asked_broker:
                                asked_broker = True
                                fresh = await self._last_word(ticket_id, deadline, message)
                                if fresh is not None:
                                    latest[0] = fresh
                                    continue
                            raise _transfer_error(grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT", message)
                        changed.clear()
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(max(0.0, budget_end - time.monotonic())):
                                await changed.wait()
                        continue
                    _check_plan(ticket, latest[0])
                    confirmed = True
                if isinstance(command, Loaded):
                    # Verified and final: from now on the ranks may read these pages, and no
                    # chunk lands in them (a replayed or hostile one of this very ticket included).
                    self.fence.seal(ticket_id, ticket.sequence, self._fence_keys(rows))
                    return total_bytes
                if isinstance(command, Fail):
                    if command.budget_spent and not asked_broker:
                        # No word in time may be the broker's silence (stopped, restarting,
                        # unreachable), not the transfer's: ask once. Unanswered, the request
                        # fails BROKER_UNAVAILABLE (a TRANSFER_TIMEOUT marked a sound AR -> DiT
                        # link suspect); answered, its snapshot decides (the writes may be done).
                        asked_broker = True
                        fresh = await self._last_word(ticket_id, deadline, command.message)
                        if fresh is not None:
                            latest[0] = fresh
                            continue
                    message = command.message
                    if command.reason == "TRANSFER_TIMEOUT" and "in doubt" not in message:
                        message += (f" (waited {time.monotonic() - loop_start:.2f}s, "
                                    f"transfer_timeout {s.stage.transfer_timeout}s)")
                    raise _transfer_error(getattr(grpc.StatusCode, command.code), command.reason, message)
                if isinstance(command, Verify):
                    reported = {(w.row, w.src_rank, w.dst_rank): w for w in t.writes}
                    # The page fence: from here no late chunk of an earlier ticket lands in these
                    # pages, so what is verified stays what the ranks read.
                    verifying = {row for row, _ in command.loads}
                    try:
                        self.fence.claim(ticket_id, ticket.sequence,
                                         self._fence_keys(r for r in rows if r.row in verifying))
                    except Superseded as err:
                        # A later ticket holds a page: ours was released (our watch lags).
                        raise KvRelayServerError(grpc.StatusCode.ABORTED, "TICKET_ENDED",
                                                 f"{err} (ticket ended while loading)") from None
                    verified = await self._verify(list(command.loads), planned, reported)
                    # Every verified (row, dst_rank) goes in one ReportLoad (one broker commit,
                    # one ticket change for the watchers), not one call per load.
                    to_report = [(load, checks) for load, checks in verified.items() if checks is not None]
                    reply_ticket = await self._report_loads(ticket_id, to_report) if to_report else None
                    if reply_ticket is not None:
                        # Counted once the broker took the loads: their bytes are verified in pages.
                        for load, checks in to_report:
                            s.metrics.transfer_bytes.labels(str(load[1]), s.stage.transport).inc(
                                sum(c.bytes for c in checks))
                    now = time.monotonic()
                    for load in verified:
                        protocol.on_verified(load, reply_ticket is not None and verified[load] is not None, now)
                    stuck = sorted(load for load, since in protocol.mismatching_since.items()
                                   if now - since >= MISMATCH_WARN_S)
                    if stuck and not mismatch_warned:
                        mismatch_warned = True
                        log.warning("load_checksums_mismatching", ticket_id=ticket_id, loads=stuck,
                                    seconds=round(now - min(protocol.mismatching_since[ld] for ld in stuck), 2),
                                    transfer_timeout=s.stage.transfer_timeout)
                    if reply_ticket is not None:
                        latest[0] = reply_ticket
                    continue
                changed.clear()
                if latest[0] is t:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
                    # arrives as the event is set, and a cancelled load must stop (the call that
                    # owns it waits for it before releasing the ticket).
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(command.seconds):
                            await changed.wait()
        finally:
            watcher.cancel()
            try:
                await watcher
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - watcher errors are logged inside
                pass

    async def _last_word(self, ticket_id: str, deadline: float, why: str) -> broker_pb2.Ticket | None:
        """The load's budget is spent with no word that ends it: the ticket as the broker has it
        now, asked once (until BROKER_RPC_TIMEOUT_S, or the caller's deadline if nearer). Raises
        BROKER_UNAVAILABLE when the broker does not answer (found black-box: a broker SIGSTOPped
        for longer than transfer_timeout failed generations TRANSFER_TIMEOUT whose writes were
        done and reported, and marked their AR -> DiT link suspect); None when there is no time
        left to ask or the broker refuses (the caller then fails as it would have)."""
        timeout = min(BROKER_RPC_TIMEOUT_S, deadline - DEADLINE_MARGIN_S - time.monotonic())
        if timeout <= 0:
            return None
        try:
            reply = await self.s.broker.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket_id), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            raise KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "BROKER_UNAVAILABLE",
                f"{why}, and the broker does not answer (GetTicket {err.code().name} after {timeout:.2f}s: "
                f"{err.details()}): the wait was for the broker, not the transfer",
            ) from None
        return reply.ticket

    async def _watch(self, ticket_id: str, latest: list[broker_pb2.Ticket], changed: asyncio.Event,
                     until: float) -> None:
        """Follow the ticket with WatchTicket (GetTicket polling if the stream breaks) until `until`."""
        while time.monotonic() < until:
            call = self.s.broker.WatchTicket(broker_pb2.WatchTicketRequest(ticket_id=ticket_id),
                                             timeout=max(0.01, until - time.monotonic()))
            try:
                async for reply in call:
                    latest[0] = reply.ticket
                    changed.set()
                return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return
                log.warning("watch_ticket_failed", ticket_id=ticket_id, code=err.code().name, details=err.details())
            finally:
                call.cancel()
            try:
                reply = await self._broker_call(self.s.broker.GetTicket,
                                                broker_pb2.GetTicketRequest(ticket_id=ticket_id))
                latest[0] = reply.ticket
                changed.set()
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)

    async def _verify(
        self,
        loads: Sequence[tuple[int, int]],
        planned: dict[tuple[int, int, int], PlannedWrite],
        reported: dict[tuple[int, int, int], broker_pb2.WriteProgress],
    ) -> dict[tuple[int, int], list[broker_pb2.WriteProgress] | None]:
        """Checksums of the destination bytes, computed by each destination rank. Per load: the
        verified list for ReportLoad, or None while some write's bytes do not match yet."""
        per_rank: list[list[PlannedWrite]] = [[] for _ in range(self.s.world_size)]
        for row, dst in loads:
            per_rank[dst].extend(w for k, w in sorted(planned.items()) if (k[0], k[2]) == (row, dst))
        if self.s.stage.verify_checksums and self.s.stage.transport != "cuda_ipc":
            # Host pools are mapped here too: hash them in this process (off the event loop), so a
            # load never waits behind the ranks' running denoise batch.
            memory = self.s.memory
            sums = await _reading_pages(
                lambda: [[checksum_segments(memory.region(w.dst_rank), w.segments, side="dst") for w in ws]
                         for ws in per_rank]
            )
        elif self.s.stage.verify_checksums:
            # Device-resident pages (CUDA IPC): the device checksum over each rank's pool, mapped
            # into this process too, so a load does not wait behind the ranks' running batch;
            # through the ranks when this process cannot map them.
            pools = self._ipc_pools()
            if pools is not None:
                from kvrelay.transfer.cuda_ipc import verify_writes

                sums = await _reading_pages(
                    lambda: [verify_writes(pools[d], ws) if ws else [] for d, ws in enumerate(per_rank)]
                )
            else:
                sums = await self._call_each([VerifyWrites(tuple(ws)) for ws in per_rank])
        else:
            # Opt-out (RDMA deployments that trust completion): report the writer's checksums.
            sums = [[reported[(w.row, w.src_rank, w.dst_rank)].checksum for w in ws] for ws in per_rank]
        actual = {
            (w.row, w.src_rank, w.dst_rank): c
            for ws, cs in zip(per_rank, sums, strict=True) for w, c in zip(ws, cs, strict=True)
        }
        out: dict[tuple[int, int], list[broker_pb2.WriteProgress] | None] = {}
        for row, dst in loads:
            keys = [k for k in sorted(planned) if (k[0], k[2]) == (row, dst)]
            if any(actual[k] != reported[k].checksum for k in keys):
                out[(row, dst)] = None
                continue
            out[(row, dst)] = [
                broker_pb2.WriteProgress(row=k[0], src_rank=k[1], dst_rank=k[2], status=common_pb2.WRITE_STATUS_OK,
                                         checksum=actual[k], bytes=planned[k].num_bytes)
                for k in keys
            ]
        return out

    async def _report_loads(
        self, ticket_id: str, loads: Sequence[tuple[tuple[int, int], list[broker_pb2.WriteProgress]]]
    ) -> broker_pb2.Ticket | None:
        """ReportLoad of every (row, dst_rank) in `loads`, in one call (idempotent, retried). None
        when the broker says a checksum does not match its writer's yet (bytes still landing):
        the caller re-verifies (the loads the broker took before it are retries then)."""
        request = broker_pb2.ReportLoadRequest(ticket_id=ticket_id, replica_id=self.s.replica_id,
                                               incarnation_id=self.s.incarnation_id)
        if len(loads) == 1:
            (row, dst_rank), verified = loads[0]
            request.row, request.dst_rank = row, dst_rank
            request.verified.extend(verified)
        else:
            request.loads.extend(broker_pb2.LoadReport(row=row, dst_rank=dst_rank, verified=verified)
                                 for (row, dst_rank), verified in loads)  # fmt: skip
        try:
            reply = await self._broker_call(self.s.broker.ReportLoad, request)
        except grpc.aio.AioRpcError as err:
            if reason_of(err)[1] == "CHECKSUM_MISMATCH":
                return None
            where = ", ".join(f"row={row} rank={rank}" for (row, rank), _ in loads)
            raise KvRelayServerError(err.code(), "REPORT_LOAD_FAILED",
                                     f"ReportLoad {ticket_id} {where}: {err.details()}") from None
        return reply.ticket

    # ======================================================================= PutKv

    async def PutKv(
        self, request_iterator: AsyncIterator[dit_pb2.PutKvRequest], context: grpc.aio.ServicerContext
    ) -> dit_pb2.PutKvResponse:
        if self._state is None:
            await abort_with(context, _NOT_READY)
        s = self.s
        allowed: dict[tuple[str, int], tuple[list[tuple[int, int]], frozenset[tuple[int, int]]]] = {}
        received = chunks = 0
        per_rank: dict[int, int] = {}
        try:
            async for chunk in request_iterator:
                if chunk.dst_rank >= s.world_size:
                    raise invalid_argument("dst_rank", f"{chunk.dst_rank} is not a rank of this replica "
                                           f"({s.world_size} ranks)")
                key = (chunk.ticket_id, chunk.row)
                found = allowed.get(key)
                if found is None:
                    found = await self._allowed_ranges(chunk.ticket_id, chunk.row)
                    allowed[key] = found
                ranges, pairs = found
                if (chunk.src_rank, chunk.dst_rank) not in pairs:
                    ranks = {dst for _, dst in pairs}
                    if chunk.dst_rank not in ranks:
                        # A CFG-parallel rank holds no pages for the other group's row: same page
                        # ids, another row's memory.
                        raise invalid_argument("dst_rank", f"ticket {chunk.ticket_id} plans no write of row "
                                               f"{chunk.row} to rank {chunk.dst_rank} (ranks {sorted(ranks)})")
                    srcs = sorted(src for src, dst in pairs if dst == chunk.dst_rank)
                    raise invalid_argument("src_rank", f"ticket {chunk.ticket_id} plans no write of row {chunk.row} "
                                           f"from rank {chunk.src_rank} to rank {chunk.dst_rank} "
                                           f"(source ranks {srcs})")
                region = s.memory.region(chunk.dst_rank)
                self._check_fence(chunk, ranges)
                try:
                    landed = apply_put_kv(region, chunk, len(region), ranges)
                except PutKvRejected as err:
                    raise invalid_argument("dst_offset", str(err)) from None
                received += landed
                per_rank[chunk.dst_rank] = per_rank.get(chunk.dst_rank, 0) + landed
                chunks += 1
        except KvRelayServerError as err:
            await abort_with(context, err)
        for rank, landed in per_rank.items():
            s.metrics.transfer_bytes.labels(str(rank), "grpc_received").inc(landed)
        return dit_pb2.PutKvResponse(bytes_received=received, chunks_received=chunks)

    def _fence_keys(self, rows: Iterable[RowSpec | common_pb2.RowPages]) -> list[PageKey]:
        """The page fence's keys of the rows' pages: (CFG group, page id), page ids being per group."""
        cfg = self.s.stage.cfg_parallel_size
        return [key for r in rows for key in page_keys(cfg_group(r.row, cfg), r.page_ids)]

    def _check_fence(self, chunk: dit_pb2.PutKvRequest, ranges: Sequence[tuple[int, int]]) -> None:
        """Refuse a chunk whose pages another ticket has claimed since its own ticket did (one
        outside its row's pages is apply_put_kv's to refuse)."""
        start, stop = chunk.dst_offset, chunk.dst_offset + len(chunk.data)
        if start == stop or not any(lo <= start and stop <= hi for lo, hi in ranges):
            return
        page_bytes = self.s.memory.page_bytes
        # The chunk's row names its CFG group (its dst_rank was checked to be a rank of that group).
        group = cfg_group(chunk.row, self.s.stage.cfg_parallel_size)
        try:
            self.fence.check(chunk.ticket_id, page_keys(group, range(start // page_bytes, (stop - 1) // page_bytes + 1)))
        except Superseded as err:
            raise _not_writable(str(err)) from None

    async def _allowed_ranges(
        self, ticket_id: str, row: int
    ) -> tuple[list[tuple[int, int]], frozenset[tuple[int, int]]]:
        """Byte ranges of the pages the broker reserved for (ticket, row), and the (source rank,
        destination rank) pairs of its plan's writes of that row; the ticket must be ours and
        armed, and not released (its pages may belong to another ticket by now). Claims the row's
        pages for the ticket (the page fence), unless a later ticket holds one of them: then the
        broker's answer was stale (the ticket ended while it travelled)."""
        ticket = await self._get_ticket(ticket_id)
        if ticket.dit_replica_id != self.s.replica_id:
            raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA",
                                     f"ticket {ticket_id} is bound to {ticket.dit_replica_id}, not {self.s.replica_id}")
        caller = current_caller()
        if caller is not None and not caller.acts_as(ticket.ar_replica_id):
            # Only the ticket's own AR writes its pages: another AR replica (its own certificate
            # under mutual TLS) landed chunks in a ticket armed for ar-0 while ar-0's writes ran.
            raise KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA",
                                     f"ticket {ticket_id} is written by AR {ticket.ar_replica_id}, not "
                                     f"{caller.replica_id or 'an undeclared caller'}")
        if ticket.state in _NOT_WRITABLE_STATES or not ticket.armed:
            # READY and CONSUMING: every write is final and verified (the ranks may be reading).
            raise _not_writable(f"ticket {ticket_id} is {broker_pb2.TicketState.Name(ticket.state)}"
                                f"{'' if ticket.armed else ' and not armed'}: no write may land in its pages")
        for r in ticket.rows:
            if r.row == row:
                pairs = frozenset((w.src_rank, w.dst_rank) for w in ticket.writes if w.row == row)
                ranges = self.s.memory.page_ranges(tuple(r.page_ids))
                try:
                    self.fence.claim(ticket_id, ticket.sequence, self._fence_keys([r]))
                except Superseded as err:
                    raise _not_writable(str(err)) from None
                return ranges, pairs
        raise invalid_argument("row", f"ticket {ticket_id} has no row {row}")


_NOT_WRITABLE_STATES = (broker_pb2.TICKET_STATE_READY, broker_pb2.TICKET_STATE_CONSUMING,
                        broker_pb2.TICKET_STATE_RELEASED)


def _check_rows_in_pool(rows: Sequence[RowSpec], num_pages: int) -> None:
    """ValueError unless every page id of `rows` lies in a pool of `num_pages` pages (checked
    before planning: a forged row of millions of page ids is refused, not planned)."""
    for r in rows:
        if len(r.page_ids) > num_pages or (r.page_ids and max(r.page_ids) >= num_pages):
            raise ValueError(f"row {r.row}: page ids outside the pool of {num_pages} pages")


def plan_writes_mismatch(given: Sequence[PlannedWrite], own: Sequence[PlannedWrite]) -> str:
    """How the writes of a plan handed with Denoise differ from this replica's own plan of the
    same ticket rows ("" when they do not); the first difference is named. Pure."""
    mine = {(w.row, w.src_rank, w.dst_rank): w for w in own}
    theirs: dict[tuple[int, int, int], PlannedWrite] = {}
    for w in given:
        key = (w.row, w.src_rank, w.dst_rank)
        if key in theirs:
            return f"plan.writes names write (row, src_rank, dst_rank) {key} twice"
        theirs[key] = w
    if set(theirs) != set(mine):
        return (f"plan.writes {sorted(theirs)[:8]} are not the writes {sorted(mine)[:8]} of the "
                "ticket's rows on this replica's ranks")
    for key in sorted(mine):
        if theirs[key].segments != mine[key].segments:
            return (f"plan.writes {key}: segments are not the offsets and lengths of the ticket's "
                    "own pages in this replica's pools")
    return ""


def _check_plan(planned: broker_pb2.Ticket, broker: broker_pb2.Ticket) -> None:
    """The plan's ticket must be the broker's: same replica, sequence and rows (pages)."""
    if (planned.dit_replica_id, planned.sequence, _rows_of(planned)) != (
        broker.dit_replica_id, broker.sequence, _rows_of(broker)
    ):
        raise KvRelayServerError(
            grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH",
            f"ticket {planned.ticket_id}: the plan's ticket (sequence {planned.sequence}, rows "
            f"{[list(r.page_ids) for r in _rows_of(planned)]}) is not the broker's (sequence {broker.sequence}, "
            f"rows {[list(r.page_ids) for r in _rows_of(broker)]})",
        )


def _not_writable(message: str) -> KvRelayServerError:
    """A PutKv chunk that must not land (ticket not armed or released, or its pages claimed by
    another ticket: the page fence)."""
    return KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "TICKET_NOT_WRITABLE", message)


def next_step_poll(poll_s: float, *, advanced: bool) -> float:
    """How long to wait before the next look at a step counter: STEP_POLL_S once it advanced,
    twice the last wait (at most STEP_POLL_MAX_S) while it did not."""
    return STEP_POLL_S if advanced else min(poll_s * 2, STEP_POLL_MAX_S)


def control_view(buffer: Any, slots: int) -> Any:
    from kvrelay.dit_service.engine import CONTROL_FIELDS

    return np.frombuffer(buffer, dtype=np.int64).reshape(slots, CONTROL_FIELDS)
