"""Journal retention: keeps the broker's SQLite file the size of what it must still hold.

Owns the periodic compaction pass. Rows of generations the store has forgotten (finished past
`result_ttl_seconds`, or beyond `max_results`) are deleted, free pages go back to the filesystem
and the WAL is truncated. Every step is one short SQLite transaction on the event loop followed
by a yield, so an RPC waits for at most one step, never for a pass (a second connection in a
thread would only move the wait: SQLite has one writer, and a commit that met it would fail).

Must never delete what replay needs: tickets, replicas (incarnations, fences) and meta belong to
BrokerCore, which deletes a ticket only in the commit that RELEASES it; this module touches
generation rows only through the store, and free pages only through the journal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvrelay.broker.generations import JOURNAL_DELETE_BATCH, GenerationStore
from kvrelay.broker.journal import Journal
from kvrelay.logging import get_logger

log = get_logger(__name__)

_T = TypeVar("_T")

# How often a pass runs. A pass with nothing due costs a few pragmas.
COMPACTION_INTERVAL_SECONDS = 10.0
# Free pages given back per step: ~1-3 ms of page moves plus a passive checkpoint of them.
RECLAIM_BATCH_PAGES = 128


@dataclass(frozen=True, slots=True)
class CompactionPass:
    rows_deleted: int
    pages_reclaimed: int
    size_before_bytes: int
    size_bytes: int
    steps: int
    # The longest single step (one transaction): how long an RPC could have waited for it.
    longest_step_ms: float
    duration_ms: float


class JournalCompactor:
    """Runs compaction passes over one journal for one generation store (the event loop's)."""

    def __init__(
        self,
        journal: Journal,
        store: GenerationStore,
        *,
        interval_seconds: float = COMPACTION_INTERVAL_SECONDS,
        batch_rows: int = JOURNAL_DELETE_BATCH,
        batch_pages: int = RECLAIM_BATCH_PAGES,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.journal = journal
        self.store = store
        self.interval_seconds = interval_seconds
        self.batch_rows = batch_rows
        self.batch_pages = batch_pages
        self._timer = timer
        self.passes = 0
        self.bytes_reclaimed = 0
        self._steps = 0
        self._longest = 0.0

    @property
    def rows_deleted(self) -> int:
        """Journal rows deleted because their generation was forgotten (by any pass or access)."""
        return self.store.journal_rows_deleted

    async def run(self) -> None:
        """Compact every `interval_seconds` until cancelled. A pass that fails is logged and the
        next one tries again: a journal that cannot be written stops the broker elsewhere."""
        while True:
            try:
                await self.compact_once()
            except Exception:  # noqa: BLE001 - retention is housekeeping; serving goes on
                log.exception("journal_compaction_failed", path=self.journal.path)
            await asyncio.sleep(self.interval_seconds)

    async def compact_once(self) -> CompactionPass:
        """One pass: delete forgotten generations' rows, give free pages back, truncate the WAL.
        Each step is one transaction or checkpoint (about one fsync); the loop runs between."""
        start = self._timer()
        size_before = self.journal.size_bytes()
        self._steps, self._longest = 0, 0.0
        rows = pages = 0
        while True:
            deleted, more = await self._step(lambda: self.store.compact_journal(self.batch_rows))
            rows += deleted
            if not more:
                break
        # With group commit the deletes are queued: on disk first, or their pages are not free yet.
        await self.journal.durable()
        while True:
            reclaimed = await self._step(lambda: self.journal.reclaim(self.batch_pages))
            pages += reclaimed
            if reclaimed:
                # Checkpoint each step's frames at once: SQLite's own checkpoint would wait for
                # 1000 pages and copy them all inside one commit.
                await self._step(self.journal.checkpoint)
            if reclaimed < self.batch_pages:
                break
        if rows or pages:
            await self._step(lambda: self.journal.checkpoint(truncate=True))
        page_size = self.journal.page_stats()[2] if pages else 0
        self.passes += 1
        self.bytes_reclaimed += pages * page_size
        result = CompactionPass(
            rows_deleted=rows,
            pages_reclaimed=pages,
            size_before_bytes=size_before,
            size_bytes=self.journal.size_bytes(),
            steps=self._steps,
            longest_step_ms=round(self._longest * 1000, 3),
            duration_ms=round((self._timer() - start) * 1000, 3),
        )
        # Idle passes (nothing due) log at debug only: one line every interval is noise.
        (log.info if rows or pages else log.debug)(
            "journal_compacted",
            path=self.journal.path,
            rows_deleted=rows,
            reclaimed_bytes=pages * page_size,
            size_before_bytes=size_before,
            size_bytes=result.size_bytes,
            steps=result.steps,
            longest_step_ms=result.longest_step_ms,
            duration_ms=result.duration_ms,
        )
        return result

    async def _step(self, step: Callable[[], _T]) -> _T:
        """Run one step on the loop, time it, then let everything that waited for it run."""
        t0 = self._timer()
        try:
            return step()
        finally:
            self._longest = max(self._longest, self._timer() - t0)
            self._steps += 1
            await asyncio.sleep(0)
