"""The orchestrator: drives every generation from QUEUED to SUCCEEDED, FAILED or CANCELLED.

Wires the parts of the broker's request path on one event loop: admission and the FIFO queue
(admission.py), placement of the queue's head (placement.py, through BrokerCore, which owns
pages and tickets), one stage pipeline per placed generation (pipeline.py: AR Prefill and DiT
Denoise), the broker's channels to its replicas (`ChannelCache`), the generation store
(generations.py), the journal's compaction (compaction.py) and the generation metrics
(metrics.py). It owns the public operations (submit, cancel, expire, get, list), the start and
stop of the whole, and a generation's
progress and end: the record's state, its metric, its journal entry, and its departure from the
queue. Must never touch pages or tickets except through BrokerCore, never block the event loop,
and never import torch or a model service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kvrelay.broker.admission import Admission, GenerationJob, GenerationQueue
from kvrelay.broker.compaction import JournalCompactor
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import (
    ErrorInfo,
    GenerationParams,
    GenerationRecord,
    GenerationSnapshot,
    GenerationStore,
    GenState,
    ImageResult,
)
from kvrelay.broker.metrics import GenerationMetrics, JournalCollector
from kvrelay.broker.pipeline import StagePipeline
from kvrelay.broker.placement import place
from kvrelay.broker.tickets import Ticket, TicketOutcome
from kvrelay.config import KvRelayConfig
from kvrelay.errors import failed_precondition
from kvrelay.logging import get_logger
from kvrelay.security import BROKER_CALLER_ID, CallerClass, ChannelCache, Credentials

log = get_logger(__name__)

# Seconds a stopping broker gives pipelines to end their tickets before it gives up on them.
STOP_GRACE_SECONDS = 5.0


class Orchestrator:
    """The request path of the broker process (DESIGN.md section 7).

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
        self._clock = clock
        # The broker dials AR and DiT replicas as a replica-class caller named "broker" (bound
        # replica tokens: with each replica's own call token, Credentials.broker_channel).
        creds = credentials or Credentials()
        self.channels = ChannelCache(creds.channel(CallerClass.REPLICA, BROKER_CALLER_ID), creds.broker_channel)
        self.store = GenerationStore(
            result_ttl_seconds=cfg.broker.result_ttl_seconds,
            max_results=cfg.broker.max_results,
            clock=clock,
            journal=core.journal,
        )
        self.compactor = JournalCompactor(core.journal, self.store)
        self.queue = GenerationQueue(cfg.broker.max_queue)
        registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GenerationMetrics(registry, self.queue.depth)
        registry.register(JournalCollector(self.compactor))
        self.admission = Admission(
            core, self.store, self.queue, self.channels, self, self._start_pipeline, clock=clock
        )
        self.pipeline = StagePipeline(
            core,
            self.channels,
            self,
            prefill_timeout=cfg.ar_stage.request_timeout_seconds,
            denoise_timeout=cfg.dit_stage.request_timeout_seconds,
            clock=clock,
            write_token=creds.write_token,
        )
        self._tasks: list[asyncio.Task[None]] = []
        core.on_request_cancelled = self.ticket_cancelled
        core.on_replica_forgotten = self.replica_forgotten

    # ================================================================ lifecycle

    async def start(self) -> None:
        restored = self.store.restore()
        if restored:
            log.info("generations_restored", count=restored)
        self._tasks = [
            asyncio.create_task(self.queue.run_placement(self._place), name="orchestrator-placement"),
            asyncio.create_task(self._core_change_relay(), name="orchestrator-core-changes"),
            asyncio.create_task(self.compactor.run(), name="orchestrator-journal-compaction"),
        ]

    async def stop(self, grace_s: float = STOP_GRACE_SECONDS) -> None:
        """Fail every live generation (UNAVAILABLE), end its ticket, close stage channels.
        Cancelled pipelines get `grace_s` to end (0: a fast stop, kvrelay/stopping.py)."""
        self.admission.stopping = True
        for task in self._tasks:
            task.cancel()
        for record in self.store.live():
            # Not journaled: after the restart a retry with the same request_id starts afresh
            # instead of attaching to this failure.
            self.end(
                record,
                GenState.FAILED,
                ErrorInfo("UNAVAILABLE", "BROKER_SHUTTING_DOWN", "the broker is shutting down"),
                persist=False,
            )
        pipelines = self.queue.running_tasks()
        for task in pipelines:
            task.cancel()
        waiting = [*self._tasks, *pipelines]
        if waiting:
            await asyncio.wait(waiting, timeout=grace_s)
        await self.channels.close()

    # ================================================================= the API

    async def submit(
        self, request_id: str, params: GenerationParams, *, seed_given: bool, timeout: float | None
    ) -> GenerationRecord:
        """Admit a generation (or attach to the one with this request_id): `Admission.submit`."""
        return await self.admission.submit(request_id, params, seed_given=seed_given, timeout=timeout)

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
        self.end(
            record,
            GenState.CANCELLED,
            ErrorInfo("CANCELLED", reason, message or "the generation was cancelled"),
        )
        return record.snapshot()

    def ticket_cancelled(self, ticket: Ticket) -> None:
        """An operator's `CancelTicket` ended the request that owns `ticket`: end its generation
        (CANCELLED; TIMED_OUT and FAILED outcomes end it FAILED), which cancels its stage calls.

        A generation that already ended (its image made) keeps its end. The pages are not freed
        here: the ticket rolled back, drains, or (CONSUMING) waits for the DiT to release it.
        """
        record = self.store.find(ticket.request_id)
        if record is None or record.state.terminal:
            return
        said = f": {ticket.reason}" if ticket.reason else ""
        message = f"ticket {ticket.ticket_id} was cancelled by an operator (CancelTicket){said}"
        if ticket.outcome is TicketOutcome.TIMED_OUT:
            self.end(record, GenState.FAILED, ErrorInfo("DEADLINE_EXCEEDED", "TICKET_CANCELLED", message))
        elif ticket.outcome is TicketOutcome.FAILED:
            self.end(record, GenState.FAILED, ErrorInfo("ABORTED", "TICKET_CANCELLED", message))
        else:
            self.end(record, GenState.CANCELLED, ErrorInfo("CANCELLED", "TICKET_CANCELLED", message))

    def replica_forgotten(self, replica_id: str, tickets: Sequence[Ticket]) -> None:
        """An operator forgot `replica_id` by force (`kvrelay forget --force`) and that ended these
        tickets: fail their generations now (UNAVAILABLE, REPLICA_FORGOTTEN), which cancels their
        stage calls; a call to a replica that is gone would otherwise wait out its timeout.
        A generation that already ended keeps its end."""
        for ticket in tickets:
            record = self.store.find(ticket.request_id)
            if record is None or record.state.terminal:
                continue
            self.end(record, GenState.FAILED, ErrorInfo(
                "UNAVAILABLE", "REPLICA_FORGOTTEN",
                f"replica {replica_id} was forgotten by an operator (kvrelay forget --force) while ticket "
                f"{ticket.ticket_id} of this generation needed it",
            ))  # fmt: skip

    def expire(self, request_id: str) -> None:
        """The client's deadline passed (its stream ended with it): FAILED, DEADLINE_EXCEEDED."""
        record = self.store.find(request_id)
        if record is not None and not record.state.terminal:
            self.end(
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
        return self.queue.depth()

    # ================================================================= wiring

    def _place(self, job: GenerationJob) -> Ticket | None:
        params = job.record.params
        return place(self.core, job.request_id, job.token_counts, params.width, params.height)

    def _start_pipeline(self, job: GenerationJob) -> asyncio.Task[None]:
        return asyncio.create_task(self._run_pipeline(job), name=f"generation-{job.request_id}")

    async def _run_pipeline(self, job: GenerationJob) -> None:
        try:
            await self.pipeline.run(job)
        finally:
            self.queue.finished(job)

    async def _core_change_relay(self) -> None:
        # BrokerCore says when pages were freed or a replica registered: retry the queue then.
        while True:
            await self.core.waiters.wait_for_change()
            self.queue.wake()

    # ======================================================= progress and endings

    def advance(self, record: GenerationRecord, state: GenState, **changes: Any) -> None:
        """Move forward only: a late TRANSFERRING never overwrites DENOISING."""
        if record.state.terminal or state < record.state:
            return
        if state == record.state and state is not GenState.DENOISING:
            return
        self.store.update(record, state, **changes)

    def end(
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
        """The generation's terminal state: recorded, counted (unless rejected at admission),
        journaled (unless the broker is stopping), out of the queue, its pipeline stopped."""
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
        self.queue.ended(record.request_id, stop_pipeline=state is not GenState.SUCCEEDED)
