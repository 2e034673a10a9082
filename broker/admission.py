"""Admission and the queue: how a generation gets in, and waits its turn for a ticket.

Owns `Admission.submit` (attach a duplicate `request_id` to its generation, bound the queue at
`broker.max_queue` and each client's share of it at `broker.max_queue_per_client`,
`ArService.Tokenize` the rows on an AR replica, reject a prompt that is too long or can never fit,
and map what interrupts admission to the generation's end) and the
`GenerationQueue`: admitted generations in arrival order, of which only the head is ever placed,
so a large request is never starved by smaller ones behind it. Must never choose replicas or
reserve pages (placement.py does, through BrokerCore) and never run a stage (pipeline.py): a
generation leaves the queue holding a ticket, or ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import (
    CLIENT_DEADLINE_SLACK_S,
    ErrorInfo,
    GenerationParams,
    GenerationRecord,
    GenerationStore,
    GenState,
    ImageResult,
    RequestEnded,
)
from kvrelay.broker.placement import check_ever_fits, check_image_fits, choose_ar_replica
from kvrelay.broker.registry import ReplicaSpec
from kvrelay.broker.tickets import BrokerError, Ticket
from kvrelay.errors import KvRelayServerError, invalid_argument, reason_of
from kvrelay.logging import bind_request, get_logger
from kvrelay.security import ChannelCache, key_name
from kvrelay.v1 import ar_pb2, ar_pb2_grpc

log = get_logger(__name__)

# Tokenize is a table lookup on the AR: it answers in milliseconds or the replica is in trouble.
TOKENIZE_TIMEOUT_SECONDS = 10.0
# How often the queue re-checks placement without a wake-up (leases expire silently).
PLACEMENT_POLL_SECONDS = 0.5


class GenerationReporter(Protocol):
    """What admission and the pipelines tell the Orchestrator, which owns the generation's
    record, its metrics and its place in the queue."""

    def advance(self, record: GenerationRecord, state: GenState, **changes: Any) -> None:
        """Move forward only (a late TRANSFERRING never overwrites DENOISING)."""

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
        """The generation's terminal state (once; later calls are no-ops)."""

    def may_retry(self, job: GenerationJob, ended: RequestEnded) -> bool:
        """Whether the attempt that `ended` ends is followed by another (pure: decides, changes
        nothing)."""

    def retry(self, job: GenerationJob, ended: RequestEnded) -> None:
        """Queue the generation again for another attempt (its ended attempt is unwound and its
        ticket ended)."""

    def final_error(self, job: GenerationJob, ended: RequestEnded) -> ErrorInfo:
        """The error the generation ends with when `ended` ends it (says how often it was tried)."""


def note_connection_failure(
    core: BrokerCore, channels: ChannelCache, spec: ReplicaSpec, err: grpc.aio.AioRpcError
) -> None:
    """A call to replica `spec` failed: if it never reached the replica (UNAVAILABLE without a
    kvrelay reason: connection refused or reset, no route), drop the channel and keep the replica
    out of placement until its next heartbeat (`BrokerCore.mark_unreachable`). An error the
    replica itself answered with (it carries a reason) proves it reachable."""
    code, reason, message = reason_of(err)
    if code != "UNAVAILABLE" or reason != "UNAVAILABLE":
        return
    channels.forget(spec.endpoint)
    core.mark_unreachable(spec.replica_id, spec.incarnation_id, message)


@dataclass(eq=False)
class GenerationJob:
    """One admitted generation's place in the queue and its pipeline task."""

    record: GenerationRecord
    token_counts: tuple[int, ...]
    deadline: float | None  # monotonic; None = no client deadline
    enqueued: float  # monotonic
    # Whose share of the queue it counts against (kvrelay.security.Caller.key: a verified
    # identity, else "peer:HOST"); "" = nobody's.
    client: str = ""
    placed: asyncio.Future[Ticket] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ticket_id: str = ""
    ticket_ended: bool = False
    task: asyncio.Task[None] | None = None
    # Retries (Orchestrator.retry): the attempt running or waiting now (1 = the first), the
    # replicas that failed the earlier ones (never placed on again), the AR/DiT pairs whose
    # transfer failed them (avoided while another pair is up, never used after two failures),
    # and the tickets those attempts ended (each drains or is released on its own).
    attempt: int = 1
    failed_replicas: dict[str, str] = field(default_factory=dict)  # replica id -> role ("AR", "DIT")
    # (AR replica id, DiT replica id) -> the reason of each transfer failure on that pair.
    failed_links: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    ended_ticket_ids: list[str] = field(default_factory=list)
    last_error: ErrorInfo | None = None  # what ended the latest earlier attempt
    # Monotonic (the broker's clock): when the running attempt's Denoise call times out, set only
    # when the client gave no deadline (the call then runs under the DiT stage's own timeout).
    stage_deadline: float | None = None
    # Set (with the RequestEnded that ends the attempt) when a replica of the running attempt is
    # forgotten by force: the pipeline ends the attempt as if its stage call had failed so.
    interrupt: asyncio.Future[RequestEnded] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now

    def stage_remaining(self, now: float) -> float | None:
        """What is left of the running attempt's Denoise call when the client gave no deadline (it
        runs under the DiT stage's request_timeout_seconds: StagePipeline); None otherwise."""
        if self.deadline is not None or self.stage_deadline is None:
            return None
        return self.stage_deadline - now

    def placed_pair(self) -> tuple[str, str] | None:
        """(AR replica id, DiT replica id) of the running attempt's ticket; None before placement."""
        if not self.placed.done() or self.placed.cancelled() or self.placed.exception() is not None:
            return None
        ticket = self.placed.result()
        return (ticket.ar_replica_id, ticket.dit_replica_id)


class GenerationQueue:
    """Admitted generations: those waiting for a ticket (FIFO) and those whose pipeline runs.

    Single-threaded: everything runs on the broker's event loop.
    """

    def __init__(self, max_queue: int, max_per_client: int | None = None) -> None:
        self.max_queue = max_queue
        # Generations one client may hold (waiting or being admitted); None: max_queue.
        self.max_per_client = max_queue if max_per_client is None else max_per_client
        # Waiting for a ticket, in arrival order: only the head is ever placed.
        self._waiting: deque[GenerationJob] = deque()
        # Every admitted generation whose pipeline has not finished, by request_id.
        self._jobs: dict[str, GenerationJob] = {}
        # request_id -> admission in progress (Tokenize), so a concurrent duplicate waits for it.
        self._admitting: dict[str, asyncio.Future[None]] = {}
        # request_id -> the client whose admission is in progress (counts against its share).
        self._admitting_client: dict[str, str] = {}
        self._wake = asyncio.Event()

    def depth(self) -> int:
        """Generations waiting for a ticket (kvrelay_generations_queued)."""
        return len(self._waiting)

    def full(self) -> bool:
        """The bound counts those waiting and those still being admitted."""
        return len(self._waiting) + len(self._admitting) >= self.max_queue

    def held_by(self, client: str) -> int:
        """Generations `client` holds in the queue: waiting, or being admitted. Counted when asked
        (once per Generate; at most max_queue of each), so nothing can drift from the queue itself."""
        waiting = sum(1 for job in self._waiting if job.client == client)
        return waiting + sum(1 for c in self._admitting_client.values() if c == client)

    def client_full(self, client: str) -> bool:
        """`client` holds its whole share (max_per_client); "" is nobody and never is."""
        return bool(client) and self.held_by(client) >= self.max_per_client

    def running_tasks(self) -> list[asyncio.Task[None]]:
        return [job.task for job in self._jobs.values() if job.task is not None]

    def wake(self) -> None:
        """Retry placement now (pages were freed, a replica registered, a generation ended)."""
        self._wake.set()

    # ------------------------------------------------------------ admissions in progress

    async def wait_for_admission(self, request_id: str) -> None:
        """Return once no admission of this request_id is in progress."""
        while True:
            pending = self._admitting.get(request_id)
            if pending is None:
                return
            # A duplicate of a request still being admitted: its fate is this one's.
            await asyncio.shield(pending)

    def begin_admission(self, request_id: str, client: str = "") -> None:
        self._admitting[request_id] = asyncio.get_running_loop().create_future()
        self._admitting_client[request_id] = client

    def finish_admission(self, request_id: str) -> None:
        self._admitting_client.pop(request_id, None)
        self._admitting.pop(request_id).set_result(None)

    # --------------------------------------------------------------------- the jobs

    def enqueue(self, job: GenerationJob) -> None:
        self._jobs[job.request_id] = job
        self._waiting.append(job)

    def job(self, request_id: str) -> GenerationJob | None:
        """The admitted generation's job while its pipeline runs."""
        return self._jobs.get(request_id)

    def requeue(self, job: GenerationJob) -> None:
        """Its attempt ended (its ticket too) and it runs again: back at the head of the queue,
        where it already was once (nobody who arrived later overtakes it), with no ticket."""
        assert job.placed.done() and job.ticket_ended, f"generation {job.request_id}: requeued holding a ticket"
        assert self._jobs.get(job.request_id) is job, f"generation {job.request_id}: requeued but not admitted"
        loop = asyncio.get_running_loop()
        job.placed = loop.create_future()
        job.interrupt = loop.create_future()
        job.ticket_id = ""
        job.ticket_ended = False
        self._waiting.appendleft(job)
        self._wake.set()

    def ended(self, request_id: str, *, stop_pipeline: bool) -> None:
        """Its generation ended: out of the queue now, not when it reaches the head (the bound
        counts waiting ones), and its pipeline cancelled unless it is the one ending it."""
        job = self._jobs.get(request_id)
        if job is not None and not job.placed.done():
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
        if job is not None and job.task is not None and stop_pipeline:
            current = asyncio.current_task()
            if job.task is not current:
                job.task.cancel()
        self._wake.set()

    def finished(self, job: GenerationJob) -> None:
        """Its pipeline returned: it holds nothing in the queue any more. (Only its own entry: a
        later generation under the same id, admitted once this one's record was forgotten while
        its pipeline still wound down, keeps its own.)"""
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        self._wake.set()

    # -------------------------------------------------------------------- placement

    async def run_placement(self, place: Callable[[GenerationJob], Ticket | None]) -> None:
        """Place the head whenever woken, and every PLACEMENT_POLL_SECONDS. Runs until cancelled."""
        while True:
            try:
                self.place_waiting(place)
            except Exception:  # noqa: BLE001 - one bad placement must not stop every later one
                log.exception("placement_failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PLACEMENT_POLL_SECONDS)

    def place_waiting(self, place: Callable[[GenerationJob], Ticket | None]) -> None:
        """Reserve tickets for the queue's head while they fit; stop at the first that does not."""
        while self._waiting:
            job = self._waiting[0]
            if job.record.state.terminal or job.placed.done():
                self._waiting.popleft()
                continue
            try:
                ticket = place(job)
            except RequestEnded as ended:
                self._waiting.popleft()
                job.placed.set_exception(ended)
                continue
            if ticket is None:
                return  # FIFO: nobody overtakes the head
            self._waiting.popleft()
            # Set together, with no await between: whoever ends the job sees the ticket to end.
            job.ticket_id = ticket.ticket_id
            job.placed.set_result(ticket)


class Admission:
    """Admits generations into a GenerationQueue; `start` launches an admitted one's pipeline."""

    def __init__(
        self,
        core: BrokerCore,
        store: GenerationStore,
        queue: GenerationQueue,
        channels: ChannelCache,
        reporter: GenerationReporter,
        start: Callable[[GenerationJob], asyncio.Task[None]],
        *,
        clock: Callable[[], float],
    ) -> None:
        self.core = core
        self.store = store
        self.queue = queue
        self.channels = channels
        self.reporter = reporter
        self.start = start
        self._clock = clock
        self.stopping = False

    async def submit(
        self, request_id: str, params: GenerationParams, *, seed_given: bool, timeout: float | None,
        client: str = "",
    ) -> GenerationRecord:
        """Admit a generation (or attach to the one with this request_id) and return its record.

        Raises KvRelayServerError: ALREADY_EXISTS (same id, other parameters), RESOURCE_EXHAUSTED
        (CLIENT_QUEUE_FULL: `client` holds its share of the queue; QUEUE_FULL), INVALID_ARGUMENT
        (prompt too long, can never fit), UNAVAILABLE (no replica).
        `timeout` is the client's deadline in seconds (None = none); it covers queueing too.
        """
        if self.stopping:
            raise KvRelayServerError(
                grpc.StatusCode.UNAVAILABLE, "BROKER_SHUTTING_DOWN", "the broker is stopping"
            )
        await self.queue.wait_for_admission(request_id)
        # A ticket made by hand (BrokerService.CreateTicket) under this id while its request is
        # live: ALREADY_EXISTS REQUEST_ID_REUSED. Checked with no await before the record exists,
        # so a concurrent CreateTicket of this id either came first (refused here) or finds the
        # generation (refused there): never both.
        try:
            self.core.check_generation_id(request_id)
        except BrokerError as err:
            raise KvRelayServerError(
                grpc.StatusCode[err.code], err.reason, err.message, request_id=request_id
            ) from None
        record, created = self.store.create_or_attach(request_id, params, seed_given)
        if not created:
            return record
        # The whole queue first: a full queue is QUEUE_FULL for everyone, as before the share
        # existed (a client whose share is the whole queue sees no change).
        if self.queue.full():
            self.store.discard(record)
            raise KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
                f"the queue holds {self.queue.max_queue} generations (broker.max_queue); retry later",
            )
        if self.queue.client_full(client):
            self.store.discard(record)
            raise KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "CLIENT_QUEUE_FULL",
                f"this client ({key_name(client)}) already holds {self.queue.max_per_client} generations in the "
                "queue (broker.max_queue_per_client); retry when one of them has started or ended",
            )
        deadline = None if timeout is None else self._clock() + timeout
        end = self.reporter.end
        self.queue.begin_admission(request_id, client)
        try:
            with bind_request(request_id=request_id):
                token_counts = await self._tokenize_unless_ended(record, params, deadline)
        except KvRelayServerError as err:
            # Rejected: nothing was accepted under this id. Attached streams see the error.
            end(record, GenState.FAILED, ErrorInfo(err.code.name, err.reason, err.message), counted=False)
            self.store.discard(record)
            raise
        except asyncio.CancelledError:
            if self.stopping:
                aborted = ErrorInfo("ABORTED", "ADMISSION_ABORTED", "admission was interrupted")
                end(record, GenState.FAILED, aborted, counted=False)
                self.store.discard(record)
            elif deadline is not None and self._clock() >= deadline - CLIENT_DEADLINE_SLACK_S:
                end(
                    record,
                    GenState.FAILED,
                    ErrorInfo("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "the client's deadline passed"),
                )
            else:
                # The client went away (or cancelled its call) while it was being tokenized: a
                # cancel like one at any later stage, counted and kept.
                end(
                    record,
                    GenState.CANCELLED,
                    ErrorInfo("CANCELLED", "CLIENT_DISCONNECTED", "the client cancelled or dropped the call"),
                )
            raise
        except BaseException:
            aborted = ErrorInfo("ABORTED", "ADMISSION_ABORTED", "admission was interrupted")
            end(record, GenState.FAILED, aborted, counted=False)
            self.store.discard(record)
            raise
        finally:
            self.queue.finish_admission(request_id)
        if token_counts is None or record.state.terminal:
            # Ended while it was being tokenized: cancelled by its client (keep that answer), or
            # failed by stop() (then nothing is accepted any more).
            if self.stopping:
                self.store.discard(record)
                raise KvRelayServerError(
                    grpc.StatusCode.UNAVAILABLE, "BROKER_SHUTTING_DOWN", "the broker is stopping"
                )
            return record
        job = GenerationJob(record=record, token_counts=token_counts, deadline=deadline, enqueued=self._clock(),
                            client=client)  # fmt: skip
        self.queue.enqueue(job)
        job.task = self.start(job)
        self.queue.wake()
        log.info(
            "generation_queued", request_id=request_id, rows=len(token_counts), tokens=list(token_counts)
        )
        return record

    async def _tokenize_unless_ended(
        self, record: GenerationRecord, params: GenerationParams, deadline: float | None
    ) -> tuple[int, ...] | None:
        """`_tokenize`, or None as soon as the generation ends meanwhile (CancelGeneration): its
        end is the answer, whatever the AR says later. Found black-box: with the AR SIGSTOPped, a
        generation cancelled during its Tokenize kept its Generate stream waiting for Tokenize's
        bound, then failed it AR_UNAVAILABLE and dropped the generation its cancel had ended."""
        tokenize = asyncio.ensure_future(self._tokenize(params, deadline))
        ended = asyncio.ensure_future(record.done.wait())
        try:
            await asyncio.wait({tokenize, ended}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            tokenize.cancel()
            raise
        finally:
            ended.cancel()
        if record.state.terminal:
            if not tokenize.done():
                tokenize.cancel()
            elif not tokenize.cancelled():
                tokenize.exception()  # retrieved: an AR error after the end is not logged as lost
            return None
        return tokenize.result()

    async def _tokenize(self, params: GenerationParams, deadline: float | None) -> tuple[int, ...]:
        """Tokenize the rows and check they fit the AR and some DiT: token counts per row."""
        ar_id = choose_ar_replica(self.core)
        if ar_id is None:
            raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NO_AR_REPLICA", "no AR replica is up and reachable")
        spec = self.core.get_replica(ar_id).spec
        endpoint = spec.endpoint
        timeout = TOKENIZE_TIMEOUT_SECONDS
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - self._clock()))
        rows = params.rows
        check_rows_worth_tokenizing(rows, spec.max_tokens)
        try:
            reply = await ar_pb2_grpc.ArServiceStub(self.channels.get(endpoint, spec.replica_id)).Tokenize(
                ar_pb2.TokenizeRequest(texts=list(rows)), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            note_connection_failure(self.core, self.channels, spec, err)
            code, reason, message = reason_of(err)
            if code == "UNAVAILABLE" and reason == "UNAVAILABLE":
                reason = "AR_UNAVAILABLE"
            elif code == "DEADLINE_EXCEEDED" and (deadline is None or self._clock() < deadline):
                # Our own bound passed, not the client's (a stopped or overloaded AR): retryable,
                # nothing accepted. DEADLINE_EXCEEDED would tell the client its deadline passed.
                code, reason = "UNAVAILABLE", "AR_UNAVAILABLE"
                message = f"no answer within {timeout:g} s"
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
        check_rows_fit_the_ar(counts, reply.max_tokens)
        check_ever_fits(self.core, counts)
        check_image_fits(self.core, params.width, params.height)
        return counts


# Bytes of prompt the AR is asked to tokenize per token it takes (English runs ~4 bytes a token,
# CJK ~3; only long runs of whitespace or junk compress further). Tokenizing costs the AR seconds
# per MiB (the demo's tokenizer: 1-4 s, and 1 MiB of random letters is 3 tokens to it, so such a
# prompt was accepted): found black-box, 12 such requests at once made a 0.2 s generation take
# 21-31 s and others fail AR_UNAVAILABLE. A row longer than max_tokens times this is refused here.
MAX_PROMPT_BYTES_PER_TOKEN = 64


def check_rows_worth_tokenizing(rows: Sequence[str], max_tokens: int) -> None:
    """INVALID_ARGUMENT (PROMPT_TOO_LONG) naming a row of more than `max_tokens` x
    MAX_PROMPT_BYTES_PER_TOKEN bytes, before the AR spends time tokenizing it (0: no bound)."""
    limit = max_tokens * MAX_PROMPT_BYTES_PER_TOKEN
    for name, text in zip(("prompt", "negative_prompt"), rows, strict=False):
        size = len(text.encode())
        if max_tokens and size > limit:
            too_long = invalid_argument(
                name,
                f"{size} bytes; the AR model takes at most {max_tokens} tokens, so at most {limit} bytes "
                f"({MAX_PROMPT_BYTES_PER_TOKEN} per token) are tokenized",
            )
            too_long.reason = "PROMPT_TOO_LONG"
            raise too_long


def check_rows_fit_the_ar(counts: Sequence[int], max_tokens: int) -> None:
    """INVALID_ARGUMENT (PROMPT_TOO_LONG) naming the row over the AR model's `max_tokens`."""
    for name, count in zip(("prompt", "negative_prompt"), counts, strict=False):
        if max_tokens and count > max_tokens:
            too_long = invalid_argument(
                name,
                f"{count} tokens; the AR model takes at most {max_tokens}: shorten it, or serve an AR with a "
                "longer context (a vLLM AR: `model.vllm_args.max_model_len`, docs/ar.md)",
            )
            too_long.reason = "PROMPT_TOO_LONG"
            raise too_long
