"""The stage pipeline of one generation: wait for its ticket, then AR Prefill and DiT Denoise.

Owns what happens between placement and the image: both stage calls sent at once with the
broker's plan (`ArService.Prefill`, `DitService.Denoise`, over gRPC, with the client's deadline),
the mapping of their replies, events and errors to the generation's states (PREFILLING,
TRANSFERRING, DENOISING k/n, SUCCEEDED or FAILED), and ending the ticket when the request ends
before the DiT released it. Must never touch pages or tickets except through BrokerCore, never
queue or place (admission.py, placement.py), and never block the event loop: AR and DiT are
remote, reached at their registered endpoints. A request that ends early ends its ticket with
`BrokerCore.cancel_ticket`, which rolls back a ticket nothing was written to and drains an armed
one: the request is over for the client at once, the pages come back only when no write can
land any more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from kvrelay.broker.admission import GenerationJob, GenerationReporter, note_connection_failure
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import ErrorInfo, GenState, ImageResult, RequestEnded
from kvrelay.broker.journal import JournalWriteError
from kvrelay.broker.registry import ReplicaSpec
from kvrelay.broker.service import plan_to_proto
from kvrelay.broker.stalls import STALL_SECONDS, LoopStalls
from kvrelay.broker.tickets import BrokerError, Ticket, TicketOutcome, TicketState
from kvrelay.errors import reason_of
from kvrelay.logging import bind_request, get_logger
from kvrelay.security import ChannelCache
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, dit_pb2, dit_pb2_grpc

log = get_logger(__name__)

# How long a finished image waits for the AR's Prefill reply (its timings) before it is served.
PREFILL_REPLY_GRACE_SECONDS = 10.0
# How long a TRANSFER_FAILED or TICKET_ENDED from the DiT waits for the AR's own error, which
# names the cause.
WRITER_FAILURE_GRACE_SECONDS = 1.0
# DiT failures that are usually the echo of the AR's: a failed write, or the ticket the AR rolled
# back (CancelTicket before its PREFILL_FAILED reply) ending under the waiting DiT.
_ECHOES_OF_THE_WRITER = frozenset({"TRANSFER_FAILED", "TICKET_ENDED"})
# A request that ended so says its AR could not get the KV to its DiT (placement avoids the pair).
_LINK_FAILURES = frozenset({"TRANSFER_TIMEOUT", "TRANSFER_FAILED"})
# ... unless it failed this close to the client's deadline (the DiT ends its load wait 0.25 s
# before it): then the client's deadline cut the transfer short, which says nothing of the link.
# Found black-box: a public client sending requests with 0.3 s deadlines marked every pair it
# was placed on suspect (TRANSFER_TIMEOUT after "waited 0.00s"), so placement stopped avoiding a
# really broken pair (all suspect looks like none) and skewed load for every other client.
# The same holds for the DiT stage's own timeout (request_timeout_seconds), which bounds a
# Denoise call when the client gave no deadline. Found black-box: streams without a deadline
# queued at a busy DiT past that timeout; the DiT answered TRANSFER_TIMEOUT ("waited 0.00s", the
# writes done), and the broker marked the pair suspect and ran each of them again.
LINK_DEADLINE_SLACK_SECONDS = 1.0
# A failed Prefill that ends nothing once the DiT has verified every row of the ticket (READY or
# CONSUMING; `_writer_lost_after_load` says why the KV is then whole): the AR stopped answering
# or lost a rank (REPLICA_UNAVAILABLE, REPLICA_FAILED), or a rank of it raised or its answer was
# lost (WRITE_FAILED) after every write it made was final.
LOST_AFTER_LOAD_REASONS = frozenset({"REPLICA_UNAVAILABLE", "REPLICA_FAILED", "WRITE_FAILED"})


class StagePipeline:
    """Runs the pipeline of each admitted generation (`run`, one task per generation)."""

    def __init__(
        self,
        core: BrokerCore,
        channels: ChannelCache,
        reporter: GenerationReporter,
        *,
        prefill_timeout: float,
        denoise_timeout: float,
        clock: Callable[[], float],
        write_token: Callable[[str, str], str] = lambda _dit, _ar: "",
        stalls: LoopStalls | None = None,
    ) -> None:
        self.core = core
        # When the broker's own loop did not run (its ticking task is the orchestrator's).
        self.stalls = stalls if stalls is not None else LoopStalls(clock)
        # (DiT replica id, AR replica id) -> the AR's PutKv credential at that DiT (bound
        # replica tokens, Credentials.write_token; "" otherwise).
        self.write_token = write_token
        self.channels = channels
        self.reporter = reporter
        # Each stage call's gRPC timeout when the client gave no deadline.
        self.prefill_timeout = prefill_timeout
        self.denoise_timeout = denoise_timeout
        self._clock = clock

    async def run(self, job: GenerationJob) -> None:
        """The generation from QUEUED to its end; never raises (but CancelledError).

        One attempt at a time: an attempt whose replica or transfer failed has ended its ticket
        and unwound its stage calls before the generation is queued again (`may_retry`)."""
        record = job.record
        with bind_request(request_id=job.request_id):
            try:
                while True:
                    try:
                        await self._run(job)
                        return
                    except RequestEnded as ended:
                        if not record.state.terminal and self.reporter.may_retry(job, ended):
                            self.end_ticket(job, ended.error)  # done already when the stages ran
                            self.reporter.retry(job, ended)
                            continue
                        self.reporter.end(record, GenState.FAILED, self.reporter.final_error(job, ended))
                        return
            except asyncio.CancelledError:
                # cancel() or stop() ended the generation already; this only unwinds the calls.
                pass
            except Exception as err:  # noqa: BLE001 - report, never leave a generation hanging
                log.exception("generation_pipeline_crashed")
                self.reporter.end(record, GenState.FAILED, ErrorInfo("INTERNAL", "INTERNAL", f"broker error: {err}"))
            finally:
                if job.ticket_id:
                    self.end_ticket(job)

    async def _run(self, job: GenerationJob) -> None:
        record = job.record
        remaining = job.remaining(self._clock())
        try:
            ticket = await asyncio.wait_for(asyncio.shield(job.placed), remaining)
        except TimeoutError:
            raise RequestEnded(
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
            self.reporter.advance(record, GenState.PREFILLING, ticket_id=ticket.ticket_id, timings=timings)
            await self._run_stages(job, ticket, placed_at, timings)

    async def _run_stages(
        self, job: GenerationJob, ticket: Ticket, placed_at: float, timings: dict[str, float]
    ) -> None:
        """Prefill and Denoise at once; the first failure of either ends the request."""
        record = job.record
        params = record.params
        ar = self.core.get_replica(ticket.ar_replica_id).spec
        dit = self.core.get_replica(ticket.dit_replica_id).spec
        now = self._clock()
        remaining = job.remaining(now)
        job.stage_deadline = now + self.denoise_timeout if remaining is None else None
        metadata = (("request_id", job.request_id), ("ticket_id", ticket.ticket_id))
        # Planned once, here: both replicas get the ticket, its rows, writes and destinations with
        # the call, so neither asks the broker for them nor runs the planner again.
        try:
            plan = plan_to_proto(self.core.plan_for(ticket.ticket_id))
        except BrokerError as err:
            # Ended since it was placed (cancelled, its DiT restarted or forgotten): nothing was
            # sent yet.
            raise_if_interrupted(job)
            raise RequestEnded(ErrorInfo(err.code, err.reason, err.message)) from None
        # Everything the plan shows (the ticket, its pages and sequence number, the DiT's regions)
        # must be on disk before a replica hears of it: a broker restarted without it would hand
        # the pages and the number out again. The plan is taken first and the wait covers every
        # commit queued by then, so no commit made during the wait can reach the plan undurable.
        try:
            await self.core.journal.durable()
        except JournalWriteError as err:
            raise RequestEnded(ErrorInfo("UNAVAILABLE", "JOURNAL_FAILED", str(err))) from None
        try:
            self.core.plan_for(ticket.ticket_id)  # still live after the wait (no await from here on)
        except BrokerError as err:
            raise_if_interrupted(job)
            raise RequestEnded(ErrorInfo(err.code, err.reason, err.message)) from None
        deadline_time = None
        if remaining is not None:
            deadline_time = timestamp_pb2.Timestamp()
            deadline_time.FromNanoseconds(int((time.time() + remaining) * 1e9))
        prefill_call = ar_pb2_grpc.ArServiceStub(self.channels.get(ar.endpoint, ar.replica_id)).Prefill(
            ar_pb2.PrefillRequest(
                ticket_id=ticket.ticket_id,
                request_id=job.request_id,
                rows=list(params.rows),
                seed=params.seed,
                plan=plan,
                deadline_time=deadline_time,
                write_token=self.write_token(dit.replica_id, ar.replica_id),
            ),
            timeout=self.prefill_timeout if remaining is None else max(0.0, remaining),
            metadata=metadata,
        )
        denoise_call = dit_pb2_grpc.DitServiceStub(self.channels.get(dit.endpoint, dit.replica_id)).Denoise(
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
        prefill = asyncio.create_task(self._prefill(prefill_call, ar), name="prefill")
        denoise = asyncio.create_task(
            self._denoise(job, denoise_call, dit, placed_at, timings), name="denoise"
        )
        watch = asyncio.create_task(self._watch_transfer(job, ticket.ticket_id), name="watch-ticket")
        stages_done = False
        # The error that ended this attempt when the generation will run again (not its end).
        attempt_error: ErrorInfo | None = None
        interrupt: asyncio.Future[Any] = job.interrupt
        try:
            pending: set[asyncio.Future[Any]] = {prefill, denoise}
            while pending:
                # Once the image is here every write was verified, so a Prefill reply that is
                # still missing only carries timings: wait for it a while, not for its deadline.
                grace = PREFILL_REPLY_GRACE_SECONDS if denoise.done() else None
                # A replica of this attempt forgotten by force ends it, unless the image is here.
                watched = pending if denoise.done() else pending | {interrupt}
                done, _ = await asyncio.wait(watched, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    log.warning("prefill_reply_late", ar_replica=ar.replica_id, waited_s=grace)
                    break
                pending -= done
                lost = None
                if prefill in done:
                    # The image is here (this round or an earlier one), or every row is verified
                    # at the DiT: the AR has nothing more to give (its reply only carries
                    # timings). Its loss ends neither the denoise nor the attempt.
                    lost = self._reply_lost_after_image(prefill, denoise)
                    if lost is None and denoise not in done:
                        lost = self._writer_lost_after_load(prefill, ticket.ticket_id)
                if lost is not None:
                    log.warning("prefill_reply_lost", ar_replica=ar.replica_id, message=lost.message)
                    done.discard(prefill)
                # The first failure ends the request; `finally` stops the other stage.
                await raise_first_failure(done, prefill, denoise)
                if interrupt in done and not denoise.done():
                    raise_if_interrupted(job)
            stages_done = True
        except RequestEnded as ended:
            if self.reporter.may_retry(job, ended):
                attempt_error = ended.error
            else:
                self.reporter.end(record, GenState.FAILED, self.reporter.final_error(job, ended))
            raise
        finally:
            if not stages_done:
                # End the ticket before cancelling the stage calls, so that its outcome is the
                # request's and not a stage's echo of the cancellation (the DiT releases on cancel).
                self.end_ticket(job, attempt_error)
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
        self.reporter.end(record, GenState.SUCCEEDED, image=image, timings=timings)

    @staticmethod
    def _reply_lost_after_image(prefill: asyncio.Task[Any], denoise: asyncio.Task[Any]) -> ErrorInfo | None:
        """The error of a `prefill` that failed after the denoise returned the image (every row was
        verified before it: the reply only carries timings); None otherwise. Found black-box: an
        AR SIGSTOPped after its writes, then killed, FAILED a generation REPLICA_UNAVAILABLE whose
        DiT had decoded and released its ticket (no longer READY or CONSUMING: the check below)."""
        if not denoise.done() or denoise.cancelled() or denoise.exception() is not None:
            return None
        err = None if prefill.cancelled() else prefill.exception()
        return err.error if isinstance(err, RequestEnded) else None

    def _writer_lost_after_load(self, prefill: asyncio.Task[Any], ticket_id: str) -> ErrorInfo | None:
        """The error of a `prefill` that failed because its AR stopped answering (REPLICA_UNAVAILABLE),
        said a rank of it died (REPLICA_FAILED) or that a rank raised or its answer was lost
        (WRITE_FAILED) after the DiT verified every row of the ticket (READY or CONSUMING), so that
        nothing the denoise needs was lost with it; None otherwise.

        Why the KV is then complete and correct whatever the AR says: a load of (row, dst_rank)
        is accepted only when every write into it has a final OK report (TicketRecord.report_load:
        PENDING, IN_DOUBT, FAILED, NOT_STARTED or WRITER_GONE refuse it) and, with checksums on
        (the default for Mooncake TCP and the fallback), the DiT's checksum of the destination
        bytes equals the one the writer reported. Final OK means the transport call returned:
        nothing more of this ticket lands (its pages are its own: no other ticket's write targets
        them), and an IN_DOUBT the AR settles after a rank raised cannot reopen a write already
        final (report_write keeps the final word). With `verify_checksums: false` "loaded" is the
        writers' final OK alone, exactly what every successful generation then rests on. So the
        AR failing so afterwards says nothing about the bytes the denoise reads."""
        err = None if prefill.cancelled() else prefill.exception()
        if not isinstance(err, RequestEnded) or err.error.reason not in LOST_AFTER_LOAD_REASONS:
            return None
        try:
            state = self.core.get_ticket(ticket_id).state
        except BrokerError:
            return None
        return err.error if state in (TicketState.READY, TicketState.CONSUMING) else None

    async def _prefill(self, call: Any, spec: ReplicaSpec) -> ar_pb2.PrefillResponse:
        started = self._clock()
        try:
            reply: ar_pb2.PrefillResponse = await call
        except grpc.aio.AioRpcError as err:
            note_connection_failure(self.core, self.channels, spec, err)
            stall = self.stalls.longest_since(started)
            raise RequestEnded(
                stage_error(err, "Prefill", "AR", spec.replica_id, stall), replica_id=spec.replica_id, replica_role="AR"
            ) from None
        return reply

    async def _denoise(
        self, job: GenerationJob, call: Any, spec: ReplicaSpec, placed_at: float, timings: dict[str, float]
    ) -> ImageResult:
        replica_id = spec.replica_id
        record = job.record
        total = record.params.num_inference_steps
        started = self._clock()
        advance = self.reporter.advance
        try:
            async for event in call:
                phase = event.phase
                if phase == dit_pb2.DENOISE_PHASE_LOADING:
                    # Admitted by the DiT (a slot is free): the wait for it is queueing, not handoff.
                    admitted_at = self._clock()
                    timings["queue"] = timings.get("queue", 0.0) + (admitted_at - placed_at)
                    placed_at = admitted_at
                elif phase == dit_pb2.DENOISE_PHASE_LOADED:
                    # KV handoff: from the DiT's admission (or the placement, if later) until every
                    # row is verified on every rank and the ticket CONSUMING, seen from here: the
                    # part of the handoff on the request's path (the wait for a DiT slot counts as
                    # queue above). The DiT's load may have run, whole or in part, while the call
                    # was queued there (look-ahead), so `load` is its own duration and may exceed
                    # the handoff.
                    timings["handoff"] = max(0.0, self._clock() - placed_at)
                    timings["load"] = event.load_seconds
                    # The DiT marked the ticket CONSUMING itself (StartConsuming) before this event.
                    # Loaded implies armed and written: a client always sees TRANSFERRING first,
                    # even when the ticket watch has not reported it yet.
                    advance(record, GenState.TRANSFERRING)
                    advance(record, GenState.DENOISING, step=0, timings=timings)
                elif phase == dit_pb2.DENOISE_PHASE_STEP:
                    advance(record, GenState.DENOISING, step=min(event.step, total))
                elif phase == dit_pb2.DENOISE_PHASE_DECODED:
                    timings["denoise"] = event.denoise_seconds
                    timings["decode"] = event.decode_seconds
                    if not event.image.png:
                        raise RequestEnded(
                            ErrorInfo("INTERNAL", "NO_IMAGE", f"DiT replica {replica_id} decoded no image")
                        )
                    return ImageResult(
                        png=event.image.png,
                        width=event.image.width or record.params.width,
                        height=event.image.height or record.params.height,
                        seed=record.params.seed,
                    )
        except grpc.aio.AioRpcError as err:
            note_connection_failure(self.core, self.channels, spec, err)
            stall = self.stalls.longest_since(started)
            raise RequestEnded(
                stage_error(err, "Denoise", "DiT", replica_id, stall), replica_id=replica_id, replica_role="DIT"
            ) from None
        raise RequestEnded(
            ErrorInfo(
                "UNAVAILABLE",
                "DENOISE_ENDED_EARLY",
                f"DiT replica {replica_id} ended Denoise without an image",
            )
        )

    async def _watch_transfer(self, job: GenerationJob, ticket_id: str) -> None:
        """TRANSFERRING once the AR armed the ticket (WRITING): the KV is on its way."""
        async for ticket in self.core.waiters.watch_ticket(ticket_id):
            if ticket.state is not TicketState.RESERVED:
                if ticket.state is TicketState.WRITING or ticket.armed:
                    self.reporter.advance(job.record, GenState.TRANSFERRING)
                return

    def end_ticket(self, job: GenerationJob, attempt_error: ErrorInfo | None = None) -> None:
        """Tell the core the request is over (once). A no-op for a ticket the DiT already released.

        `attempt_error`: the error that ended this attempt of a generation that runs again (a
        replica or transfer failed). Its ticket ends exactly as the generation's would have with that error
        (rolled back, or draining until no write can land); a generation that ended meanwhile
        (cancelled) ends its ticket as itself."""
        if job.ticket_ended:
            return
        job.ticket_ended = True
        state = job.record.state
        error = job.record.error
        if attempt_error is not None and not state.terminal:
            state, error = GenState.FAILED, attempt_error
        self._note_link(job, state, error.reason if error is not None else "")
        if state is GenState.SUCCEEDED:
            return  # the DiT released it OK after decoding
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


    def _note_link(self, job: GenerationJob, state: GenState, reason: str) -> None:
        """What this request proved about its AR -> DiT transfer link, for placement."""
        if state is not GenState.SUCCEEDED and reason not in _LINK_FAILURES:
            return
        now = self._clock()
        for deadline, remaining in (("client", job.remaining(now)), ("stage", job.stage_remaining(now))):
            if state is not GenState.SUCCEEDED and remaining is not None and remaining <= LINK_DEADLINE_SLACK_SECONDS:
                log.info("transfer_link_unjudged", reason=reason, deadline=deadline, deadline_left_s=round(remaining, 3))
                return
        try:
            ticket = self.core.get_ticket(job.ticket_id)
        except BrokerError:
            return  # released and forgotten: nothing to learn
        if state is GenState.SUCCEEDED:
            self.core.note_transfer_ok(ticket.ar_replica_id, ticket.dit_replica_id)
        else:
            self.core.note_transfer_failed(ticket.ar_replica_id, ticket.dit_replica_id)


def raise_if_interrupted(job: GenerationJob) -> None:
    """Raise what ended the job's running attempt from outside its stage calls (a replica of it
    forgotten by force: Orchestrator.replica_forgotten), if anything did."""
    if job.interrupt.done():
        raise job.interrupt.result()


def stage_error(
    err: grpc.aio.AioRpcError, rpc: str, role: str, replica_id: str, own_stall_s: float = 0.0
) -> ErrorInfo:
    """A stage call's gRPC error as the generation's error, naming the RPC and the replica.
    `own_stall_s`: the longest the broker itself did not run while the call was open
    (broker/stalls.py); a connection lost then may be the broker's doing, not the replica's."""
    code, reason, message = reason_of(err)
    if code == "UNAVAILABLE" and reason == "UNAVAILABLE":
        reason = "REPLICA_UNAVAILABLE"
    elif code == "DEADLINE_EXCEEDED" and reason == "DEADLINE_EXCEEDED":
        reason = "DEADLINE_EXCEEDED"
    elif code == "CANCELLED" and reason == "CANCELLED":
        # The stage cancelled its side without us asking: its process is going away.
        code, reason = "UNAVAILABLE", "REPLICA_UNAVAILABLE"
    if reason == "REPLICA_UNAVAILABLE":
        # gRPC's own words ("recvmsg:Connection reset by peer") do not say what happened or what to do.
        if own_stall_s >= STALL_SECONDS:
            message = (f"{message} (this broker itself did not run for {own_stall_s:.0f} s while the call was open: "
                       "stopped (SIGSTOP) or starved of CPU, so the connection may have timed out for that and "
                       f"the {role} replica be fine; the generation can be retried)")
        else:
            message = (f"{message} (the {role} replica stopped answering: it exited, restarted or is unreachable; "
                       "the generation can be retried, other replicas take it)")
    return ErrorInfo(code, reason, f"{rpc} on {role} replica {replica_id}: {message}")


async def prefer_writer_failure(denoise: asyncio.Task[Any], prefill: asyncio.Task[Any]) -> None:
    """When the DiT gives up on a write that failed, or on a ticket that ended while it waited,
    the AR usually fails in the same moment (its replica died mid-transfer; its prefill failed
    and it rolled the ticket back first): name that cause (e.g. UNAVAILABLE, PREFILL_FAILED)
    rather than its symptom at the receiver (TRANSFER_FAILED, TICKET_ENDED)."""
    err = denoise.exception()
    if not isinstance(err, RequestEnded) or err.error.reason not in _ECHOES_OF_THE_WRITER:
        return
    await asyncio.wait({prefill}, timeout=WRITER_FAILURE_GRACE_SECONDS)
    if prefill.done() and not prefill.cancelled() and isinstance(prefill.exception(), RequestEnded):
        prefill.result()


async def raise_first_failure(
    done: set[asyncio.Future[Any]], prefill: asyncio.Task[Any], denoise: asyncio.Task[Any]
) -> None:
    """Raise the failure of the stage calls that finished this round, if any: the AR's cause
    before the DiT's echo of it, also when both finished in the same round (before, the set's
    order picked, and an AR that rolled its ticket back just before its PREFILL_FAILED reply
    could end the request TICKET_ENDED: tests/vllm/test_vllm_up.py failed so in CI)."""
    if denoise in done:
        await prefer_writer_failure(denoise, prefill)
    for task in (denoise, prefill):
        if task in done:
            task.result()
