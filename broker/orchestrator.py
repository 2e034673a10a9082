"""The orchestrator: drives every generation from QUEUED to SUCCEEDED, FAILED or CANCELLED.

Wires the parts of the broker's request path on one event loop: admission and the FIFO queue
(admission.py), placement of the queue's head (placement.py, through BrokerCore, which owns
pages and tickets), one stage pipeline per placed generation (pipeline.py: AR Prefill and DiT
Denoise), the broker's channels to its replicas (`ChannelCache`), the generation store
(generations.py), the journal's compaction (compaction.py) and the generation metrics
(metrics.py). It owns the public operations (submit, cancel, expire, get, list), the start and
stop of the whole, a generation's progress and end (the record's state, its metric, its journal
entry, and its departure from the queue), and whether a failed attempt runs again (its replica
or its KV transfer failed). Must never touch pages or tickets except through BrokerCore, never
block the event loop, and never import torch or a model service.
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
    REPLICA_RETRY_REASONS,
    RETRY_REASONS,
    TRANSFER_RETRY_REASONS,
    ErrorInfo,
    GenerationPage,
    GenerationParams,
    GenerationRecord,
    GenerationSnapshot,
    GenerationStore,
    GenState,
    ImageResult,
    ListKey,
    RequestEnded,
)
from kvrelay.broker.metrics import GenerationMetrics, JournalCollector
from kvrelay.broker.pipeline import LINK_DEADLINE_SLACK_SECONDS, StagePipeline
from kvrelay.broker.placement import Pair, place, serving_replicas
from kvrelay.broker.registry import ReplicaRole
from kvrelay.broker.stalls import LoopStalls
from kvrelay.broker.tickets import Ticket, TicketOutcome
from kvrelay.config import KvRelayConfig
from kvrelay.errors import failed_precondition
from kvrelay.logging import get_logger
from kvrelay.security import (
    BROKER_CALLER_ID,
    CallerClass,
    ChannelCache,
    CredentialRotation,
    Credentials,
    make_channel,
)
from kvrelay.server_tls import ServerCertificates, renewing_dial

log = get_logger(__name__)

# Seconds a stopping broker gives pipelines to end their tickets before it gives up on them.
STOP_GRACE_SECONDS = 5.0
# A generation is run again only while its client's deadline is further away than this: a retry
# that cannot finish would only take pages and a place at the queue's head.
RETRY_MIN_DEADLINE_SECONDS = 1.0
# How many transfer failures of one generation an AR/DiT pair may have before that generation
# never uses the pair again: a transient failure (a network blip, a timed-out engine, a write
# caught by its checksum) gets a second try on the same pair when no other pair is up, a pair
# that keeps failing does not get a third.
MAX_TRANSFER_FAILURES_PER_PAIR = 2
# `_retry_refusal`'s answer for an error that is neither a replica's nor a transfer's failure
# (PREFILL_FAILED, DENOISE_FAILED, ...: the same input fails the same way): the final error then
# says nothing of retries.
NOT_RETRYABLE = "not retryable"


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
        credential_rotation: CredentialRotation | None = None,
        server_certificates: ServerCertificates | None = None,
    ) -> None:
        self.core = core
        self.cfg = cfg
        self._clock = clock
        # The broker dials AR and DiT replicas as a replica-class caller named "broker" (bound
        # replica tokens: with each replica's own call token, Credentials.broker_channel).
        # Across a reload of the broker's credentials (`kvrelay rotate-secrets`), each replica is
        # called with, and each AR handed a write token of, what that replica holds (the previous
        # credentials until it authenticated with the new ones: CredentialRotation).
        creds = credential_rotation.current if credential_rotation is not None else credentials or Credentials()
        rotation = credential_rotation or CredentialRotation(creds)
        # With TLS, each channel presents the certificate the broker serves (`server_certificates`),
        # dialled again once `kvrelay rotate-secrets` swapped in a new pair: a replica that then
        # trusts only the new CA is still reached. A call in flight on the channel replaced runs
        # on until its own deadline (the longest a stage call takes).
        longest_call_s = max(cfg.ar_stage.request_timeout_seconds, cfg.dit_stage.request_timeout_seconds)
        dial = make_channel if server_certificates is None else renewing_dial(server_certificates.client_pair(),
                                                                               longest_call_s)  # fmt: skip
        self.channels = ChannelCache(creds.channel(CallerClass.REPLICA, BROKER_CALLER_ID), rotation.broker_channel,
                                     dial)  # fmt: skip
        self.store = GenerationStore(
            result_ttl_seconds=cfg.broker.result_ttl_seconds,
            max_results=cfg.broker.max_results,
            clock=clock,
            journal=core.journal,
        )
        self.compactor = JournalCompactor(core.journal, self.store)
        self.queue = GenerationQueue(cfg.broker.max_queue, cfg.broker.queue_share_per_client)
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
            write_token=rotation.write_token,
            stalls=LoopStalls(clock),
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
            asyncio.create_task(self.pipeline.stalls.run(), name="orchestrator-loop-stalls"),
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
        self, request_id: str, params: GenerationParams, *, seed_given: bool, timeout: float | None,
        client: str = "",
    ) -> GenerationRecord:
        """Admit a generation (or attach to the one with this request_id): `Admission.submit`."""
        return await self.admission.submit(request_id, params, seed_given=seed_given, timeout=timeout,
                                           client=client)  # fmt: skip

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
        if record is None or record.state.terminal or not self._current_ticket(ticket):
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
        A generation that already ended keeps its end; one with a retry left
        (`broker.max_replica_retries`) runs again on another replica instead; a ticket of an
        earlier attempt of a generation (ended already) changes nothing."""
        for ticket in tickets:
            record = self.store.find(ticket.request_id)
            job = self.queue.job(ticket.request_id)
            if record is None or record.state.terminal or job is None or not self._current_ticket(ticket):
                continue
            ended = RequestEnded(
                ErrorInfo(
                    "UNAVAILABLE", "REPLICA_FORGOTTEN",
                    f"replica {replica_id} was forgotten by an operator (kvrelay forget --force) while ticket "
                    f"{ticket.ticket_id} of this generation needed it",
                ),
                replica_id=replica_id,
                replica_role=ReplicaRole.AR.value if ticket.ar_replica_id == replica_id else ReplicaRole.DIT.value,
            )  # fmt: skip
            if self.may_retry(job, ended) and not job.interrupt.done():
                # Its pipeline ends the attempt (its ticket is over already) and queues it again.
                job.interrupt.set_result(ended)
                continue
            self.end(record, GenState.FAILED, self.final_error(job, ended))

    def _current_ticket(self, ticket: Ticket) -> bool:
        """Whether `ticket` is the one its generation's running attempt holds (not an earlier
        attempt's, which ended already, nor an earlier generation's with the same request_id)."""
        job = self.queue.job(ticket.request_id)
        return job is None or job.ticket_id == ticket.ticket_id

    # ============================================= retries after a replica or transfer failure

    def may_retry(self, job: GenerationJob, ended: RequestEnded) -> bool:
        """Whether the attempt that `ended` ends is followed by another: on another replica after
        a replica failure, on a fresh ticket (another pair if one is up) after a transfer failure."""
        return self._retry_refusal(job, ended) is None

    def _retry_refusal(self, job: GenerationJob, ended: RequestEnded) -> str | None:
        """Why the attempt that `ended` ends is its generation's last (None: it runs again)."""
        limit = self.cfg.broker.max_replica_retries
        reason = ended.error.reason
        pair = job.placed_pair()
        if reason in REPLICA_RETRY_REASONS:
            if not ended.replica_id:
                return NOT_RETRYABLE
        elif reason not in TRANSFER_RETRY_REASONS or pair is None:
            return NOT_RETRYABLE
        if job.attempt > limit:
            return f"broker.max_replica_retries is {limit}"
        if self.admission.stopping:
            return "the broker is stopping"
        if job.record.state.terminal:
            return "the generation ended"
        now = self._clock()
        remaining = job.remaining(now)
        if remaining is not None and remaining <= RETRY_MIN_DEADLINE_SECONDS:
            return f"the client's deadline is {max(0.0, remaining):.2f} s away"
        stage_left = job.stage_remaining(now)
        if reason in TRANSFER_RETRY_REASONS and stage_left is not None and stage_left <= LINK_DEADLINE_SLACK_SECONDS:
            # The transfer ran out of its Denoise call's own timeout (no client deadline): the DiT
            # is too slow for that timeout, not the link broken (StagePipeline._note_link).
            return ("its Denoise call reached the DiT stage's request_timeout_seconds "
                    f"({self.cfg.dit_stage.request_timeout_seconds:g} s)")
        if reason in TRANSFER_RETRY_REASONS and pair is not None:
            links = {**job.failed_links, pair: [*job.failed_links.get(pair, []), reason]}
            return self._no_pair_left(job.failed_replicas, links)
        failed = {**job.failed_replicas, ended.replica_id: ended.replica_role}
        for role in sorted(set(failed.values())):
            if not serving_replicas(self.core, ReplicaRole(role), failed):
                return f"no other {role_name(role)} replica is up"
        return None

    def _no_pair_left(self, failed_replicas: dict[str, str], links: dict[Pair, list[str]]) -> str | None:
        """Why no AR/DiT pair is left for a generation whose transfers failed on `links` (None:
        one is up that neither failed it as a replica nor failed its transfer twice)."""
        ars = serving_replicas(self.core, ReplicaRole.AR, failed_replicas)
        dits = serving_replicas(self.core, ReplicaRole.DIT, failed_replicas)
        for role, up in ((ReplicaRole.AR, ars), (ReplicaRole.DIT, dits)):
            if not up:
                other = " other" if role.value in failed_replicas.values() else ""
                return f"no{other} {role_name(role.value)} replica is up"
        spent = {p for p, reasons in links.items() if len(reasons) >= MAX_TRANSFER_FAILURES_PER_PAIR}
        if all((ar, dit) in spent for ar in ars for dit in dits):
            names = ", ".join(f"{ar} -> {dit}" for ar, dit in sorted(spent))
            return (f"the transfer failed {MAX_TRANSFER_FAILURES_PER_PAIR} times on {names} "
                    "and no other AR/DiT pair is up")  # fmt: skip
        return None

    def final_error(self, job: GenerationJob, ended: RequestEnded) -> ErrorInfo:
        """The error the generation ends with: `ended`'s, saying how often it was tried when it
        could have been retried (or was)."""
        error = ended.error
        if ended.final:
            return error
        why = self._retry_refusal(job, ended)
        if self.cfg.broker.max_replica_retries == 0 or (job.attempt == 1 and error.reason not in RETRY_REASONS):
            return error
        tried = tried_times(job.attempt)
        if why is not None and why != NOT_RETRYABLE:
            tried = f"{tried}, not retried: {why}"
        return ErrorInfo(error.code, error.reason, f"{error.message} ({tried}{earlier_failures(job)})")

    def retry(self, job: GenerationJob, ended: RequestEnded) -> None:
        """Queue the generation again, at the head: after a replica failure for a replica other
        than those that failed it, after a transfer failure preferably on another AR/DiT pair.
        Its ended attempt's stage calls are unwound and its ticket ended (rolled back, released,
        or draining until no write can land): the next attempt gets pages of its own."""
        reason = ended.error.reason
        ended_ticket = job.ticket_id
        pair = job.placed_pair()
        failed = ""
        if reason in TRANSFER_RETRY_REASONS and pair is not None:
            job.failed_links.setdefault(pair, []).append(reason)
        else:
            failed = ended.replica_id
            job.failed_replicas[failed] = ended.replica_role
        job.ended_ticket_ids.append(ended_ticket)
        job.last_error = ended.error
        job.attempt += 1
        job.enqueued = self._clock()
        self.metrics.retried(reason)
        ar_replica, dit_replica = pair if pair is not None else ("", "")
        log.warning(
            "generation_retried",
            request_id=job.request_id,
            failed_replica=failed,
            role=ended.replica_role if failed else "",
            ar_replica=ar_replica,
            dit_replica=dit_replica,
            reason=reason,
            attempt=job.attempt,
            ended_ticket_id=ended_ticket,
            message=ended.error.message,
        )
        # Clients see the new attempt at once (state and step stay where the furthest one got).
        self.store.update(job.record, job.record.state, attempt=job.attempt)
        self.queue.requeue(job)

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

    def generation_state(self, request_id: str) -> str | None:
        """The state of the generation `request_id` names (live, or finished and still held), or
        None: BrokerService's CreateTicket refuses such an id (its tickets are made under it)."""
        record = self.store.find(request_id)
        return None if record is None else record.state.name

    def list_generations(
        self, states: Sequence[GenState] = (), limit: int | None = None
    ) -> list[GenerationSnapshot]:
        return self.store.list_generations(states, limit)

    def list_page(
        self, states: Sequence[GenState], page_size: int, after: ListKey | None, max_scan: int
    ) -> GenerationPage:
        """One page of ListGenerations (GenerationStore.list_page): records, read at once."""
        return self.store.list_page(states, page_size, after, max_scan)

    def queue_depth(self) -> int:
        return self.queue.depth()

    # ================================================================= wiring

    def _place(self, job: GenerationJob) -> Ticket | None:
        params = job.record.params
        last = job.last_error
        if job.failed_replicas and last is not None:
            # A retried generation never goes back to a replica that failed it: with no other
            # one of that role up any more, it fails rather than hold the queue's head.
            for role in sorted(set(job.failed_replicas.values())):
                if not serving_replicas(self.core, ReplicaRole(role), job.failed_replicas):
                    raise RequestEnded(ErrorInfo(
                        last.code, last.reason,
                        f"{last.message} ({tried_times(job.attempt - 1)}, not retried: no "
                        f"other {role_name(role)} replica is up{earlier_failures(job)})",
                    ), final=True)  # fmt: skip
        if job.failed_links and last is not None:
            # Nor to a pair whose transfer failed it twice; with no other pair up, it fails.
            why = self._no_pair_left(job.failed_replicas, job.failed_links)
            if why is not None:
                raise RequestEnded(ErrorInfo(
                    last.code, last.reason,
                    f"{last.message} ({tried_times(job.attempt - 1)}, not retried: {why}{earlier_failures(job)})",
                ), final=True)  # fmt: skip
        replaces = job.ended_ticket_ids[-1] if job.ended_ticket_ids else ""
        spent = {p for p, reasons in job.failed_links.items() if len(reasons) >= MAX_TRANSFER_FAILURES_PER_PAIR}
        return place(
            self.core, job.request_id, job.token_counts, params.width, params.height,
            exclude=job.failed_replicas, avoid_pairs=set(job.failed_links), exclude_pairs=spent, replaces=replaces,
        )  # fmt: skip

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
        """Move forward only: a late TRANSFERRING never overwrites DENOISING, and an attempt run
        again (a replica or transfer failed) shows progress only past where the earlier one got
        (state and step never go back for a client); its ticket is the generation's from its
        placement."""
        if record.state.terminal:
            return
        step = changes.get("step")
        behind = state < record.state or (
            state == record.state and (state is not GenState.DENOISING or (step is not None and step <= record.step))
        )
        if behind:
            ticket_id = changes.get("ticket_id")
            if ticket_id is not None and ticket_id != record.ticket_id:
                self.store.update(record, record.state, ticket_id=ticket_id)
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


def earlier_failures(job: GenerationJob) -> str:
    """Where the generation's earlier attempts failed, as its final error says it
    ("; earlier attempts failed on dit-0; earlier transfers failed: ar-0 -> dit-0 TRANSFER_TIMEOUT")."""
    said = ""
    if job.failed_replicas:
        said += f"; earlier attempts failed on {', '.join(sorted(job.failed_replicas))}"
    if job.failed_links:
        links = ", ".join(f"{ar} -> {dit} {' '.join(reasons)}" for (ar, dit), reasons in sorted(job.failed_links.items()))
        said += f"; earlier transfers failed: {links}"
    return said


def tried_times(attempts: int) -> str:
    """How often a generation was tried, as its final error says it ("tried 2 times")."""
    return f"tried {attempts} time{'s' if attempts > 1 else ''}"


def role_name(role: str) -> str:
    """A replica role as the docs and messages write it ("AR", "DiT")."""
    return "DiT" if role == ReplicaRole.DIT.value else role
