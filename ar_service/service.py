"""ArService: the AR replica's gRPC servicer (Tokenize, Prefill) and the Prefill protocol.

Owns one request's path through the AR (docs/internals.md, "The request protocol"): validate and
tokenize the rows, check the ticket with the broker, prefill on every TP rank (tickets that wait
for the ranks meanwhile share the next prefill: ar_service/batcher.py), arm the ticket
(`BrokerService.ReserveTicket`), write on every rank, report every write (`ReportWrite`), and
answer with token counts, bytes and timings. Only the prefill is shared: arming, writes and
reports stay per ticket, one ticket's turn after another's.

Rules it keeps: nothing is armed before the input is known good and the prefill is done, so
every early failure can still roll the ticket back; once armed, the write-and-report part runs
to the end even when the RPC is cancelled (a cancelled request never interrupts a remote write)
and every write gets a final report (`NOT_STARTED` from a `finally` for any never begun). It never
runs model work on the event loop: ranks do, and blocking pipe calls go through a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvrelay.ar_service.batcher import PrefillBatcher
from kvrelay.ar_service.engine import (
    CollectFinished,
    DropTicket,
    FinishedWrites,
    PrefillDone,
    PrefillFailed,
    PrefillTicket,
    PrefillTickets,
    WriteDone,
    WriteTicket,
)
from kvrelay.ar_service.sender import (
    RETRYABLE,
    Abandon,
    Arm,
    EndWrites,
    WriteLedger,
    WriteProtocol,
    WriteReporter,
    after_arming,
    after_prefill,
    arming_mismatch,
)
from kvrelay.broker_credential import credential_refused_gauge
from kvrelay.errors import (
    KvRelayServerError,
    abort_with,
    invalid_argument,
    reason_of,
    request_budget,
    timestamp_problem,
)
from kvrelay.logging import get_logger
from kvrelay.models.tokenizer import Tokenizer
from kvrelay.transfer.convert import geometry_from_proto, region_from_proto, row_from_proto, writes_from_proto
from kvrelay.transfer.planner import PlannedWrite, plan_transfer
from kvrelay.transfer.transport import WriteOutcome, not_started_outcomes
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, broker_pb2
from kvrelay.worker import WorkerCommandError, WorkerGroup, WorkerGroupError

log = get_logger(__name__)

AR_SERVICE = ar_pb2.DESCRIPTOR.services_by_name["ArService"].full_name

# Broker calls are quick; a short per-try deadline keeps a hung broker from eating the request.
BROKER_RPC_TIMEOUT_S = 5.0
# Least time worth starting a transfer with; less than this and the writes are NOT_STARTED.
MIN_TRANSFER_S = 0.05
# How often the ranks are asked whether in-doubt transport calls have returned (only while some are).
COLLECT_INTERVAL_S = 0.1


class FailStop(Exception):
    """A broken invariant for this replica (a worker died, the broker fenced it): stop now."""


@dataclass(slots=True)
class ArMetrics:
    """Prometheus metrics of DESIGN.md section 11 that the AR owns."""

    transfer_bytes: Any
    sent_bytes: Any
    transfer_seconds: Any
    prefill_seconds: Any
    prefill_tokens: Any
    prefill_batch_tickets: Any
    engine_replacements: Any
    credential_refused: Any
    # The engine replacements each rank has reported so far (WriteDone's count is cumulative).
    _replacements_seen: dict[int, int] = field(default_factory=dict)

    @classmethod
    def create(cls, registry: Any, mooncake_ranks: int = 0) -> ArMetrics:
        """`mooncake_ranks`: the replica's rank count when it sends over Mooncake, so that each
        rank's engine-replacement count is exported (at 0) from the start: a series that first
        appears at 1 shows no increase in `increase()`/`rate()`, and the dashboard's panel would
        have nothing to query on a node that never replaced an engine."""
        from prometheus_client import Counter, Histogram

        metrics = cls(
            transfer_bytes=Counter(
                "kvrelay_transfer_bytes_total", "KV bytes written by AR ranks (OK writes)", ["transport"],
                registry=registry,
            ),
            sent_bytes=Counter(
                "kvrelay_ar_sent_bytes_total", "KV bytes of the writes AR ranks sent, by rank and outcome",
                ["rank", "transport", "outcome"], registry=registry,
            ),
            transfer_seconds=Histogram(
                "kvrelay_transfer_seconds", "Pack + write time of one ticket on the slowest AR rank", ["transport"],
                registry=registry, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            ),
            prefill_seconds=Histogram(
                "kvrelay_ar_prefill_seconds", "Time of one prefill forward on the ranks (all rows of its tickets)",
                registry=registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            ),
            prefill_tokens=Counter("kvrelay_ar_prefill_tokens_total", "Tokens prefilled", registry=registry),
            prefill_batch_tickets=Histogram(
                "kvrelay_ar_prefill_batch_tickets", "Tickets prefilled together in one forward", registry=registry,
                buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            ),
            engine_replacements=Counter(
                "kvrelay_ar_mooncake_engine_replacements_total",
                "Fresh Mooncake sending engines an AR rank started because a peer answered on a dead peer's port",
                ["rank"], registry=registry,
            ),
            credential_refused=credential_refused_gauge("ar", registry),
        )  # fmt: skip
        for rank in range(mooncake_ranks):
            metrics.engine_replacements.labels(str(rank))
        return metrics

    def record_engine_replacements(self, done: Iterable[WriteDone]) -> None:
        """Count the engine replacements the ranks report with a write (log
        `mooncake_engine_replaced` on the rank): each answer carries the rank's total so far, so
        only its increase counts, and an answer that carries less (none known) counts nothing."""
        for d in done:
            seen = self._replacements_seen.get(d.rank, 0)
            if d.engine_replacements > seen:
                self.engine_replacements.labels(str(d.rank)).inc(d.engine_replacements - seen)
                self._replacements_seen[d.rank] = d.engine_replacements

    def record_sent(self, transport: str, outcomes: Iterable[WriteOutcome]) -> None:
        """Count each write that was sent once, at the end of its request, by its source rank and
        outcome (ok / failed / in_doubt: an in-doubt write's later end is not counted again, so the
        outcomes add up to the bytes sent). NOT_STARTED writes sent nothing."""
        for o in outcomes:
            if o.status != "NOT_STARTED":
                self.sent_bytes.labels(str(o.src_rank), transport, o.status.lower()).inc(o.bytes)


@dataclass(slots=True)
class ArReplicaState:
    """What the servicer needs once the replica is up (set by main after start-up)."""

    replica_id: str
    incarnation_id: str
    group: WorkerGroup
    tokenizer: Tokenizer
    max_tokens: int
    vocab: int
    tensor_parallel_size: int
    transport: str
    transfer_timeout_s: float
    request_timeout_s: float
    # Tickets one prefill may take together (the stage's max_num_seqs when the engine can take
    # several per command, else 1) and their token cap (the oldest waiting ticket always goes).
    max_prefill_batch: int = 1
    max_prefill_batch_tokens: int = 0
    # The engine's KV blocks (of cache_block_size tokens) one request's rows may hold at once
    # (vLLM's whole cache: RankDescription.cache_blocks); 0: no such bound.
    cache_blocks: int = 0
    cache_block_size: int = 0
    # The bearer of a PutKv command, given the broker's write token: kvrelay.replica_token's
    # put_kv_bearer (shared replica token: the one this AR holds now, a reload included); the
    # ranks hold none of their own. By default the write token alone.
    put_kv_bearer: Callable[[str], str] = str


def _kv_blocks(rows: Sequence[Sequence[int]], block_size: int) -> int:
    """The engine KV blocks of `block_size` tokens that `rows` hold at once (a vLLM AR's cache)."""
    return sum(-(-len(ids) // block_size) for ids in rows)


def _blocks_of(block_size: int) -> Callable[[Any], int]:
    """The engine KV blocks a waiting ticket's rows hold at once (`_kv_blocks`)."""
    return lambda item: _kv_blocks(item.rows, block_size)


@dataclass(slots=True)
class _Job:
    task: asyncio.Task[ar_pb2.PrefillResponse]
    cancel_requested: bool = False
    armed: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class _PrefillItem:
    """A ticket waiting in the PrefillBatcher."""

    ticket_id: str
    rows: tuple[tuple[int, ...], ...]
    num_tokens: int
    job: _Job | None
    deadline: _Deadline


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """This ticket's KV is held on every rank; `seconds`: its (shared) forward's time."""

    seconds: float


@dataclass(frozen=True, slots=True)
class _PrefillFailed:
    """The ranks did not prefill this ticket; `held`: some rank may still hold KV of it."""

    message: str
    held: bool


# None: left out of the forward (cancelled or out of time while it waited).
_PrefillResult = _Prefilled | _PrefillFailed | None


def _combine(per_rank: Sequence[PrefillDone | PrefillFailed]) -> _PrefillResult:
    """One ticket's outcome from every rank's answer to a PrefillTickets."""
    failed = [r for r in per_rank if isinstance(r, PrefillFailed)]
    if failed:
        held = any(isinstance(r, PrefillDone) for r in per_rank)
        return _PrefillFailed(f"rank {failed[0].rank}: {failed[0].message}", held)
    return _Prefilled(max(r.seconds for r in per_rank if isinstance(r, PrefillDone)))


@dataclass(slots=True)
class _Deadline:
    at: float
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    def left(self) -> float:
        return self.at - self.loop.time()


def _broker_error(err: grpc.aio.AioRpcError, what: str) -> KvRelayServerError:
    """The broker's error, passed through with its code and reason."""
    code_name, reason, message = reason_of(err)
    code = err.code() or grpc.StatusCode.UNKNOWN
    if code in RETRYABLE:
        return KvRelayServerError(
            grpc.StatusCode.UNAVAILABLE, "BROKER_UNAVAILABLE", f"{what}: {code_name}: {message}"
        )
    return KvRelayServerError(code, reason, message)


class ArServicer(ar_pb2_grpc.ArServiceServicer):
    def __init__(self, broker: Any, metrics: ArMetrics, on_fail_stop: Callable[[str], None]) -> None:
        self.broker = broker  # BrokerServiceStub on the replica's channel
        self.metrics = metrics
        self.on_fail_stop = on_fail_stop
        self.ledger = WriteLedger()
        self.state: ArReplicaState | None = None
        self.reporter: WriteReporter | None = None
        self._jobs: dict[str, _Job] = {}
        # Background work that must outlive RPCs (shielded writes, late arming resolution).
        self._background: set[asyncio.Task[Any]] = set()
        # WorkerGroup serializes commands anyway; this keeps a ticket's prefill and write from
        # interleaving with another batch's across the to_thread hop (the PrefillBatcher holds it
        # from a batch's prefill to its last member's writes). Staging is per ticket (each rank's
        # StagingAllocator): a ticket with in-doubt writes keeps its region while the next one
        # packs into the space left.
        self._ranks = asyncio.Lock()
        self.prefills = PrefillBatcher(self._run_prefills, self._ranks, max_batch=1, max_tokens=0)
        self._collector: asyncio.Future[None] | None = None

    def attach(self, state: ArReplicaState) -> None:
        self.state = state
        self.prefills = PrefillBatcher(
            self._run_prefills, self._ranks, max_batch=max(1, state.max_prefill_batch),
            max_tokens=state.max_prefill_batch_tokens, discard=self._discard_prefill,
            blocks=_blocks_of(state.cache_block_size) if state.cache_blocks else None,
            max_blocks=state.cache_blocks,
        )  # fmt: skip
        self.reporter = WriteReporter(self.broker, self.ledger, state.replica_id, state.incarnation_id)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self, timeout_s: float) -> None:
        """Wait for running Prefills and background reports (a clean stop)."""
        pending = [j.task for j in self._jobs.values()] + list(self._background)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    # -- Tokenize --------------------------------------------------------------------------------

    async def Tokenize(
        self, request: ar_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> ar_pb2.TokenizeResponse:
        state = await self._ready(context)
        # Off the event loop: prompts of up to 1 MiB took seconds each, and a few api clients
        # sending them at once stalled this replica's heartbeats, Prefills and reports
        # (a 0.2 s generation took 31 s; others got AR_UNAVAILABLE).
        texts = list(request.texts)
        counts = await asyncio.to_thread(lambda: [len(state.tokenizer.encode(text)) for text in texts])
        return ar_pb2.TokenizeResponse(token_counts=counts, max_tokens=state.max_tokens)

    async def _ready(self, context: grpc.aio.ServicerContext) -> ArReplicaState:
        if self.state is None:
            await abort_with(
                context,
                KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NOT_READY", "the AR replica is starting"),
            )
        assert self.state is not None
        return self.state

    # -- Prefill ---------------------------------------------------------------------------------

    async def Prefill(
        self, request: ar_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> ar_pb2.PrefillResponse:
        state = await self._ready(context)
        deadline_time = request.deadline_time if request.HasField("deadline_time") else None
        budget = request_budget(context, state.request_timeout_s, deadline_time)
        deadline = _Deadline(asyncio.get_running_loop().time() + budget)
        job = self._jobs.get(request.ticket_id)
        if job is None:
            try:
                # Off the event loop, as Tokenize.
                token_ids = await asyncio.to_thread(self._validate, request, state)
            except KvRelayServerError as err:
                # Bad input can never succeed: roll the (unarmed) ticket back so nothing is left.
                await self._rollback_if_ours(request.ticket_id, state, "FAILED", err.reason)
                await abort_with(context, err)
            # A retry of this Prefill may have started the job while this one tokenized.
            job = self._jobs.get(request.ticket_id)
            if job is None:
                job = _Job(task=asyncio.ensure_future(self._prefill(request, token_ids, state, deadline)))
                self._jobs[request.ticket_id] = job
                job.task.add_done_callback(functools.partial(self._forget_job, request.ticket_id))
        try:
            # Shielded: a cancelled RPC must not cancel a write in progress; the job itself looks
            # at `cancel_requested` at the one point where stopping is still safe (before arming).
            return await asyncio.shield(job.task)
        except asyncio.CancelledError:
            job.cancel_requested = True
            raise
        except KvRelayServerError as err:
            await abort_with(context, err)
        except FailStop as err:
            await abort_with(
                context, KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_FAILED", str(err))
            )

    def _forget_job(self, ticket_id: str, task: asyncio.Task[Any]) -> None:
        self._jobs.pop(ticket_id, None)
        # A job whose RPC was cancelled has nobody awaiting it: log its error here instead.
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            if not isinstance(err, (KvRelayServerError, FailStop)):
                log.error("prefill_job_failed", ticket_id=ticket_id, error=repr(err))

    def _validate(self, request: ar_pb2.PrefillRequest, state: ArReplicaState) -> list[list[int]]:
        if not request.ticket_id:
            raise invalid_argument("ticket_id", "is required")
        if not request.rows:
            raise invalid_argument("rows", "at least one row (the prompt) is required")
        if request.HasField("deadline_time") and (problem := timestamp_problem(request.deadline_time)):
            raise invalid_argument("deadline_time", problem)
        token_ids = []
        for i, text in enumerate(request.rows):
            ids = state.tokenizer.encode(text)
            if not ids:
                raise invalid_argument(f"rows[{i}]", "tokenizes to no tokens")
            if len(ids) > state.max_tokens:
                raise invalid_argument(
                    f"rows[{i}]",
                    f"{len(ids)} tokens is longer than the model's max_tokens {state.max_tokens}",
                )
            if max(ids) >= state.vocab:
                raise invalid_argument(
                    f"rows[{i}]", f"token id {max(ids)} outside the model's vocabulary {state.vocab}"
                )
            token_ids.append(ids)
        if state.cache_blocks and state.cache_block_size:
            # Deterministic: PREFILL_FAILED (INTERNAL) from the engine, after the ticket's turn.
            size = state.cache_block_size
            needed = _kv_blocks(token_ids, size)
            if needed > state.cache_blocks:
                raise KvRelayServerError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "NEVER_FITS",
                    f"rows: the prompt rows ({[len(ids) for ids in token_ids]} tokens) need {needed} KV blocks "
                    f"of {size} tokens at once; the vLLM AR's whole KV cache has {state.cache_blocks}: this "
                    "request can never fit (shorten the prompt or the negative prompt, or give vLLM a larger "
                    "cache: VLLM_CPU_KVCACHE_SPACE or model.vllm_args.kv_cache_memory_bytes, docs/ar.md)",
                    field="rows",
                )
        return token_ids

    async def _get_ticket(self, ticket_id: str, deadline: _Deadline) -> broker_pb2.Ticket:
        try:
            reply = await self.broker.GetTicket(
                broker_pb2.GetTicketRequest(ticket_id=ticket_id),
                timeout=max(0.01, min(BROKER_RPC_TIMEOUT_S, deadline.left())),
            )
        except grpc.aio.AioRpcError as err:
            raise _broker_error(err, "GetTicket") from None
        ticket: broker_pb2.Ticket = reply.ticket
        return ticket

    async def _rollback_if_ours(
        self,
        ticket_id: str,
        state: ArReplicaState,
        outcome: str,
        reason: str,
        known: broker_pb2.Ticket | None = None,
    ) -> None:
        """Roll back an unarmed ticket bound to this replica (CancelTicket on a RESERVED ticket frees
        its pages at once). Best effort: the orchestrator cancels it too when the request ends.
        `known`: the ticket as the broker's plan gave it (this replica has not armed it since)."""
        if not ticket_id:
            return
        try:
            ticket = known
            if ticket is None:
                ticket = (
                    await self.broker.GetTicket(
                        broker_pb2.GetTicketRequest(ticket_id=ticket_id), timeout=BROKER_RPC_TIMEOUT_S
                    )
                ).ticket
            if ticket.ar_replica_id != state.replica_id or ticket.armed:
                return
            await self.broker.CancelTicket(
                broker_pb2.CancelTicketRequest(
                    ticket_id=ticket_id,
                    outcome=getattr(broker_pb2, f"TICKET_OUTCOME_{outcome}"),
                    reason=reason,
                ),
                timeout=BROKER_RPC_TIMEOUT_S,
            )
            log.info("ticket_rolled_back", ticket_id=ticket_id, reason=reason)
        except grpc.aio.AioRpcError as err:
            log.info(
                "ticket_rollback_skipped", ticket_id=ticket_id, code=err.code().name, details=err.details()
            )

    def _start_collector(self) -> None:
        if self._collector is None or self._collector.done():
            self._collector = self._spawn(self._collect_finished())

    async def _collect_finished(self) -> None:
        """While writes are in doubt, ask the ranks which transport calls have returned and report
        their final outcomes (the `get_finished` half of the hand-off): only then may the broker
        start the quiet period and free the pages, and the ranks reuse the staging bytes."""
        assert self.reporter is not None
        interval = COLLECT_INTERVAL_S
        while self.ledger.needs_collect():
            await asyncio.sleep(interval)
            try:
                async with self._ranks:
                    results: list[FinishedWrites] = await self._call_ranks(CollectFinished())
            except FailStop as err:
                # The ranks are gone: the broker resolves their writes when it sees it.
                log.error("collect_finished_failed", error=str(err))
                return
            except WorkerCommandError as err:
                # A rank's collect raised (the group is still usable): the writes stay in doubt
                # (pages held); keep asking, less often, rather than leave them held for good.
                log.error("collect_finished_failed", error=str(err).splitlines()[0])
                interval = min(interval * 2, 5.0)
                continue
            interval = COLLECT_INTERVAL_S
            for result in results:
                for ticket_id, outcomes in result.finished:
                    log.info(
                        "in_doubt_writes_returned", ticket_id=ticket_id, rank=result.rank,
                        statuses=[o.status for o in outcomes],
                    )  # fmt: skip
                    await self.reporter.report_all(ticket_id, outcomes)

    async def _call_ranks(self, command: Any) -> list[Any]:
        assert self.state is not None
        try:
            return await asyncio.to_thread(self.state.group.call_all, command)
        except WorkerCommandError:
            raise
        except WorkerGroupError as err:
            # A rank died or hung: its collectives can never complete and its writes are unknown.
            self.on_fail_stop(f"worker group failed: {err}")
            raise FailStop(str(err)) from err

    async def _prefill(
        self,
        request: ar_pb2.PrefillRequest,
        token_ids: list[list[int]],
        state: ArReplicaState,
        deadline: _Deadline,
    ) -> ar_pb2.PrefillResponse:
        ticket_id = request.ticket_id
        job = self._jobs.get(ticket_id)
        planned = request.HasField("plan")
        # With the broker's plan in the request, nothing needs asking: it planned once for both.
        ticket = request.plan.ticket if planned else await self._get_ticket(ticket_id, deadline)
        if ticket.ticket_id != ticket_id:
            raise invalid_argument("plan", f"the plan is for ticket {ticket.ticket_id}, not {ticket_id}")
        known = ticket if planned else None
        if ticket.ar_replica_id != state.replica_id:
            raise KvRelayServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "WRONG_REPLICA",
                f"ticket {ticket_id} is bound to AR {ticket.ar_replica_id}, not {state.replica_id}",
            )
        if ticket.state != broker_pb2.TICKET_STATE_RESERVED:
            raise KvRelayServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "TICKET_NOT_RESERVED",
                f"ticket {ticket_id} is {broker_pb2.TicketState.Name(ticket.state)}; Prefill needs a RESERVED ticket",
            )
        counts = [len(ids) for ids in token_ids]
        reserved = [r.num_tokens for r in sorted(ticket.rows, key=lambda r: r.row)]
        if counts != reserved:
            err = invalid_argument(
                "rows", f"token counts {counts} differ from the ticket's reserved rows {reserved}"
            )
            await self._rollback_if_ours(ticket_id, state, "FAILED", err.reason, known)
            raise err

        item = _PrefillItem(ticket_id, tuple(tuple(ids) for ids in token_ids), sum(counts), job, deadline)
        # Waits with the other tickets for the ranks; its batch holds them from the shared
        # prefill until the end of this ticket's turn (arming and writes), as one ticket did alone.
        async with self.prefills.turn(item) as prefilled:
            if isinstance(prefilled, _PrefillFailed):
                if prefilled.held:
                    await self._call_ranks(DropTicket(ticket_id))
                await self._rollback_if_ours(ticket_id, state, "FAILED", "PREFILL_FAILED", known)
                raise KvRelayServerError(grpc.StatusCode.INTERNAL, "PREFILL_FAILED", prefilled.message)

            # The decisions are the pure ones of ar_service/sender.py; this only carries them out.
            step = after_prefill(
                cancel_requested=job is not None and job.cancel_requested,
                deadline_left_s=deadline.left(),
                min_transfer_s=MIN_TRANSFER_S,
            )
            if prefilled is None:
                # Left out of its batch's prefill: cancelled or out of time while it waited
                # (both only ever become true, so the decision now is the same).
                assert isinstance(step, Abandon)
            if isinstance(step, Abandon):
                if prefilled is not None:
                    await self._call_ranks(DropTicket(ticket_id))
                if step.rollback is not None:
                    await self._rollback_if_ours(ticket_id, state, step.rollback, step.rollback, known)
                raise step.failure
            assert isinstance(prefilled, _Prefilled)
            prefill_s = prefilled.seconds

            arming = await self._arm(ticket_id, state, deadline)
            abandon = after_arming(arming)
            if abandon is not None:
                await self._call_ranks(DropTicket(ticket_id))
                raise abandon.failure
            assert isinstance(arming, broker_pb2.ReserveTicketResponse)
            if job is not None:
                job.armed = True
            # From here on: shielded from cancellation (the caller awaits through asyncio.shield),
            # every write ends with a report.
            return await self._write_and_report(
                request, counts, arming, state, deadline, prefill_s, request.plan if planned else None
            )

    # -- the shared prefill (PrefillBatcher's runner; called holding the ranks) ----------------

    async def _run_prefills(self, items: list[_PrefillItem]) -> list[_PrefillResult]:
        """Prefill every item that still wants it, in one rank command when the engine can take
        several tickets; one result per item. Only a FailStop escapes (to every member)."""
        results: list[_PrefillResult] = [None] * len(items)
        wanted = [
            i for i, item in enumerate(items)
            if isinstance(after_prefill(cancel_requested=item.job is not None and item.job.cancel_requested,
                                        deadline_left_s=item.deadline.left(), min_transfer_s=MIN_TRANSFER_S), Arm)
        ]  # fmt: skip
        if len(wanted) > 1:
            batch = [items[i] for i in wanted]
            try:
                per_rank: list[tuple[PrefillDone | PrefillFailed, ...]] = await self._call_ranks(
                    PrefillTickets(tuple(PrefillTicket(it.ticket_id, it.rows) for it in batch))
                )
            except WorkerCommandError as err:
                # The shared forward failed on the ranks (TP > 1 does not retry there): every
                # ticket gets its own try, as it would have alone.
                log.warning("prefill_batch_failed", tickets=len(batch), error=str(err).splitlines()[0])
            else:
                seconds = max((d.seconds for r in per_rank for d in r if isinstance(d, PrefillDone)), default=0.0)
                self._observe_prefill(seconds, batch, per_rank)
                for k, i in enumerate(wanted):
                    results[i] = _combine([r[k] for r in per_rank])
                return results
        for i in wanted:
            results[i] = await self._prefill_one(items[i])
        return results

    async def _prefill_one(self, item: _PrefillItem) -> _PrefillResult:
        try:
            done: list[PrefillDone] = await self._call_ranks(PrefillTicket(item.ticket_id, item.rows))
        except WorkerCommandError as err:
            held = any(isinstance(v, PrefillDone) for v in err.values)
            return _PrefillFailed(str(err).splitlines()[0], held)
        # Measured on the ranks (model time), not including the pipe hop.
        seconds = max((d.seconds for d in done), default=0.0)
        self._observe_prefill(seconds, [item], [(d,) for d in done])
        return _Prefilled(seconds)

    def _observe_prefill(
        self, seconds: float, items: list[_PrefillItem], per_rank: Sequence[Sequence[PrefillDone | PrefillFailed]]
    ) -> None:
        """Metrics of one forward on the ranks (once per forward, whatever its tickets)."""
        prefilled = [
            item for k, item in enumerate(items) if all(isinstance(r[k], PrefillDone) for r in per_rank)
        ]
        if not prefilled:
            return  # nothing ran: every ticket of the command was refused before the forward
        tokens = sum(item.num_tokens for item in prefilled)
        self.metrics.prefill_seconds.observe(seconds)
        self.metrics.prefill_tokens.inc(tokens)
        self.metrics.prefill_batch_tickets.observe(len(prefilled))
        if len(items) > 1:
            log.info(
                "prefill_batch", tickets=len(items), prefilled=len(prefilled), tokens=tokens,
                prefill_ms=round(seconds * 1000, 3), ticket_ids=[item.ticket_id for item in items],
            )  # fmt: skip

    def _discard_prefill(self, item: _PrefillItem, result: _PrefillResult) -> None:
        """A member gone before its turn (its job was cancelled): free the KV the ranks hold."""
        if isinstance(result, _Prefilled) or (isinstance(result, _PrefillFailed) and result.held):
            self._spawn(self._drop_quietly(item.ticket_id))

    async def _drop_quietly(self, ticket_id: str) -> None:
        with contextlib.suppress(FailStop, WorkerCommandError):
            await self._call_ranks(DropTicket(ticket_id))

    async def _arm(
        self, ticket_id: str, state: ArReplicaState, deadline: _Deadline
    ) -> broker_pb2.ReserveTicketResponse | KvRelayServerError | None:
        """ReserveTicket. A definite refusal comes back as the broker's error; an answer lost in
        transit is retried (arming is idempotent for this incarnation) and, failing that, settled
        in the background so that the writes the broker expects still get NOT_STARTED."""
        request = broker_pb2.ReserveTicketRequest(
            ticket_id=ticket_id, ar_replica_id=state.replica_id, incarnation_id=state.incarnation_id
        )
        self.ledger.begin_arming(ticket_id)
        for attempt in range(3):
            try:
                reply: broker_pb2.ReserveTicketResponse = await self.broker.ReserveTicket(
                    request, timeout=BROKER_RPC_TIMEOUT_S
                )
                return reply
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE:
                    self.ledger.end_arming(ticket_id)
                    return _broker_error(err, "ReserveTicket")
                log.warning(
                    "reserve_ticket_retry", ticket_id=ticket_id, attempt=attempt, code=err.code().name
                )
                await asyncio.sleep(0.2 * (attempt + 1))
        self._spawn(self._settle_lost_arming(request))
        return None

    async def _settle_lost_arming(self, request: broker_pb2.ReserveTicketRequest) -> None:
        # The ticket may be armed without our knowing its writes; until we learn them, polls
        # about it are answered "unresolved" (the ledger's arming set), never NOT_STARTED blindly.
        delay = 1.0
        while True:
            try:
                reply = await self.broker.ReserveTicket(request, timeout=BROKER_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE:
                    self.ledger.end_arming(request.ticket_id)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            writes = writes_from_proto(reply.writes)
            if self.ledger.start(request.ticket_id, writes):
                assert self.reporter is not None
                await self.reporter.report_all(
                    request.ticket_id,
                    not_started_outcomes(writes, "the request ended before the writes began"),
                )
            return

    async def _write_and_report(
        self,
        request: ar_pb2.PrefillRequest,
        counts: list[int],
        arming: broker_pb2.ReserveTicketResponse,
        state: ArReplicaState,
        deadline: _Deadline,
        prefill_s: float,
        plan: broker_pb2.TicketPlan | None,
    ) -> ar_pb2.PrefillResponse:
        """Carries out the pure WriteProtocol's commands (ar_service/sender.py): send, then report
        what it settled, collect while in doubt, answer."""
        ticket_id = request.ticket_id
        assert self.reporter is not None
        # Every destination comes from the broker's authoritative arming reply for this ticket
        # (ReserveTicket, answered to this replica and incarnation), never from the Prefill
        # request: a plan that came with Prefill is only checked equal to it (arming_mismatch).
        source = arming
        writes = writes_from_proto(source.writes)
        if not self.ledger.start(ticket_id, writes):
            # A poll already answered these writes NOT_STARTED: they must never begin.
            await self._call_ranks(DropTicket(ticket_id))
            raise KvRelayServerError(
                grpc.StatusCode.CANCELLED,
                "REQUEST_ENDED",
                f"ticket {ticket_id} ended before its writes began",
            )
        protocol = WriteProtocol(ticket_id, writes, MIN_TRANSFER_S)
        transfer_s = 0.0
        end: EndWrites | None = None
        lost: FailStop | None = None
        try:
            geometry = geometry_from_proto(source.dit_geometry)
            rows = tuple(row_from_proto(r) for r in sorted(source.ticket.rows, key=lambda r: r.row))
            dst_shards = max(1, source.dit_parallelism.tensor_parallel_size) * max(
                1, source.dit_parallelism.sequence_parallel_size
            )
            cfg_parallel = max(1, source.dit_parallelism.cfg_parallel_size)
            mismatch = arming_mismatch(
                arming,
                plan,
                plan_transfer(geometry, state.tensor_parallel_size, dst_shards, rows, cfg_parallel=cfg_parallel),
            )
            if not mismatch and plan is not None and plan.src_shards != state.tensor_parallel_size:
                mismatch = f"plan.src_shards {plan.src_shards} is not this replica's {state.tensor_parallel_size} ranks"
            if mismatch:
                log.warning("plan_mismatch", ticket_id=ticket_id, mismatch=mismatch, writes=len(writes))
            step = protocol.on_armed(
                plan_mismatch=mismatch,
                writing=arming.ticket.state == broker_pb2.TICKET_STATE_WRITING,
                ticket_state=broker_pb2.TicketState.Name(arming.ticket.state),
                transfer_timeout_s=state.transfer_timeout_s,
                deadline_left_s=deadline.left(),
            )
            if isinstance(step, EndWrites):
                end = step
                return ar_pb2.PrefillResponse()
            command = WriteTicket(
                ticket_id=ticket_id,
                rows=rows,
                geometry=geometry,
                src_shards=state.tensor_parallel_size,
                dst_shards=dst_shards,
                plan=tuple(writes),
                destinations=tuple(region_from_proto(d) for d in source.destinations),
                timeout_s=step.timeout_s,
                write_token=state.put_kv_bearer(request.write_token),
            )
            t0 = time.perf_counter()
            try:
                done: list[WriteDone] = await self._call_ranks(command)
            except WorkerCommandError as err:
                # The ranks that answered give their outcomes; the others' stay in doubt.
                self.metrics.record_engine_replacements(d for d in err.values if isinstance(d, WriteDone))
                answered = [o for d in err.values if isinstance(d, WriteDone) for o in d.outcomes]
                end = protocol.on_rank_error(answered, str(err).splitlines()[0])
                assert end.failure is not None
                raise end.failure from err
            except FailStop as err:
                end = protocol.on_ranks_lost(str(err))
                lost = err
                raise
            transfer_s = time.perf_counter() - t0
            self.metrics.record_engine_replacements(done)
            end = protocol.on_written(o for d in done for o in d.outcomes)
            self.metrics.transfer_bytes.labels(state.transport).inc(end.ok_bytes)
            self.metrics.transfer_seconds.labels(state.transport).observe(transfer_s)
            return ar_pb2.PrefillResponse(
                token_counts=counts,
                bytes_written=end.ok_bytes,
                prefill_seconds=prefill_s,
                transfer_seconds=transfer_s,
            )
        finally:
            unexpected = end is None
            if end is None:
                # An unexpected error between the protocol's steps: settle from what it knows
                # (IN_DOUBT for anything sent, NOT_STARTED otherwise); that error propagates.
                end = protocol.on_rank_error((), "the write phase ended unexpectedly")
            final = list(end.outcomes)
            self.metrics.record_sent(state.transport, final)
            if not end.sent:
                # Nothing was written: the ranks still hold the ticket's KV.
                try:
                    await self._call_ranks(DropTicket(ticket_id))
                except (FailStop, WorkerCommandError):
                    pass
            if end.in_doubt:
                # Recorded before the collector starts: it runs while the ledger has writes in doubt.
                for o in final:
                    self.ledger.finish(ticket_id, o)
                self._start_collector()
            await self.reporter.report_all(ticket_id, final)
            log.info(
                "ticket_written",
                ticket_id=ticket_id,
                ok=sum(o.ok for o in final),
                writes=len(final),
                bytes=end.ok_bytes,
                transfer_ms=round(transfer_s * 1000, 3),
            )
            if end.failure is not None and lost is None and not unexpected:
                raise end.failure



def _plan_key(w: PlannedWrite) -> tuple[int, int, int]:
    return (w.row, w.src_rank, w.dst_rank)
