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
