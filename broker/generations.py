"""The generation store: every generation the broker knows, by `request_id`.

Owns the record of each generation (resolved parameters, state, step, image, timings, error),
idempotent submission (the same id and parameters attach; other parameters: ALREADY_EXISTS),
the fan-out of state changes to every attached stream, and the retention of finished
generations: kept `result_ttl_seconds` after they end, at most `max_results` of them (oldest
evicted first), in memory at once and in the journal in bounded batches (`compact_journal`).
Must never talk to replicas or tickets: the orchestrator drives the states, this module only
records them and tells subscribers.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc

from kvrelay.errors import KvRelayServerError, not_found
from kvrelay.logging import get_logger

log = get_logger(__name__)

RequestId = str
# A generation's place in listings: (created_mono, the store's creation counter). Newest first is
# descending order; the counter breaks ties and never repeats within one store.
ListKey = tuple[float, int]

# Rows of forgotten generations deleted from the journal per transaction (each may carry a PNG
# BLOB of hundreds of KB): the event loop waits for one such commit, not for a whole backlog.
JOURNAL_DELETE_BATCH = 32

# A client's own deadline fires a little before the broker's copy of it (the broker's runs from
# when the call arrived): a stream that ends this close to its deadline ended with it (FAILED,
# DEADLINE_EXCEEDED), not by a cancel (CANCELLED, CLIENT_DISCONNECTED). Seen on a loaded machine:
# a stream dropped by its 2 s deadline, 2000.3 ms after its generation was made, with the
# broker's deadline still ahead, was recorded as a cancel.
CLIENT_DEADLINE_SLACK_S = 0.25


class GenState(enum.IntEnum):
    """Mirrors `kvrelay.v1.GenerationState` (same numbers)."""

    QUEUED = 1
    PREFILLING = 2
    TRANSFERRING = 3
    DENOISING = 4
    SUCCEEDED = 5
    FAILED = 6
    CANCELLED = 7

    @property
    def terminal(self) -> bool:
        return self >= GenState.SUCCEEDED


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Resolved parameters (defaults filled in, seed assigned)."""

    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float

    @property
    def rows(self) -> tuple[str, ...]:
        """One text per CFG row: the prompt, then the negative prompt when CFG is on."""
        if self.guidance_scale > 1.0:
            return (self.prompt, self.negative_prompt)
        return (self.prompt,)

    def same_request(self, other: GenerationParams, other_seed_given: bool) -> bool:
        """Whether `other` (a retry) asks for this generation.

        A retry that left the seed out matches whatever seed was assigned the first time, so a
        client that retries the very request it sent attaches instead of getting ALREADY_EXISTS.
        """
        seed_matches = (not other_seed_given) or other.seed == self.seed
        return seed_matches and (
            self.prompt,
            self.negative_prompt,
            self.width,
            self.height,
            self.num_inference_steps,
            self.guidance_scale,
        ) == (
            other.prompt,
            other.negative_prompt,
            other.width,
            other.height,
            other.num_inference_steps,
            other.guidance_scale,
        )


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: str  # gRPC status code name
    reason: str  # UPPER_SNAKE
    message: str


# Why a generation's attempt may end and the generation run again on another replica
# (broker.max_replica_retries): the replica serving it stopped answering, said that one of its
# ranks died or hung (it fail-stops then), or was forgotten by force.
REPLICA_RETRY_REASONS = ("REPLICA_UNAVAILABLE", "REPLICA_FAILED", "REPLICA_FORGOTTEN")
# ... or run again with a fresh ticket, under the same budget, because its KV did not get from
# its AR to its DiT although both replicas answer: a write ended FAILED, NOT_STARTED or
# WRITER_GONE (TRANSFER_FAILED), or the rows were not loaded in time (TRANSFER_TIMEOUT: a write
# in doubt, a timed-out engine, bytes that never matched their checksum), or a rank of the AR
# raised while writing or its answer was lost (WRITE_FAILED: the AR answers Prefill so after
# reporting each write it knows the end of, every other one IN_DOUBT, never FAILED). The same
# AR/DiT pair is used again only when no other is up, and never after it failed the generation
# twice.
# WRITE_FAILED is as safe to retry as TRANSFER_TIMEOUT, in every case the AR answers it (the only
# place it does: ar_service/sender.py WriteProtocol.on_rank_error; the broker's own WRITE_FAILED
# refuses a ReportLoad, which the DiT answers as TRANSFER_FAILED): the failed attempt's ticket
# ends as before, draining while any of its writes is unresolved (a rank that raised mid-call may
# still be writing), so none of its pages is handed out while a write may land in it; the retry's
# ticket takes pages of its own, which no earlier write targets; and on the AR a ticket's
# staging region stays held while an in-doubt call may read it (engine.write_rank_share), so a
# retry on the same AR never repacks memory in flight, exactly as a client's resubmission would
# not. What a retry can cost is a second failure when the cause is a bug on that AR, which the
# budget and the per-pair bound cap, and placement tries another pair first. Unlike the two
# others it marks no link suspect for other generations (pipeline._LINK_FAILURES): a rank that
# raised says nothing of the network between the pair.
TRANSFER_RETRY_REASONS = ("TRANSFER_FAILED", "TRANSFER_TIMEOUT", "WRITE_FAILED")
RETRY_REASONS = REPLICA_RETRY_REASONS + TRANSFER_RETRY_REASONS


class RequestEnded(Exception):
    """Raised inside placement or a pipeline to end its generation with this error (FAILED).

    `replica_id` and `replica_role` ("AR" or "DIT") name the replica whose stage call failed so,
    when one did: the orchestrator may then run the generation again on another one. `final`:
    the error already says all (how often the generation was tried), as the client gets it.
    """

    def __init__(
        self, error: ErrorInfo, *, replica_id: str = "", replica_role: str = "", final: bool = False
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.replica_id = replica_id
        self.replica_role = replica_role
        self.final = final


@dataclass(frozen=True, slots=True)
class ImageResult:
    png: bytes
    width: int
    height: int
    seed: int


# Phase names of `PhaseTimings` (and of the kvrelay_phase_seconds{phase} label).
PHASES = ("queue", "prefill", "transfer", "load", "denoise", "decode", "handoff", "total")


@dataclass(frozen=True, slots=True)
class GenerationSnapshot:
    """One generation at one moment: what events, Get and List hand out."""

    request_id: RequestId
    state: GenState
    params: GenerationParams
    step: int
    total_steps: int
    image: ImageResult | None
    timings: dict[str, float]
    error: ErrorInfo | None
    ticket_id: str
    create_time: float  # wall clock (seconds since the epoch)
    update_time: float
    attempt: int = 1  # > 1: run again after a replica or transfer failure (broker.max_replica_retries)


@dataclass(slots=True)
class GenerationRecord:
    """The mutable state of one generation. Only the orchestrator mutates it, via `update`."""

    request_id: RequestId
    params: GenerationParams
    create_time: float
    created_mono: float
    state: GenState = GenState.QUEUED
    step: int = 0
    image: ImageResult | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: ErrorInfo | None = None
    ticket_id: str = ""
    update_time: float = 0.0
    # 1, then one more each time the broker runs the generation again (a replica or transfer failed).
    attempt: int = 1
    finished_mono: float | None = None
    finished_wall: float | None = None
    # Written to the journal (so its row must be deleted when the generation is forgotten).
    persisted: bool = False
    subscribers: list[asyncio.Queue[GenerationSnapshot]] = field(default_factory=list)
    # Set once the generation is terminal; waiters (cancel, tests) use it.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Its place in listings (GenerationStore gives it when it takes the record).
    list_key: ListKey = (0.0, 0)
    # What the API layer built of a finished generation for listings (it never changes again),
    # kept with the record so it goes when the record does. The store never reads it.
    list_views: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.params.num_inference_steps

    def snapshot(self) -> GenerationSnapshot:
        return GenerationSnapshot(
            request_id=self.request_id,
            state=self.state,
            params=self.params,
            step=self.step,
            total_steps=self.total_steps,
            image=self.image,
            timings=dict(self.timings),
            error=self.error,
            ticket_id=self.ticket_id,
            create_time=self.create_time,
            update_time=self.update_time or self.create_time,
            attempt=self.attempt,
        )

    def subscribe(self) -> asyncio.Queue[GenerationSnapshot]:
        """A queue that gets the generation now, then every change (a terminal one last).

        Unbounded on purpose: one generation makes at most ~num_inference_steps + 5 changes
        (steps are bounded at 1000), and a slow stream must still see the terminal event.
        """
        queue: asyncio.Queue[GenerationSnapshot] = asyncio.Queue()
        queue.put_nowait(self.snapshot())
        if not self.state.terminal:
            self.subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[GenerationSnapshot]) -> None:
        if queue in self.subscribers:
            self.subscribers.remove(queue)


def record_to_json(record: GenerationRecord) -> dict[str, Any]:
    image = record.image
    return {
        "request_id": record.request_id,
        "params": asdict(record.params),
        "state": record.state.name,
        "step": record.step,
        "image": None
        if image is None
        else {
            "png": image.png,  # bytes: the journal stores them as a BLOB
            "width": image.width,
            "height": image.height,
            "seed": image.seed,
        },
        "timings": record.timings,
        "error": None if record.error is None else asdict(record.error),
        "ticket_id": record.ticket_id,
        "create_time": record.create_time,
        "update_time": record.update_time,
        "finished_wall": record.finished_wall,
        "attempt": record.attempt,
    }


def _png_bytes(png: bytes | str) -> bytes:
    """A journaled PNG: bytes (a BLOB of the journal), or base64 text (journaled before that)."""
    return png if isinstance(png, bytes) else base64.b64decode(png)


def record_from_json(data: dict[str, Any], finished_mono: float) -> GenerationRecord:
    image = data["image"]
    record = GenerationRecord(
        request_id=data["request_id"],
        params=GenerationParams(**data["params"]),
        create_time=data["create_time"],
        created_mono=finished_mono - (data["finished_wall"] - data["create_time"]),
        state=GenState[data["state"]],
        step=data["step"],
        image=None
        if image is None
        else ImageResult(_png_bytes(image["png"]), image["width"], image["height"], image["seed"]),
        timings=dict(data["timings"]),
        error=None if data["error"] is None else ErrorInfo(**data["error"]),
        ticket_id=data["ticket_id"],
        update_time=data["update_time"],
        attempt=int(data.get("attempt", 1)),  # journaled before retries: one attempt
        finished_mono=finished_mono,
        finished_wall=data["finished_wall"],
        persisted=True,
    )
    record.done.set()
    return record


@dataclass(frozen=True, slots=True)
class GenerationPage:
    """One page of a listing, newest first: `records` with their keys, and where the next page
    starts (`next_after`: list after this key), None when nothing older is left."""

    records: list[GenerationRecord]
    next_after: ListKey | None


class GenerationJournal(Protocol):
    """The part of the broker's journal (kvrelay.broker.journal.Journal) this store uses."""

    def commit(self, *, generations: dict[str, dict[str, Any] | None]) -> object: ...

    def load(self) -> Any: ...


class GenerationStore:
    """Every generation by request_id: the live ones and the finished ones still retained.

    Single-threaded (the broker's event loop). Retention is checked on every access, so an
    expired generation is gone from memory the next time anyone asks; its journal row goes in
    the same pass when few are due, else in batches of `JOURNAL_DELETE_BATCH` (`compact_journal`,
    which the journal compactor also calls when nobody asks).
    """

    def __init__(
        self,
        *,
        result_ttl_seconds: float,
        max_results: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: GenerationJournal | None = None,
    ) -> None:
        self.result_ttl_seconds = result_ttl_seconds
        self._journal = journal
        self.max_results = max_results
        self._clock = clock
        self._wall = wall_clock
        self._live: dict[RequestId, GenerationRecord] = {}
        # Finished generations in the order they finished: eviction takes the oldest first.
        self._finished: OrderedDict[RequestId, GenerationRecord] = OrderedDict()
        # Forgotten generations whose journal row is not deleted yet (insertion ordered).
        self._unjournaled: dict[RequestId, None] = {}
        # Every record held (live or finished), ascending by ListKey: a page of a listing is a
        # bisect and a walk of its length, never a sort or a scan of every generation.
        self._order: list[tuple[float, int, RequestId]] = []
        self._created = itertools.count(1)
        # Journal rows deleted because their generation was forgotten (a metric).
        self.journal_rows_deleted = 0

    # ------------------------------------------------------------------ queries

    def find(self, request_id: RequestId) -> GenerationRecord | None:
        self.expire()
        return self._live.get(request_id) or self._finished.get(request_id)

    def get(self, request_id: RequestId) -> GenerationRecord:
        record = self.find(request_id)
        if record is None:
            raise not_found("generation", request_id)
        return record

    def live(self) -> list[GenerationRecord]:
        return list(self._live.values())

    def list_generations(
        self, states: Iterable[GenState] = (), limit: int | None = None
    ) -> list[GenerationSnapshot]:
        """Newest first (by create time), optionally only in `states`: every one (tests, tools);
        the API lists by pages (`list_page`)."""
        self.expire()
        wanted = set(states)
        out: list[GenerationSnapshot] = []
        for _, _, request_id in reversed(self._order):
            if limit is not None and len(out) >= limit:
                break
            record = self._held(request_id)
            if not wanted or record.state in wanted:
                out.append(record.snapshot())
        return out

    def list_page(
        self, states: Iterable[GenState], page_size: int, after: ListKey | None, max_scan: int
    ) -> GenerationPage:
        """Up to `page_size` records older than `after` (None: from the newest), newest first,
        only in `states` (empty: all), looking at no more than `max_scan` records: the cost of
        a page is bounded whatever the store holds and however few match."""
        assert page_size >= 1 and max_scan >= page_size, f"list_page({page_size=}, {max_scan=})"
        self.expire()
        wanted = frozenset(states)
        end = len(self._order) if after is None else bisect.bisect_left(self._order, (after[0], after[1], ""))
        records: list[GenerationRecord] = []
        index = end
        while index > 0 and len(records) < page_size and end - index < max_scan:
            index -= 1
            record = self._held(self._order[index][2])
            if not wanted or record.state in wanted:
                records.append(record)
        if index == 0:
            return GenerationPage(records, None)
        last = self._order[index]
        return GenerationPage(records, (last[0], last[1]))

    def _held(self, request_id: RequestId) -> GenerationRecord:
        record = self._live.get(request_id) or self._finished.get(request_id)
        assert record is not None, f"generation {request_id} listed but held neither live nor finished"
        return record

    def _take(self, record: GenerationRecord) -> None:
        record.list_key = (record.created_mono, next(self._created))
        bisect.insort(self._order, (*record.list_key, record.request_id))

    def _drop(self, record: GenerationRecord) -> None:
        entry = (*record.list_key, record.request_id)
        index = bisect.bisect_left(self._order, entry)
        assert index < len(self._order) and self._order[index] == entry, (
            f"generation {record.request_id} dropped but not in the listing order"
        )
        del self._order[index]

    def counts(self) -> tuple[int, int]:
        """(live, finished retained)."""
        self.expire()
        return len(self._live), len(self._finished)

    # ---------------------------------------------------------------- mutations

    def create_or_attach(
        self, request_id: RequestId, params: GenerationParams, seed_given: bool
    ) -> tuple[GenerationRecord, bool]:
        """(record, created). Same id and parameters: the existing record; other parameters:
        ALREADY_EXISTS. A finished generation past its retention is forgotten, so its id is free."""
        existing = self.find(request_id)
        if existing is not None:
            if not existing.params.same_request(params, seed_given):
                raise KvRelayServerError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "REQUEST_ID_REUSED",
                    f"request_id {request_id!r} names a generation with other parameters",
                    request_id=request_id,
                )
            return existing, False
        record = GenerationRecord(
            request_id=request_id,
            params=params,
            create_time=self._wall(),
            created_mono=self._clock(),
        )
        self._live[request_id] = record
        self._take(record)
        return record, True

    def discard(self, record: GenerationRecord) -> None:
        """Forget a generation that was rejected at admission: the caller got an error status, so
        nothing was accepted under this id and a retry is judged afresh."""
        held = self._live.get(record.request_id) is record or self._finished.get(record.request_id) is record
        if self._live.get(record.request_id) is record:
            del self._live[record.request_id]
        if self._finished.get(record.request_id) is record:
            del self._finished[record.request_id]
        if held:
            self._drop(record)

    def update(
        self,
        record: GenerationRecord,
        state: GenState,
        *,
        step: int | None = None,
        image: ImageResult | None = None,
        error: ErrorInfo | None = None,
        ticket_id: str | None = None,
        timings: dict[str, float] | None = None,
        attempt: int | None = None,
    ) -> bool:
        """Move a generation on and tell every subscriber. A terminal generation never changes
        again (the first end wins, as the client saw it); returns False then."""
        if record.state.terminal:
            return False
        record.state = state
        if step is not None:
            record.step = step
        if image is not None:
            record.image = image
        if error is not None:
            record.error = error
        if ticket_id is not None:
            record.ticket_id = ticket_id
        if attempt is not None:
            record.attempt = attempt
        if timings:
            record.timings.update(timings)
        record.update_time = self._wall()
        snap = record.snapshot()
        for queue in record.subscribers:
            queue.put_nowait(snap)
        if state.terminal:
            record.finished_mono = self._clock()
            record.finished_wall = self._wall()
            held = (
                self._live.pop(record.request_id, None) is record
                or self._finished.get(record.request_id) is record
            )
            self._finished[record.request_id] = record
            if not held:  # discarded before it ended (a rejected admission): held again, so listed
                self._take(record)
            self._finished.move_to_end(record.request_id)
            self._finish_subscribers(record)
            record.done.set()
            self.expire()
        return True

    def expire(self) -> None:
        """Forget finished generations past retention; delete at most one batch of their rows."""
        now = self._clock()
        forgotten = False
        while self._finished:
            request_id, oldest = next(iter(self._finished.items()))
            assert oldest.finished_mono is not None, f"generation {request_id} finished without a finish time"
            too_many = len(self._finished) > self.max_results
            if not too_many and now - oldest.finished_mono < self.result_ttl_seconds:
                break
            del self._finished[request_id]
            self._drop(oldest)
            if oldest.persisted:
                self._unjournaled[request_id] = None
                forgotten = True
        if forgotten:
            self._delete_unjournaled(JOURNAL_DELETE_BATCH)

    def compact_journal(self, max_rows: int = JOURNAL_DELETE_BATCH) -> tuple[int, bool]:
        """Expire, then delete up to `max_rows` rows of forgotten generations from the journal in
        one transaction. Returns (rows deleted, whether more are due)."""
        self.expire()
        deleted = self._delete_unjournaled(max_rows)
        return deleted, bool(self._unjournaled) and deleted > 0

    def _delete_unjournaled(self, max_rows: int) -> int:
        if self._journal is None or not self._unjournaled or max_rows <= 0:
            return 0
        batch = list(itertools.islice(self._unjournaled, max_rows))
        if not self._write(dict.fromkeys(batch)):
            return 0  # kept for the next pass
        for request_id in batch:
            del self._unjournaled[request_id]
        self.journal_rows_deleted += len(batch)
        return len(batch)

    # --------------------------------------------------------------- persistence
    # Only finished generations are journaled: one write when a generation ends, one delete
    # when it is forgotten. A live generation does not survive a broker restart (its ticket is
    # orphaned by BrokerCore), so there is nothing of it worth restoring.

    def persist(self, record: GenerationRecord) -> None:
        """Journal a finished generation so GetGeneration serves it across a broker restart."""
        if self._journal is None or not record.state.terminal:
            return
        if self._finished.get(record.request_id) is not record:
            return  # already forgotten (e.g. max_results 1 and a burst of endings)
        if self._write({record.request_id: record_to_json(record)}):
            record.persisted = True
            # An earlier generation of this id may still wait for its row's delete: this write
            # replaced that row, and a later batch must not delete the new one. (A failed write
            # leaves the old row, and its delete, due.)
            self._unjournaled.pop(record.request_id, None)

    def restore(self) -> int:
        """Load the finished generations the journal holds that are still within retention."""
        if self._journal is None:
            return 0
        rows = self._journal.load().generations
        now_wall, now = self._wall(), self._clock()
        restored = 0
        for data in sorted(rows.values(), key=lambda d: d.get("finished_wall") or 0.0):
            age = now_wall - (data.get("finished_wall") or 0.0)
            if (
                data.get("state") not in ("SUCCEEDED", "FAILED", "CANCELLED")
                or age >= self.result_ttl_seconds
            ):
                # Deleted in batches like any forgotten generation (a long-stopped broker may
                # find thousands), not in one transaction.
                self._unjournaled[data["request_id"]] = None
                continue
            record = record_from_json(data, now - max(0.0, age))
            if (held := self._finished.get(record.request_id)) is not None:
                self._drop(held)
            self._finished[record.request_id] = record
            self._take(record)
            restored += 1
        self.expire()
        self._delete_unjournaled(JOURNAL_DELETE_BATCH)
        return restored

    def _write(self, rows: dict[str, dict[str, Any] | None]) -> bool:
        assert self._journal is not None
        try:
            self._journal.commit(generations=rows)
        except Exception:  # noqa: BLE001 - retention across restarts is best effort, serving is not
            log.exception("generation_journal_write_failed", rows=len(rows))
            return False
        return True

    @staticmethod
    def _finish_subscribers(record: GenerationRecord) -> None:
        # Subscribers stop reading after a terminal snapshot; dropping them frees the queues.
        record.subscribers.clear()
