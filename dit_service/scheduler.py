"""Admission of Denoise calls in reservation order, at most `max_num_seqs` at a time.

Owns one rule (DESIGN.md section 7 step 4): among the tickets waiting on this replica, the one the
broker reserved first (`Ticket.sequence`) is admitted first, so no later ticket can starve an
earlier one. A free slot is never held for a ticket whose Denoise has not arrived yet: the broker
may have rolled it back, and waiting for it would idle the replica. Pure asyncio: no gRPC, no
clock of its own, no knowledge of pages or ranks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    sequence: int
    arrival: int
    ticket_id: str = field(compare=False)
    future: asyncio.Future[int] = field(compare=False)


class AdmissionQueue:
    """`async with queue.admit(sequence, ticket_id) as slot:` runs the body holding one of
    `max_num_seqs` slots (an index in [0, max_num_seqs), unique among the holders)."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self._free_slots = list(range(max_num_seqs))
        self._waiters: list[_Waiter] = []
        self._arrivals = itertools.count()
        self.active: dict[int, str] = {}

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    def _dispatch(self) -> None:
        # Hand free slots to the earliest reservations; a waiter whose call was cancelled meanwhile
        # is skipped (its future is already done).
        while self._free_slots and self._waiters:
            waiter = heapq.heappop(self._waiters)
            if waiter.future.done():
                continue
            slot = self._free_slots.pop(0)
            self.active[slot] = waiter.ticket_id
            waiter.future.set_result(slot)

    def _release(self, slot: int) -> None:
        self.active.pop(slot, None)
        self._free_slots.append(slot)
        self._free_slots.sort()
        self._dispatch()

    @asynccontextmanager
    async def admit(self, sequence: int, ticket_id: str) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(sequence, next(self._arrivals), ticket_id, loop.create_future())
        heapq.heappush(self._waiters, waiter)
        self._dispatch()
        try:
            slot = await waiter.future
        except asyncio.CancelledError:
            # Cancelled while queued, or just after being handed a slot: give the slot back.
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result())
            else:
                waiter.future.cancel()
            raise
        try:
            yield slot
        finally:
            self._release(slot)
