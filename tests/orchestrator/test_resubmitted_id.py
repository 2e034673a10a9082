"""A generation resubmitted under the id of an EARLIER generation whose ticket still drains (a write
of it may land: its pages wait, possibly until its AR's next incarnation) never waits for that
ticket at the queue's head: it gets pages of its own beside it, as a retry beside its earlier
attempt, so neither it nor anything queued behind it is held up; the earlier ticket keeps every
page until it drains, and the id names the newest ticket still held (as a journal replay does)."""

from __future__ import annotations

import asyncio

from kvrelay.broker.tickets import TicketState
from kvrelay.v1 import generation_pb2

from .harness import cluster, collect, request, run
from .test_create_ticket_ids import _refused

S = generation_pb2
QUEUED, SUCCEEDED, CANCELLED = S.GENERATION_STATE_QUEUED, S.GENERATION_STATE_SUCCEEDED, S.GENERATION_STATE_CANCELLED


def test_a_resubmitted_id_whose_earlier_generations_ticket_drains_never_blocks_the_queue() -> None:
    async def body() -> None:
        # max_results 1: the earlier generation is forgotten as soon as another one finishes (as
        # after result_ttl_seconds, or a broker restart), so its id is free for a new generation.
        async with cluster(max_results=1) as c:
            c.ar.faulty_prefills = 1  # only the first Prefill's writes wait at the write gate
            c.ar.write_gate.clear()
            first = c.api.Generate(request(request_id="dup", seed=1), timeout=20)
            await c.ar.armed.wait()  # armed, its write in flight (held): no rollback any more
            earlier = c.orchestrator.get("dup").ticket_id
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="dup"), timeout=10)
            assert (await collect(first))[-1].state == CANCELLED
            held = c.core.get_ticket(earlier)
            assert held.state is TicketState.DRAINING, held
            final = (await collect(c.api.Generate(request(request_id="filler", seed=2), timeout=20)))[-1]
            assert final.state == SUCCEEDED, final.error
            code, _, _ = await _refused(c.api.GetGeneration(S.GetGenerationRequest(request_id="dup"), timeout=10))
            assert code == "NOT_FOUND"  # forgotten: the id is free

            # The same id again, and a generation queued behind it: both run now (before, the
            # resubmission waited at the queue's head for the earlier ticket to drain, and
            # everything behind it with it).
            again = c.api.Generate(request(request_id="dup", seed=1), timeout=20)
            assert (await again.read()).state == QUEUED
            behind = c.api.Generate(request(request_id="behind", seed=3), timeout=20)
            ends = await asyncio.wait_for(asyncio.gather(collect(again), collect(behind)), 15)
            for events in ends:
                assert events[-1].state == SUCCEEDED, events[-1].error
            # In one attempt, on a ticket of its own from the start (never handed the earlier
            # generation's ticket, which would fail its transfer and only a retry would rescue).
            assert ends[0][-1].attempt == 1
            assert {e.ticket_id for e in ends[0]} <= {"", ends[0][-1].ticket_id}
            assert c.metric("kvrelay_generation_retries_total", {"reason": "TRANSFER_FAILED"}) == 0
            mine = c.core.get_ticket(ends[0][-1].ticket_id)
            assert mine.ticket_id != earlier and mine.request_id == "dup"
            assert mine.state is TicketState.RELEASED
            # No page a write of the earlier ticket may still land in was handed out: it keeps
            # them all, DRAINING, and the new generation had others.
            assert not set(mine.page_ids) & set(held.page_ids)
            assert c.core.get_ticket(earlier).state is TicketState.DRAINING
            pool = c.pool()
            assert (pool.reserved, pool.draining) == (0, len(held.page_ids)), pool
            # The id names the newest ticket still held again: the earlier one.
            named = c.core.ticket_for_request("dup")
            assert named is not None and named.ticket_id == earlier

            c.ar.write_gate.set()  # the held write lands (in the earlier ticket's own pages) and reports
            await c.wait_pool_free()
            assert c.core.ticket_for_request("dup") is None

    run(body())


def test_an_earlier_generations_pipeline_winding_down_leaves_the_later_ones_job_alone() -> None:
    """The queue keys jobs by request id: an earlier generation's pipeline that returns after a
    later generation of the same id was admitted (the earlier record forgotten while it wound
    down) must not drop the later one's entry (its cancel, a forced forget would miss it)."""
    from types import SimpleNamespace
    from typing import Any, cast

    from kvrelay.broker.admission import GenerationJob, GenerationQueue

    async def body() -> None:
        queue = GenerationQueue(max_queue=4)
        earlier, later = (
            GenerationJob(cast(Any, SimpleNamespace(request_id="dup")), (4,), None, 0.0) for _ in range(2)
        )
        queue.enqueue(earlier)
        queue.enqueue(later)
        queue.finished(earlier)
        assert queue.job("dup") is later
        queue.finished(later)
        assert queue.job("dup") is None

    run(body())
