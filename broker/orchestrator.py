"""The orchestrator: drives every generation from QUEUED to SUCCEEDED, FAILED or CANCELLED.

Owns admission (Tokenize first, the bounded queue, requests that can never fit), placement in
FIFO order over the registered AR and DiT replicas (through BrokerCore, which owns replica
choice, pages and tickets), the pipeline of one request (`ArService.Prefill` and
`DitService.Denoise` concurrently, over gRPC), the mapping of what happens to client-visible
states, deadlines, cancellation and the generation metrics.

Must never touch pages or tickets except through BrokerCore, never block the event loop (beyond
the journal's SQLite commits, which BrokerCore makes the same way), and never import torch or a
model service: AR and DiT are remote, reached at their registered
endpoints. A request that ends early ends its ticket with `BrokerCore.cancel_ticket`, which
rolls back a ticket nothing was written to and drains an armed one: the request is over for
the client at once, the pages come back only when no write can land any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import timestamp_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import (
    PHASES,
    ErrorInfo,
    GenerationParams,
    GenerationRecord,
    GenerationSnapshot,
    GenerationStore,
    GenState,
    ImageResult,
)
from kvrelay.broker.registry import ReplicaRole
from kvrelay.broker.service import plan_to_proto
from kvrelay.broker.tickets import BrokerError, Ticket, TicketOutcome, TicketState
from kvrelay.config import KvRelayConfig
from kvrelay.errors import KvRelayServerError, failed_precondition, invalid_argument, reason_of
from kvrelay.logging import bind_request, get_logger
from kvrelay.security import BROKER_CALLER_ID, CallerClass, Credentials, make_channel
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, dit_pb2, dit_pb2_grpc

log = get_logger(__name__)

# Tokenize is a table lookup on the AR: it answers in milliseconds or the replica is in trouble.
TOKENIZE_TIMEOUT_SECONDS = 10.0
# How often the queue re-checks placement without a wake-up (leases expire silently).
PLACEMENT_POLL_SECONDS = 0.5
# How long a finished image waits for the AR's Prefill reply (its timings) before it is served.
PREFILL_REPLY_GRACE_SECONDS = 10.0
# How long a TRANSFER_FAILED from the DiT waits for the AR's own error, which names the cause.
WRITER_FAILURE_GRACE_SECONDS = 1.0
# Seconds a stopping broker gives pipelines to end their tickets before it gives up on them.
STOP_GRACE_SECONDS = 5.0

_OUTCOME_OF_STATE = {
    GenState.SUCCEEDED: "succeeded",
    GenState.FAILED: "failed",
    GenState.CANCELLED: "cancelled",
}


class _RequestEnded(Exception):
    """Raised inside a pipeline to end it with this error (FAILED)."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(eq=False)
class _Job:
    """One admitted generation's place in the queue and its pipeline task."""

    record: GenerationRecord
    token_counts: tuple[int, ...]
    deadline: float | None  # monotonic; None = no client deadline
    enqueued: float  # monotonic
    placed: asyncio.Future[Ticket] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ticket_id: str = ""
    ticket_ended: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


class GenerationMetrics:
    """kvrelay_generations_total{outcome}, kvrelay_generation_seconds, kvrelay_phase_seconds{phase}."""

    def __init__(self, registry: CollectorRegistry, queue_depth: Callable[[], int]) -> None:
        self.queued = Gauge(
            "kvrelay_generations_queued",
            "Generations admitted and waiting (FIFO) for pages and a ticket",
            registry=registry,
        )
        self.queued.set_function(queue_depth)
        self.generations = Counter(
            "kvrelay_generations", "Finished generations by outcome", ["outcome"], registry=registry
        )
        self.generation_seconds = Histogram(
            "kvrelay_generation_seconds",
            "End-to-end time of succeeded generations (accepted to image)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.phase_seconds = Histogram(
            "kvrelay_phase_seconds",
            "Time of each phase of succeeded generations, measured where it happened",
            ["phase"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 300),
            registry=registry,
        )
        for outcome in _OUTCOME_OF_STATE.values():
            self.generations.labels(outcome)
        for phase in PHASES:
            self.phase_seconds.labels(phase)

    def finished(self, snap: GenerationSnapshot) -> None:
        self.generations.labels(_OUTCOME_OF_STATE[snap.state]).inc()
        if snap.state is GenState.SUCCEEDED:
            self.generation_seconds.observe(snap.timings.get("total", 0.0))
            for phase in PHASES:
                if phase in snap.timings:
                    self.phase_seconds.labels(phase).observe(snap.timings[phase])


class Orchestrator:
    """The request pipeline of the broker process (DESIGN.md section 7).

    Wire it as `Orchestrator(core, cfg, registry)`, `await start()` once the event loop runs,
    `await stop()` before the core closes. Single-threaded: everything runs on one loop.
    """

    def __init__(
        self,
        core: BrokerCore,
        cfg: KvRelayConfig,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        credentials: Credentials | None = None,
    ) -> None:
        self.core = core
        self.cfg = cfg
        # The broker dials AR and DiT replicas as a replica-class caller named "broker".
        self._channel_security = (credentials or Credentials()).channel(CallerClass.REPLICA, BROKER_CALLER_ID)
        self.max_queue = cfg.broker.max_queue
        self.prefill_timeout = cfg.ar_stage.request_timeout_seconds
        self.denoise_timeout = cfg.dit_stage.request_timeout_seconds
        self._clock = clock
        self.store = GenerationStore(
            result_ttl_seconds=cfg.broker.result_ttl_seconds,
            max_results=cfg.broker.max_results,
            clock=clock,
            journal=core.journal,
        )
        self.metrics = GenerationMetrics(
            registry if registry is not None else CollectorRegistry(), lambda: len(self._queue)
        )
        # Admitted jobs waiting for a ticket, in arrival order: only the head is ever placed,
        # so a large request is never starved by smaller ones behind it.
        self._queue: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}
        # request_id -> admission in progress (Tokenize), so a concurrent duplicate waits for it.
        self._admitting: dict[str, asyncio.Future[None]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    # ================================================================ lifecycle

    async def start(self) -> None:
        restored = self.store.restore()
        if restored:
            log.info("generations_restored", count=restored)
        self._tasks = [
            asyncio.create_task(self._placement_loop(), name="orchestrator-placement"),
            asyncio.create_task(self._core_change_relay(), name="orchestrator-core-changes"),
        ]

    async def stop(self) -> None:
        """Fail every live generation (UNAVAILABLE), end its ticket, close stage channels."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for record in self.store.live():
            # Not journaled: after the restart a retry with the same request_id starts afresh
            # instead of attaching to this failure.
            self._end(
                record,
                GenState.FAILED,
                ErrorInfo("UNAVAILABLE", "BROKER_SHUTTING_DOWN", "the broker is shutting down"),
                persist=False,
            )
        pipelines = [job.task for job in self._jobs.values() if job.task is not None]
        for task in pipelines:
            task.cancel()
        waiting = [*self._tasks, *pipelines]
        if waiting:
            await asyncio.wait(waiting, timeout=STOP_GRACE_SECONDS)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # ================================================================= the API

    async def submit(
        self, request_id: str, params: GenerationParams, *, seed_given: bool, timeout: float | None
    ) -> GenerationRecord:
        """Admit a generation (or attach to the one with this request_id) and return its record.

        Raises KvRelayServerError: ALREADY_EXISTS (same id, other parameters), RESOURCE_EXHAUSTED
        (queue full), INVALID_ARGUMENT (prompt too long, can never fit), UNAVAILABLE (no replica).
        `timeout` is the client's deadline in seconds (None = none); it covers queueing too.
        """
        if self._stopping:
            raise KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "BROKER_SHUTTING_DOWN", "the broker is stopping"
            )
        while True:
            pending = self._admitting.get(request_id)
            if pending is None:
                break
            # A duplicate of a request still being admitted: its fate is this one's.
            await asyncio.shield(pending)
        record, created = self.store.create_or_attach(request_id, params, seed_given)
        if not created:
            return record
        if len(self._queue) + len(self._admitting) >= self.max_queue:
            self.store.discard(record)
            raise KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
                f"the queue holds {self.max_queue} generations (broker.max_queue); retry later",
            )
        deadline = None if timeout is None else self._clock() + timeout
        admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._admitting[request_id] = admission
        try:
            with bind_request(request_id=request_id):
                token_counts = await self._admit(params, deadline)
        except KvRelayServerError as err:
            # Rejected: nothing was accepted under this id. Attached streams see the error.
            self._end(
                record, GenState.FAILED, ErrorInfo(err.code.name, err.reason, err.message), counted=False
            )
            self.store.discard(record)
            raise
        except asyncio.CancelledError:
            if self._stopping:
                aborted = ErrorInfo("ABORTED", "ADMISSION_ABORTED", "admission was interrupted")
                self._end(record, GenState.FAILED, aborted, counted=False)
                self.store.discard(record)
            elif deadline is not None and self._clock() >= deadline:
                self._end(
                    record,
                    GenState.FAILED,
                    ErrorInfo("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "the client's deadline passed"),
                )
            else:
                # The client went away (or cancelled its call) while it was being tokenized: a
                # cancel like one at any later stage, counted and kept.
                self._end(
                    record,
                    GenState.CANCELLED,
                    ErrorInfo("CANCELLED", "CLIENT_DISCONNECTED", "the client cancelled or dropped the call"),
                )
            raise
        except BaseException:
            aborted = ErrorInfo("ABORTED", "ADMISSION_ABORTED", "admission was interrupted")
            self._end(record, GenState.FAILED, aborted, counted=False)
            self.store.discard(record)
            raise
        finally:
            del self._admitting[request_id]
            admission.set_result(None)
        if record.state.terminal:
            # Ended while it was being tokenized: cancelled by its client (keep that answer), or
            # failed by stop() (then nothing is accepted any more).
            if self._stopping:
                self.store.discard(record)
                raise KvRelayServerError(
                    grpc.StatusCode.UNAVAILABLE, "BROKER_SHUTTING_DOWN", "the broker is stopping"
                )
            return record
        job = _Job(record=record, token_counts=token_counts, deadline=deadline, enqueued=self._clock())
        self._jobs[request_id] = job
        self._queue.append(job)
        job.task = asyncio.create_task(self._pipeline(job), name=f"generation-{request_id}")
        self._wake.set()
        log.info(
            "generation_queued", request_id=request_id, rows=len(token_counts), tokens=list(token_counts)
        )
        return record

    def cancel(
        self, request_id: str, reason: str = "CANCELLED_BY_CLIENT", message: str = ""
    ) -> GenerationSnapshot:
        """End a generation for its client now; its ticket rolls back or drains behind it.

        Idempotent: a generation already CANCELLED is returned as it is. FAILED_PRECONDITION
        (ALREADY_FINISHED) when it already SUCCEEDED or FAILED; NOT_FOUND when unknown.
        """
        record = self.store.get(request_id)
        if record.state is GenState.CANCELLED:
            return record.snapshot()
        if record.state.terminal:
            raise failed_precondition(
                "ALREADY_FINISHED", f"generation {request_id!r} already ended {record.state.name}"
            )
        self._end(
            record,
            GenState.CANCELLED,
            ErrorInfo("CANCELLED", reason, message or "the generation was cancelled"),
        )
        return record.snapshot()

    def expire(self, request_id: str) -> None:
        """The client's deadline passed (its stream ended with it): FAILED, DEADLINE_EXCEEDED."""
        record = self.store.find(request_id)
        if record is not None and not record.state.terminal:
            self._end(
                record,
                GenState.FAILED,
                ErrorInfo("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "the client's deadline passed"),
            )

    def get(self, request_id: str) -> GenerationSnapshot:
        return self.store.get(request_id).snapshot()

    def list_generations(
        self, states: Sequence[GenState] = (), limit: int | None = None
    ) -> list[GenerationSnapshot]:
        return self.store.list_generations(states, limit)

    def queue_depth(self) -> int:
        return len(self._queue)

    # ================================================================ admission

    async def _admit(self, params: GenerationParams, deadline: float | None) -> tuple[int, ...]:
        """Tokenize the rows and check they fit the AR and some DiT: token counts per row."""
        ar_id = self.core.choose_ar_replica()
        if ar_id is None:
            raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NO_AR_REPLICA", "no AR replica is up")
        endpoint = self.core.get_replica(ar_id).spec.endpoint
        timeout = TOKENIZE_TIMEOUT_SECONDS
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - self._clock()))
        rows = params.rows
        try:
            reply = await ar_pb2_grpc.ArServiceStub(self._channel(endpoint)).Tokenize(
                ar_pb2.TokenizeRequest(texts=list(rows)), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            code, reason, message = reason_of(err)
            if code == "UNAVAILABLE" and reason == "UNAVAILABLE":
                reason = "AR_UNAVAILABLE"
            raise KvRelayServerError(
                grpc.StatusCode[code], reason, f"Tokenize on AR replica {ar_id}: {message}"
            ) from None
        counts = tuple(int(n) for n in reply.token_counts)
        if len(counts) != len(rows):
            raise KvRelayServerError(
                grpc.StatusCode.INTERNAL,
                "BAD_TOKENIZE_REPLY",
                f"AR replica {ar_id} returned {len(counts)} token counts for {len(rows)} rows",
            )
        for name, count in zip(("prompt", "negative_prompt"), counts, strict=False):
            if reply.max_tokens and count > reply.max_tokens:
                too_long = invalid_argument(
                    name, f"{count} tokens; the AR model takes at most {reply.max_tokens}"
                )
                too_long.reason = "PROMPT_TOO_LONG"
                raise too_long
        self._check_ever_fits(counts)
        return counts

    def _check_ever_fits(self, counts: Sequence[int]) -> None:
        dits = [s for s in self.core.list_replicas(ReplicaRole.DIT) if s.up and not s.fenced]
        if not dits:
            raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NO_DIT_REPLICA", "no DiT replica is up")
        needed = {s.spec.replica_id: sum(self.core.pages_needed(s.spec.replica_id, counts)) for s in dits}
        if any(needed[s.spec.replica_id] <= s.spec.num_pages for s in dits):
            return
        largest = max(s.spec.num_pages for s in dits)
        never = invalid_argument(
            "prompt",
            f"the prompt rows need {min(needed.values())} KV pages; the largest DiT replica has {largest}: "
            "this request can never fit (shorten the prompt or the negative prompt)",
        )
        never.reason = "NEVER_FITS"
        raise never

    # ================================================================ placement

    async def _core_change_relay(self) -> None:
        # BrokerCore says when pages were freed or a replica registered: retry the queue then.
        while True:
            await self.core.waiters.wait_for_change()
            self._wake.set()

    async def _placement_loop(self) -> None:
        while True:
            try:
                self._place_queued()
            except Exception:  # noqa: BLE001 - one bad placement must not stop every later one
                log.exception("placement_failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PLACEMENT_POLL_SECONDS)

    def _place_queued(self) -> None:
        """Reserve tickets for the queue's head while they fit; stop at the first that does not."""
        while self._queue:
            job = self._queue[0]
            if job.record.state.terminal or job.placed.done():
                self._queue.popleft()
                continue
            try:
                ticket = self._try_place(job)
            except _RequestEnded as ended:
                self._queue.popleft()
                job.placed.set_exception(ended)
                continue
            if ticket is None:
                return  # FIFO: nobody overtakes the head
            self._queue.popleft()
            # Set together, with no await between: whoever ends the job sees the ticket to end.
            job.ticket_id = ticket.ticket_id
            job.placed.set_result(ticket)

    def _try_place(self, job: _Job) -> Ticket | None:
        if self.core.ticket_for_request(job.request_id) is not None:
            # An earlier generation with this id still drains its ticket; the core keys tickets
            # by request_id, so this one waits until that ticket is released.
            return None
        ar_id = self.core.choose_ar_replica()
        dit_id = self.core.choose_dit_replica(job.token_counts)
        if dit_id is None:
            try:
                # The DiT replicas may have changed since admission (one restarted smaller): a
                # head that can no longer fit any of them would block the whole queue.
                self._check_ever_fits(job.token_counts)
            except KvRelayServerError as err:
                if err.code is grpc.StatusCode.INVALID_ARGUMENT:
                    raise _RequestEnded(ErrorInfo(err.code.name, err.reason, err.message)) from None
        if ar_id is None or dit_id is None:
            return None
        try:
            return self.core.create_ticket(job.request_id, ar_id, dit_id, job.token_counts)
        except BrokerError as err:
            if err.code == "UNAVAILABLE":
                return None  # the replica went down between choice and reservation: next round
            # Can never run on the chosen replicas (e.g. an AR with a smaller max_tokens).
            raise _RequestEnded(ErrorInfo(err.code, err.reason, err.message)) from None

    # ================================================================= pipeline

    async def _pipeline(self, job: _Job) -> None:
        record = job.record
        with bind_request(request_id=job.request_id):
            try:
                await self._run(job)
            except _RequestEnded as ended:
                self._end(record, GenState.FAILED, ended.error)
            except asyncio.CancelledError:
                # cancel() or stop() ended the generation already; this only unwinds the calls.
                pass
            except Exception as err:  # noqa: BLE001 - report, never leave a generation hanging
                log.exception("generation_pipeline_crashed")
                self._end(record, GenState.FAILED, ErrorInfo("INTERNAL", "INTERNAL", f"broker error: {err}"))
            finally:
                self._jobs.pop(job.request_id, None)
                if job.ticket_id:
                    self._end_ticket(job)
                self._wake.set()

    async def _run(self, job: _Job) -> None:
        record = job.record
        remaining = job.remaining(self._clock())
        try:
            ticket = await asyncio.wait_for(asyncio.shield(job.placed), remaining)
        except TimeoutError:
            raise _RequestEnded(
                ErrorInfo("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "deadline exceeded while queued")
            ) from None
        placed_at = self._clock()
        timings = {"queue": placed_at - job.enqueued}
        with bind_request(ticket_id=ticket.ticket_id):
            log.info(
                "generation_placed",
                ar_replica=ticket.ar_replica_id,
                dit_replica=ticket.dit_replica_id,
                pages=len(ticket.page_ids),
                queue_ms=round(timings["queue"] * 1000, 3),
            )
            self._advance(record, GenState.PREFILLING, ticket_id=ticket.ticket_id, timings=timings)
            await self._run_stages(job, ticket, placed_at, timings)

    async def _run_stages(
        self, job: _Job, ticket: Ticket, placed_at: float, timings: dict[str, float]
    ) -> None:
        """Prefill and Denoise at once; the first failure of either ends the request."""
        record = job.record
        params = record.params
        ar = self.core.get_replica(ticket.ar_replica_id).spec
        dit = self.core.get_replica(ticket.dit_replica_id).spec
        now = self._clock()
        remaining = job.remaining(now)
        metadata = (("request_id", job.request_id), ("ticket_id", ticket.ticket_id))
        # Planned once, here: both replicas get the ticket, its rows, writes and destinations with
        # the call, so neither asks the broker for them nor runs the planner again.
        try:
            plan = plan_to_proto(self.core.plan_for(ticket.ticket_id))
        except BrokerError as err:
            # Ended since it was placed (cancelled, its DiT restarted): nothing was sent yet.
            raise _RequestEnded(ErrorInfo(err.code, err.reason, err.message)) from None
        deadline_time = None
        if remaining is not None:
            deadline_time = timestamp_pb2.Timestamp()
            deadline_time.FromNanoseconds(int((time.time() + remaining) * 1e9))
        prefill_call = ar_pb2_grpc.ArServiceStub(self._channel(ar.endpoint)).Prefill(
            ar_pb2.PrefillRequest(
                ticket_id=ticket.ticket_id,
                request_id=job.request_id,
                rows=list(params.rows),
                seed=params.seed,
                plan=plan,
                deadline_time=deadline_time,
            ),
            timeout=self.prefill_timeout if remaining is None else max(0.0, remaining),
            metadata=metadata,
        )
        denoise_call = dit_pb2_grpc.DitServiceStub(self._channel(dit.endpoint)).Denoise(
            dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id,
                request_id=job.request_id,
                width=params.width,
                height=params.height,
                num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale,
                seed=params.seed,
                plan=plan,
                deadline_time=deadline_time,
            ),
            timeout=self.denoise_timeout if remaining is None else max(0.0, remaining),
            metadata=metadata,
        )
        prefill = asyncio.create_task(self._prefill(prefill_call, ar.replica_id), name="prefill")
        denoise = asyncio.create_task(
            self._denoise(job, denoise_call, dit.replica_id, placed_at, timings), name="denoise"
        )
        watch = asyncio.create_task(self._watch_transfer(job, ticket.ticket_id), name="watch-ticket")
        stages_done = False
        try:
            pending: set[asyncio.Task[Any]] = {prefill, denoise}
            while pending:
                # Once the image is here every write was verified, so a Prefill reply that is
                # still missing only carries timings: wait for it a while, not for its deadline.
                grace = PREFILL_REPLY_GRACE_SECONDS if denoise.done() else None
                done, pending = await asyncio.wait(
                    pending, timeout=grace, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    log.warning("prefill_reply_late", ar_replica=ar.replica_id, waited_s=grace)
                    break
                if denoise in done and prefill in pending:
                    await self._prefer_writer_failure(denoise, prefill)
                for task in done:
                    task.result()  # the first failure ends the request; `finally` stops the other
            stages_done = True
        except _RequestEnded as ended:
            self._end(record, GenState.FAILED, ended.error)
            raise
        finally:
            if not stages_done:
                # End the ticket before cancelling the stage calls, so that its outcome is the
                # request's and not a stage's echo of the cancellation (the DiT releases on cancel).
                self._end_ticket(job)
            for task in (prefill, denoise, watch):
                task.cancel()
            # Cancelling the tasks cancels their RPCs: the AR shields its writes and reports,
            # the DiT stops within a step and releases the ticket.
            prefill_call.cancel()
            denoise_call.cancel()
            await asyncio.gather(prefill, denoise, watch, return_exceptions=True)
        image: ImageResult = denoise.result()
        if not prefill.cancelled() and prefill.exception() is None:
            reply: ar_pb2.PrefillResponse = prefill.result()
            timings["prefill"] = reply.prefill_seconds
            timings["transfer"] = reply.transfer_seconds
        timings["total"] = self._clock() - record.created_mono
        self._end(record, GenState.SUCCEEDED, image=image, timings=timings)

    async def _prefer_writer_failure(self, denoise: asyncio.Task[Any], prefill: asyncio.Task[Any]) -> None:
        """When the DiT gives up on a write that failed, the AR usually fails in the same moment
        (its replica died mid-transfer): name that cause (e.g. UNAVAILABLE) rather than its
        symptom at the receiver (TRANSFER_FAILED)."""
        err = denoise.exception()
        if not isinstance(err, _RequestEnded) or err.error.reason != "TRANSFER_FAILED":
            return
        await asyncio.wait({prefill}, timeout=WRITER_FAILURE_GRACE_SECONDS)
        if prefill.done() and not prefill.cancelled() and isinstance(prefill.exception(), _RequestEnded):
            prefill.result()

    async def _prefill(self, call: Any, replica_id: str) -> ar_pb2.PrefillResponse:
        try:
            reply: ar_pb2.PrefillResponse = await call
        except grpc.aio.AioRpcError as err:
            raise _RequestEnded(_stage_error(err, "Prefill", "AR", replica_id)) from None
        return reply

    async def _denoise(
        self, job: _Job, call: Any, replica_id: str, placed_at: float, timings: dict[str, float]
    ) -> ImageResult:
        record = job.record
        total = record.params.num_inference_steps
        try:
            async for event in call:
                phase = event.phase
                if phase == dit_pb2.DENOISE_PHASE_LOADING:
                    # Admitted by the DiT (a slot is free): the wait for it is queueing, not handoff.
                    admitted_at = self._clock()
                    timings["queue"] = timings.get("queue", 0.0) + (admitted_at - placed_at)
                    placed_at = admitted_at
                elif phase == dit_pb2.DENOISE_PHASE_LOADED:
                    # KV handoff: from the DiT's admission until every row is verified on every
                    # rank, seen from here (the wait for a DiT slot counts as queue above).
                    # (At least the DiT's own load time: the two clocks see the phase edges
                    # a message apart.)
                    timings["handoff"] = max(self._clock() - placed_at, event.load_seconds)
                    timings["load"] = event.load_seconds
                    # The DiT marked the ticket CONSUMING itself (StartConsuming) before this event.
                    # Loaded implies armed and written: a client always sees TRANSFERRING first,
                    # even when the ticket watch has not reported it yet.
                    self._advance(record, GenState.TRANSFERRING)
                    self._advance(record, GenState.DENOISING, step=0, timings=timings)
                elif phase == dit_pb2.DENOISE_PHASE_STEP:
                    self._advance(record, GenState.DENOISING, step=min(event.step, total))
                elif phase == dit_pb2.DENOISE_PHASE_DECODED:
                    timings["denoise"] = event.denoise_seconds
                    timings["decode"] = event.decode_seconds
                    if not event.image.png:
                        raise _RequestEnded(
                            ErrorInfo("INTERNAL", "NO_IMAGE", f"DiT replica {replica_id} decoded no image")
                        )
                    return ImageResult(
                        png=event.image.png,
                        width=event.image.width or record.params.width,
                        height=event.image.height or record.params.height,
                        seed=record.params.seed,
                    )
        except grpc.aio.AioRpcError as err:
            raise _RequestEnded(_stage_error(err, "Denoise", "DiT", replica_id)) from None
        raise _RequestEnded(
            ErrorInfo(
                "UNAVAILABLE",
                "DENOISE_ENDED_EARLY",
                f"DiT replica {replica_id} ended Denoise without an image",
            )
        )

    async def _watch_transfer(self, job: _Job, ticket_id: str) -> None:
        """TRANSFERRING once the AR armed the ticket (WRITING): the KV is on its way."""
        async for ticket in self.core.waiters.watch_ticket(ticket_id):
            if ticket.state is not TicketState.RESERVED:
                if ticket.state is TicketState.WRITING or ticket.armed:
                    self._advance(job.record, GenState.TRANSFERRING)
                return

    # ================================================================= endings

    def _advance(self, record: GenerationRecord, state: GenState, **changes: Any) -> None:
        """Move forward only: a late TRANSFERRING never overwrites DENOISING."""
        if record.state.terminal or state < record.state:
            return
        if state == record.state and state is not GenState.DENOISING:
            return
        self.store.update(record, state, **changes)

    def _end(
        self,
        record: GenerationRecord,
        state: GenState,
        error: ErrorInfo | None = None,
        *,
        image: ImageResult | None = None,
        timings: dict[str, float] | None = None,
        counted: bool = True,
        persist: bool = True,
    ) -> None:
        if record.state.terminal:
            return
        if timings is None and state is not GenState.SUCCEEDED:
            timings = {"total": self._clock() - record.created_mono}
        self.store.update(record, state, error=error, image=image, timings=timings)
        snap = record.snapshot()
        if counted:
            # Generations rejected at admission were never accepted: not counted, not kept.
            self.metrics.finished(snap)
        if counted and persist:
            self.store.persist(record)
        log.info(
            "generation_finished",
            request_id=record.request_id,
            state=state.name,
            code=error.code if error else "OK",
            reason=error.reason if error else "",
            total_ms=round(snap.timings.get("total", 0.0) * 1000, 3),
        )
        job = self._jobs.get(record.request_id)
        if job is not None and not job.placed.done():
            # Out of the queue now, not when it reaches the head: the bound counts waiting ones.
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
        if job is not None and job.task is not None and state is not GenState.SUCCEEDED:
            current = asyncio.current_task()
            if job.task is not current:
                job.task.cancel()
        self._wake.set()

    def _end_ticket(self, job: _Job) -> None:
        """Tell the core the request is over (once). A no-op for a ticket the DiT already released."""
        if job.ticket_ended:
            return
        job.ticket_ended = True
        state = job.record.state
        if state is GenState.SUCCEEDED:
            return  # the DiT released it OK after decoding
        error = job.record.error
        if state is GenState.CANCELLED:
            outcome = TicketOutcome.CANCELLED
        elif error is not None and error.code == "DEADLINE_EXCEEDED":
            outcome = TicketOutcome.TIMED_OUT
        else:
            outcome = TicketOutcome.FAILED
        reason = error.reason if error is not None else state.name
        try:
            ticket = self.core.cancel_ticket(job.ticket_id, outcome, reason)
        except BrokerError as err:
            log.warning("ticket_end_failed", ticket_id=job.ticket_id, code=err.code, reason=err.reason)
            return
        log.info("ticket_end_requested", ticket_id=job.ticket_id, ticket_state=ticket.state.value)

    # ================================================================= channels

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = make_channel(endpoint, self._channel_security)
            self._channels[endpoint] = channel
        return channel


def _stage_error(err: grpc.aio.AioRpcError, rpc: str, role: str, replica_id: str) -> ErrorInfo:
    code, reason, message = reason_of(err)
    if code == "UNAVAILABLE" and reason == "UNAVAILABLE":
        reason = "REPLICA_UNAVAILABLE"
    elif code == "DEADLINE_EXCEEDED" and reason == "DEADLINE_EXCEEDED":
        reason = "DEADLINE_EXCEEDED"
    elif code == "CANCELLED" and reason == "CANCELLED":
        # The stage cancelled its side without us asking: its process is going away.
        code, reason = "UNAVAILABLE", "REPLICA_UNAVAILABLE"
    return ErrorInfo(code, reason, f"{rpc} on {role} replica {replica_id}: {message}")
