"""Admission in reservation order: the earliest reserved waiting ticket gets the next slot."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.dit_service.scheduler import AdmissionQueue


async def _hold(queue: AdmissionQueue, seq: int, order: list[int], release: asyncio.Event) -> None:
    async with queue.admit(seq, f"t{seq}"):
        order.append(seq)
        await release.wait()


def test_admits_in_reservation_order_not_arrival_order() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(1)
        order: list[int] = []
        gates = {s: asyncio.Event() for s in (5, 9, 7, 3, 8)}
        first = asyncio.ensure_future(_hold(queue, 5, order, gates[5]))
        await asyncio.sleep(0)
        # Arrive late-reserved first: 9, 7, then an earlier reservation 3, then 8.
        later = [asyncio.ensure_future(_hold(queue, s, order, gates[s])) for s in (9, 7, 3, 8)]
        await asyncio.sleep(0.01)
        assert order == [5] and queue.waiting == 4
        for seq in (5, 3, 7, 8, 9):
            gates[seq].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(first, *later)
        assert order == [5, 3, 7, 8, 9]

    asyncio.run(scenario())


def test_max_num_seqs_slots_and_cancel_while_waiting() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(2)
        order: list[int] = []
        gates = {s: asyncio.Event() for s in range(1, 5)}
        a = asyncio.ensure_future(_hold(queue, 1, order, gates[1]))
        b = asyncio.ensure_future(_hold(queue, 2, order, gates[2]))
        await asyncio.sleep(0.01)
        assert sorted(queue.active) == [0, 1] and order == [1, 2]
        c = asyncio.ensure_future(_hold(queue, 3, order, gates[3]))
        d = asyncio.ensure_future(_hold(queue, 4, order, gates[4]))
        await asyncio.sleep(0.01)
        c.cancel()  # the caller of ticket 3 went away while queued: it must not hold a slot
        with pytest.raises(asyncio.CancelledError):
            await c
        gates[1].set()
        await asyncio.sleep(0.01)
        assert order == [1, 2, 4]
        gates[2].set()
        gates[4].set()
        await asyncio.gather(a, b, d)
        assert queue.active == {} and queue.waiting == 0

    asyncio.run(scenario())


async def _settle() -> None:
    """Let every ready task run until all wait again (no timers involved: deterministic)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _queued(queue: AdmissionQueue, seq: int, turns: list[int], admitted: list[int],
                  release: asyncio.Event) -> None:
    """A Denoise call's life in the queue, as the service lives it: load when it is its turn,
    denoise when admitted."""
    async with queue.enter(seq, f"t{seq}") as place:
        await asyncio.wait({place.load_turn})
        turns.append(seq)
        await asyncio.wait({place.admitted})
        admitted.append(seq)
        await release.wait()


def test_look_ahead_loads_the_earliest_queued_calls_and_is_bounded() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(1, look_ahead=2)
        turns: list[int] = []
        admitted: list[int] = []
        gates = {s: asyncio.Event() for s in (1, 2, 3, 4, 5)}
        first = asyncio.ensure_future(_queued(queue, 3, turns, admitted, gates[3]))
        await _settle()
        # 3 holds the slot; 5, 4 then an earlier reservation 1, then 2 arrive.
        later = {}
        for seq in (5, 4):
            later[seq] = asyncio.ensure_future(_queued(queue, seq, turns, admitted, gates[seq]))
            await _settle()
        assert turns == [3, 5, 4] and queue.loading_ahead == 2
        for seq in (1, 2):
            later[seq] = asyncio.ensure_future(_queued(queue, seq, turns, admitted, gates[seq]))
            await _settle()
        # Both places are taken (a started load is never taken back): 1 and 2 wait for a place.
        assert turns == [3, 5, 4] and queue.loading_ahead == 2 and queue.waiting == 4
        # Held (listed at a re-registration after a broker restart): the admitted call's ticket and
        # those of queued calls whose load started, not those still waiting for a place.
        assert queue.held_tickets() == ["t3", "t4", "t5"]
        # 4 leaves while queued (its load failed, or its caller cancelled): 1, the earliest
        # reservation without a place, gets 4's place.
        later.pop(4).cancel()
        await _settle()
        assert turns == [3, 5, 4, 1] and queue.loading_ahead == 2
        assert queue.held_tickets() == ["t3", "t1", "t5"], "a call that left the queue is not held"
        # The slot goes to 1 (reservation order, whatever loaded first); its place goes to 2.
        gates[3].set()
        await _settle()
        assert admitted == [3, 1] and turns == [3, 5, 4, 1, 2] and queue.loading_ahead == 2
        assert queue.held_tickets() == ["t1", "t2", "t5"]
        for seq in (1, 2, 5):
            gates[seq].set()
        await asyncio.gather(first, *later.values())
        assert admitted == [3, 1, 2, 5]
        assert queue.active == {} and queue.waiting == 0 and queue.loading_ahead == 0
        assert queue.held_tickets() == []

    asyncio.run(scenario())


def test_without_look_ahead_a_call_loads_at_admission() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(1, look_ahead=0)
        turns: list[int] = []
        admitted: list[int] = []
        gates = {s: asyncio.Event() for s in (1, 2)}
        a = asyncio.ensure_future(_queued(queue, 1, turns, admitted, gates[1]))
        b = asyncio.ensure_future(_queued(queue, 2, turns, admitted, gates[2]))
        await _settle()
        assert turns == [1] and admitted == [1] and queue.loading_ahead == 0
        gates[1].set()
        await _settle()
        assert turns == [1, 2] and admitted == [1, 2]
        gates[2].set()
        await asyncio.gather(a, b)

    asyncio.run(scenario())


def test_look_ahead_defaults_to_two_per_slot() -> None:
    assert AdmissionQueue(1).look_ahead == 2 and AdmissionQueue(4).look_ahead == 8
    with pytest.raises(ValueError, match="look_ahead"):
        AdmissionQueue(1, look_ahead=-1)


def test_free_slot_admits_the_next_call_before_the_body_ends() -> None:
    """A call done with the ranks gives its slot away at once (its ticket release and final event
    still to come); leaving the body afterwards does not free the slot a second time."""

    async def scenario() -> None:
        queue = AdmissionQueue(1)
        order: list[int] = []
        done_with_ranks, leave = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with queue.enter(1, "t1") as place:
                await asyncio.wait({place.admitted})
                order.append(1)
                queue.free_slot(place)  # before: admitted calls keep their slot until they leave
                queue.free_slot(place)  # idempotent
                done_with_ranks.set()
                await leave.wait()

        gates = {s: asyncio.Event() for s in (2, 3)}
        a = asyncio.ensure_future(first())
        await done_with_ranks.wait()
        b = asyncio.ensure_future(_hold(queue, 2, order, gates[2]))
        c = asyncio.ensure_future(_hold(queue, 3, order, gates[3]))
        await asyncio.sleep(0.01)
        assert order == [1, 2] and queue.active == {0: "t2"} and queue.waiting == 1
        leave.set()
        await a
        await asyncio.sleep(0.01)
        # Leaving did not return slot 0 again: ticket 3 still waits for ticket 2's.
        assert order == [1, 2] and queue.active == {0: "t2"} and queue.waiting == 1
        gates[2].set()
        await asyncio.sleep(0.01)
        assert order == [1, 2, 3]
        gates[3].set()
        await asyncio.gather(b, c)
        assert queue.active == {} and queue.waiting == 0

    asyncio.run(scenario())


def test_free_slot_of_a_call_not_admitted_is_a_no_op() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(1)
        order: list[int] = []
        gate = asyncio.Event()
        holder = asyncio.ensure_future(_hold(queue, 1, order, gate))
        await asyncio.sleep(0.01)
        async with queue.enter(2, "t2") as place:
            queue.free_slot(place)  # queued: nothing to give, and the holder keeps slot 0
            assert queue.active == {0: "t1"} and not place.slot_freed
        gate.set()
        await holder
        assert queue.active == {} and queue.waiting == 0

    asyncio.run(scenario())
