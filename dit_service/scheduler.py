"""Admission of Denoise calls in reservation order, at most `max_num_seqs` at a time, and the
look-ahead that lets the first queued calls load their KV while they wait.

Owns two rules. (1) DESIGN.md section 7 step 4: among the tickets waiting on this replica, the one
the broker reserved first (`Ticket.sequence`) is admitted first, so no later ticket can starve an
earlier one. A free slot is never held for a ticket whose Denoise has not arrived yet: the broker
may have rolled it back, and waiting for it would idle the replica. (2) At most `look_ahead`
calls that are not admitted yet may be loading (waiting for, verifying and reporting their
writes) at once; the earliest reservations get those places, a call admitted before it got one
starts loading at admission, and a started load is never taken back. Pure asyncio: no gRPC, no
clock of its own, no knowledge of pages or ranks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

# Calls that may load ahead of admission, per slot: the next batch's worth and one more, so the
# slot that frees next finds its request loaded even when one ahead of it fails.
LOOK_AHEAD_PER_SLOT = 2

# Admitted calls beyond the running batch, per `max_num_seqs`: a standby call marks its ticket
# CONSUMING and hands its command to the batcher while the batch before it still runs, so the
# ranks start it the moment they finish (no broker round trip, no handler wake-up in between:
# on an H200 those idled the GPU ~10% of the time). The batcher still runs at most
# `max_num_seqs` at once; a standby call cancelled before its batch starts never runs.
STANDBY_PER_SLOT = 1


def admission_slots(max_num_seqs: int) -> int:
    """Slots of a replica that runs `max_num_seqs` calls at once: the running ones and their
    standbys (also the size of its control block)."""
    return (1 + STANDBY_PER_SLOT) * max_num_seqs


def replica_queue(max_num_seqs: int) -> AdmissionQueue:
    """The admission queue of a replica that runs `max_num_seqs` calls at once."""
    return AdmissionQueue(admission_slots(max_num_seqs), look_ahead=LOOK_AHEAD_PER_SLOT * max_num_seqs)


@dataclass(order=True)
class Place:
    """One Denoise call's place in the queue (ordered by reservation, then arrival).

    `load_turn` resolves once the call may start loading (a look-ahead place, or its slot);
    `admitted` resolves to its slot. Wait on them with `asyncio.wait`, never by awaiting them
    directly: a cancelled await would cancel the queue's future."""

    sequence: int
    arrival: int
    ticket_id: str = field(compare=False)
    admitted: asyncio.Future[int] = field(compare=False)
    load_turn: asyncio.Future[None] = field(compare=False)
    slot_freed: bool = field(default=False, compare=False)

    @property
    def queued(self) -> bool:
        return not self.admitted.done()

    @property
    def loading_ahead(self) -> bool:
        return self.queued and self.load_turn.done()


class AdmissionQueue:
    """`async with queue.enter(sequence, ticket_id) as place:` holds a place in the queue (and its
    slot, once admitted) until the body ends; `async with queue.admit(sequence, ticket_id) as
    slot:` runs the body holding one of `max_num_seqs` slots (an index in [0, max_num_seqs),
    unique among the holders)."""

    def __init__(self, max_num_seqs: int, look_ahead: int | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.look_ahead = LOOK_AHEAD_PER_SLOT * max_num_seqs if look_ahead is None else look_ahead
        if self.look_ahead < 0:
            raise ValueError(f"look_ahead must be >= 0, got {self.look_ahead}")
        self._free_slots = list(range(max_num_seqs))
        self._waiters: list[Place] = []
        self._arrivals = itertools.count()
        self.active: dict[int, str] = {}

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if w.queued)

    @property
    def loading_ahead(self) -> int:
        """Calls not admitted yet whose load may run (at most `look_ahead`)."""
        return sum(1 for w in self._waiters if w.loading_ahead)

    def held_tickets(self) -> list[str]:
        """The tickets this replica still holds: the admitted calls' (until their slot is given
        back) and the queued calls' whose load started (their ticket may be READY already). A
        re-registration after a broker restart lists them, so that the broker keeps them; a call
        that left the queue is not listed (its ticket is released, by it or by the broker)."""
        return [*self.active.values(), *(w.ticket_id for w in sorted(self._waiters) if w.loading_ahead)]

    def _dispatch(self) -> None:
        # Hand free slots to the earliest reservations; a waiter that left meanwhile is skipped
        # (its future is already done). An admitted call may load, if it did not already.
        while self._free_slots and self._waiters:
            waiter = heapq.heappop(self._waiters)
            if not waiter.queued:
                continue
            slot = self._free_slots.pop(0)
            self.active[slot] = waiter.ticket_id
            waiter.admitted.set_result(slot)
            if not waiter.load_turn.done():
                waiter.load_turn.set_result(None)
        # Then the look-ahead places that are free go to the earliest queued calls without one.
        free = self.look_ahead - self.loading_ahead
        if free <= 0:
            return
        for waiter in sorted(w for w in self._waiters if w.queued and not w.load_turn.done()):
            if free == 0:
                break
            waiter.load_turn.set_result(None)
            free -= 1

    def _release(self, slot: int) -> None:
        self.active.pop(slot, None)
        self._free_slots.append(slot)
        self._free_slots.sort()
        self._dispatch()

    def free_slot(self, place: Place) -> None:
        """Give the admitted call's slot to the next call now, before its body ends: the call is
        done with the ranks (its denoise returned) and only bookkeeping is left (the ticket's
        release, the final event), which must not keep the replica's GPU waiting. Idempotent; a
        call that is not admitted has no slot to give."""
        if place.slot_freed or not place.admitted.done() or place.admitted.cancelled():
            return
        place.slot_freed = True
        self._release(place.admitted.result())

    @asynccontextmanager
    async def enter(self, sequence: int, ticket_id: str) -> AsyncIterator[Place]:
        loop = asyncio.get_running_loop()
        place = Place(sequence, next(self._arrivals), ticket_id, loop.create_future(), loop.create_future())
        heapq.heappush(self._waiters, place)
        self._dispatch()
        try:
            yield place
        finally:
            if place.admitted.done() and not place.admitted.cancelled():
                if not place.slot_freed:
                    place.slot_freed = True
                    self._release(place.admitted.result())
            else:
                # Left while queued (cancelled, or its load failed): its look-ahead place, if it
                # had one, goes to the next call.
                place.admitted.cancel()
                place.load_turn.cancel()
                self._dispatch()

    @asynccontextmanager
    async def admit(self, sequence: int, ticket_id: str) -> AsyncIterator[int]:
        async with self.enter(sequence, ticket_id) as place:
            await asyncio.wait({place.admitted})
            yield place.admitted.result()
