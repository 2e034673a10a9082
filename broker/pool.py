"""The page pool of one DiT replica: which page ids are free, reserved or draining.

Owns every mutation of one replica's page states and the exact accounting
`free + reserved + draining == total`, re-counted from the page states after each mutation.
A page id names the same page on every rank of a CFG group, so one PagePool per group suffices:
a replica without CFG-parallel is one group; a CFG-parallel one (`cfg_parallel_size` 2) has a
pool per group and each CFG row reserves only in the pool of the group that reads it
(`ReplicaPages`, `kvrelay.transfer.planner.cfg_group`).
Must never know about tickets, replicas, gRPC, clocks or the journal: callers (BrokerCore)
decide *when* pages change state; this class only guarantees that each change is legal.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kvrelay.transfer.planner import cfg_group

PageId = int
ReplicaId = str

# Byte-per-page state, so that runs of free pages are found by a C-speed regex scan
# rather than a Python loop over thousands of pages on every reservation.
_FREE: Final = 0
_RESERVED: Final = 1
_DRAINING: Final = 2
_FREE_RUN: Final = re.compile(rb"\x00+")


class PageState(enum.IntEnum):
    FREE = _FREE
    RESERVED = _RESERVED
    DRAINING = _DRAINING


class PoolError(Exception):
    """A pool mutation that would break page accounting; the caller has a bug."""


class NeverFits(ValueError):
    """A reservation that needs more pages than the pool has in total: it can never succeed."""


@dataclass(frozen=True, slots=True)
class PoolCounts:
    total: int
    free: int
    reserved: int
    draining: int


class PagePool:
    """Page states of one DiT replica.

    Reservation is all-or-nothing over every CFG row of a request and prefers contiguous runs,
    so that a plan coalesces into few segments: first one run that holds every row
    back-to-back, then one run per row, and only then pages gathered from the largest runs.
    """

    __slots__ = ("replica_id", "total", "_state", "_free", "_reserved", "_draining")

    def __init__(self, replica_id: ReplicaId, total_pages: int) -> None:
        if total_pages < 0:
            raise ValueError(f"pool {replica_id}: total_pages must be >= 0, got {total_pages}")
        self.replica_id = replica_id
        self.total = total_pages
        self._state = bytearray(total_pages)
        self._free = total_pages
        self._reserved = 0
        self._draining = 0

    # ------------------------------------------------------------------ queries

    def counts(self) -> PoolCounts:
        return PoolCounts(self.total, self._free, self._reserved, self._draining)

    def state_of(self, page: PageId) -> PageState:
        self._check_id(page)
        return PageState(self._state[page])

    def never_fits(self, rows_pages: Sequence[int]) -> bool:
        return sum(rows_pages) > self.total

    def fits_now(self, rows_pages: Sequence[int]) -> bool:
        return sum(rows_pages) <= self._free

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal run of free pages, in page order."""
        return [(m.start(), m.end() - m.start()) for m in _FREE_RUN.finditer(self._state)]

    # ---------------------------------------------------------------- mutations

    def reserve(self, rows_pages: Sequence[int]) -> list[list[PageId]] | None:
        """Reserve `rows_pages[i]` pages for row i, all rows or none.

        Returns the page ids per row, or None when the pages are not free now (the request
        waits). Raises NeverFits when the pool could not hold the rows even if empty.
        """
        if any(n < 0 for n in rows_pages):
            raise ValueError(f"pool {self.replica_id}: negative page count in {list(rows_pages)}")
        need = sum(rows_pages)
        if need > self.total:
            raise NeverFits(
                f"pool {self.replica_id}: {need} pages requested but the replica has only {self.total}"
            )
        if need > self._free:
            return None
        chosen = self._choose(list(rows_pages), self.free_runs())
        for row in chosen:
            for page in row:
                # _choose only hands out pages of free runs; a reserved page here is a bug in it.
                assert self._state[page] == _FREE, f"pool {self.replica_id}: chose page {page} twice"
                self._state[page] = _RESERVED
        self._free -= need
        self._reserved += need
        self._check()
        return chosen

    def mark_draining(self, pages: Iterable[PageId]) -> None:
        """Reserved -> draining: the request is over but a remote write may still land."""
        pages = list(pages)
        self._require(pages, _RESERVED, "mark_draining")
        for page in pages:
            self._state[page] = _DRAINING
        self._reserved -= len(pages)
        self._draining += len(pages)
        self._check()

    def free(self, pages: Iterable[PageId]) -> None:
        """Reserved or draining -> free: nothing can write these pages any more."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise PoolError(f"pool {self.replica_id}: free() given a page twice: {sorted(pages)}")
        for page in pages:
            self._check_id(page)
            if self._state[page] == _FREE:
                raise PoolError(
                    f"pool {self.replica_id}: page {page} freed while already free "
                    "(double release: two tickets held it, or a ticket was released twice)"
                )
        for page in pages:
            if self._state[page] == _RESERVED:
                self._reserved -= 1
            else:
                self._draining -= 1
            self._state[page] = _FREE
        self._free += len(pages)
        self._check()

    def claim(self, pages: Iterable[PageId], state: PageState) -> None:
        """Free -> `state` for exactly these pages: restoring reservations from the journal."""
        pages = list(pages)
        if state is PageState.FREE:
            raise PoolError("claim() takes RESERVED or DRAINING")
        self._require(pages, _FREE, "claim")
        for page in pages:
            self._state[page] = int(state)
        self._free -= len(pages)
        if state is PageState.RESERVED:
            self._reserved += len(pages)
        else:
            self._draining += len(pages)
        self._check()

    # ----------------------------------------------------------------- internals

    def _check_id(self, page: PageId) -> None:
        if not 0 <= page < self.total:
            raise PoolError(f"pool {self.replica_id}: page id {page} outside [0, {self.total})")

    def _require(self, pages: list[PageId], expected: int, op: str) -> None:
        if len(set(pages)) != len(pages):
            raise PoolError(f"pool {self.replica_id}: {op}() given a page twice: {sorted(pages)}")
        for page in pages:
            self._check_id(page)
            if self._state[page] != expected:
                raise PoolError(
                    f"pool {self.replica_id}: {op}() needs page {page} {PageState(expected).name}, "
                    f"but it is {PageState(self._state[page]).name} (is another ticket holding it?)"
                )

    def _check(self) -> None:
        # Recount from the page states, not from the counters: a counter drifting from the
        # states is exactly the bug this assertion exists to catch.
        free = self._state.count(_FREE)
        reserved = self._state.count(_RESERVED)
        draining = self._state.count(_DRAINING)
        if (free, reserved, draining) != (self._free, self._reserved, self._draining):
            raise PoolError(
                f"pool {self.replica_id}: counters free={self._free} reserved={self._reserved} "
                f"draining={self._draining} disagree with page states {free}/{reserved}/{draining}"
            )
        if free + reserved + draining != self.total:
            raise PoolError(
                f"pool {self.replica_id}: free {free} + reserved {reserved} + draining {draining} "
                f"!= total {self.total}"
            )

    @staticmethod
    def _choose(rows: list[int], runs: list[tuple[int, int]]) -> list[list[PageId]]:
        need = sum(rows)
        # 1. One run holding every row back to back: smallest such run (best fit keeps big
        #    runs for big requests), lowest start on ties.
        fitting = [r for r in runs if r[1] >= need]
        if fitting:
            start, _ = min(fitting, key=lambda r: (r[1], r[0]))
            out: list[list[PageId]] = []
            for n in rows:
                out.append(list(range(start, start + n)))
                start += n
            return out
        # 2. Each row in a run of its own (largest rows first, best fit each).
        remaining = list(runs)
        per_row: dict[int, list[PageId]] = {}
        for idx in sorted(range(len(rows)), key=lambda i: -rows[i]):
            n = rows[idx]
            candidates = [i for i, r in enumerate(remaining) if r[1] >= n]
            if not candidates:
                break
            best = min(candidates, key=lambda i: (remaining[i][1], remaining[i][0]))
            start, length = remaining[best]
            per_row[idx] = list(range(start, start + n))
            remaining[best] = (start + n, length - n)
        if len(per_row) == len(rows):
            return [per_row[i] for i in range(len(rows))]
        # 3. Fragmented: stream pages from the largest runs first (fewest segments).
        pages: list[PageId] = []
        for start, length in sorted(runs, key=lambda r: (-r[1], r[0])):
            pages.extend(range(start, start + min(length, need - len(pages))))
            if len(pages) == need:
                break
        out = []
        pos = 0
        for n in rows:
            out.append(pages[pos : pos + n])
            pos += n
        return out


RowPageIds = tuple[int, Sequence[PageId]]  # (CFG row, its page ids)


class ReplicaPages:
    """The page pools of one DiT replica: one PagePool per CFG group.

    Row r of a request lives in group ``cfg_group(r, groups)``'s pool only (the ranks of the other
    group never read it, so they hold no page for it). A reservation is all-or-nothing over every
    group; with one group this is exactly one PagePool.
    """

    __slots__ = ("replica_id", "groups")

    def __init__(self, replica_id: ReplicaId, pages_per_group: int, num_groups: int = 1) -> None:
        if num_groups < 1:
            raise ValueError(f"pool {replica_id}: num_groups must be >= 1, got {num_groups}")
        self.replica_id = replica_id
        names = [replica_id] if num_groups == 1 else [f"{replica_id}/cfg{g}" for g in range(num_groups)]
        self.groups = tuple(PagePool(name, pages_per_group) for name in names)

    def counts(self) -> PoolCounts:
        """Pages of every group together (what the replica holds over all its ranks' groups)."""
        parts = [g.counts() for g in self.groups]
        return PoolCounts(*(sum(getattr(c, f) for c in parts) for f in ("total", "free", "reserved", "draining")))

    def state_of(self, page: PageId, row: int = 0) -> PageState:
        """The state of `page` in the pool of `row`'s group."""
        return self.groups[cfg_group(row, len(self.groups))].state_of(page)

    def _per_group(self, rows_pages: Sequence[int]) -> list[list[int]]:
        per: list[list[int]] = [[] for _ in self.groups]
        for row, n in enumerate(rows_pages):
            per[cfg_group(row, len(self.groups))].append(n)
        return per

    def fits_now(self, rows_pages: Sequence[int]) -> bool:
        return all(pool.fits_now(n) for pool, n in zip(self.groups, self._per_group(rows_pages), strict=True))

    def never_fits(self, rows_pages: Sequence[int]) -> bool:
        """Some group could not hold its rows even if empty (each group only its own rows)."""
        return any(pool.never_fits(n) for pool, n in zip(self.groups, self._per_group(rows_pages), strict=True))

    def reserve(self, rows_pages: Sequence[int]) -> list[list[PageId]] | None:
        """Reserve ``rows_pages[r]`` pages for row r in its group's pool, every row or none.

        None when some group has not the pages free now; NeverFits when some group could never
        hold its rows."""
        per = self._per_group(rows_pages)
        for pool, need in zip(self.groups, per, strict=True):
            if pool.never_fits(need):
                raise NeverFits(f"pool {pool.replica_id}: {sum(need)} pages requested but it has only {pool.total}")
        if not all(pool.fits_now(need) for pool, need in zip(self.groups, per, strict=True)):
            return None
        chosen = [pool.reserve(need) for pool, need in zip(self.groups, per, strict=True)]
        # Every group was checked to fit before any reserved, so none can answer None here.
        assert all(c is not None for c in chosen), f"pool {self.replica_id}: a checked group did not fit"
        taken = [iter(c or []) for c in chosen]
        return [next(taken[cfg_group(row, len(self.groups))]) for row in range(len(rows_pages))]

    def _by_group(self, rows: Iterable[RowPageIds]) -> list[list[PageId]]:
        per: list[list[PageId]] = [[] for _ in self.groups]
        for row, pages in rows:
            per[cfg_group(row, len(self.groups))].extend(pages)
        return per

    def mark_draining(self, rows: Iterable[RowPageIds]) -> None:
        for pool, pages in zip(self.groups, self._by_group(rows), strict=True):
            pool.mark_draining(pages)

    def free(self, rows: Iterable[RowPageIds]) -> None:
        for pool, pages in zip(self.groups, self._by_group(rows), strict=True):
            pool.free(pages)

    def claim(self, rows: Iterable[RowPageIds], state: PageState) -> None:
        for pool, pages in zip(self.groups, self._by_group(rows), strict=True):
            pool.claim(pages, state)
