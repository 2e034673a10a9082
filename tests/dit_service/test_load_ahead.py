"""Look-ahead load: a Denoise call queued behind the only slot (`max_num_seqs: 1`) and its standby
waits for, verifies and reports its writes while it waits, fails at once when that load fails,
and stops its load before its ticket is released when its caller goes away. A real `kvrelay dit` process,
the real BrokerCore in this process (its ticket changes are watched, not polled), and an AR
writer the test controls."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvrelay.broker.tickets import Ticket, TicketOutcome, TicketState
from kvrelay.errors import reason_of
from kvrelay.transfer.convert import writes_from_proto
from kvrelay.transfer.transport import WriteOutcome
from kvrelay.v1 import broker_pb2, dit_pb2, dit_pb2_grpc
from tests.dit_service.harness import (
    ArWriter,
    DitProcess,
    SharedReplica,
    inprocess_broker,
    start_dit,
    wait_serving,
    write_config,
)

pytestmark = pytest.mark.slow

Replica = tuple[Any, DitProcess, ArWriter, dit_pb2_grpc.DitServiceStub]


@contextlib.asynccontextmanager
async def _replica(tmp_path: Path, transfer_timeout: float) -> AsyncIterator[Replica]:
    """Broker core + one DiT replica with one slot + the writer; the DiT must stop cleanly, with no
    task of a request left behind."""
    config = write_config(tmp_path, transport="mooncake", max_num_seqs=1, transfer_timeout=transfer_timeout)
    async with inprocess_broker() as (broker, core):
        dit = start_dit(config, broker.address, cwd=tmp_path)
        try:
            await wait_serving(dit)
            writer = ArWriter(broker.address, "tiny", "mooncake")
            await writer.register()
            async with grpc.aio.insecure_channel(dit.address) as channel:
                yield core, dit, writer, dit_pb2_grpc.DitServiceStub(channel)
            await writer.close()
        finally:
            assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])
        _assert_no_load_task_leaked(dit.lines)


def _assert_no_load_task_leaked(lines: list[str]) -> None:
    # (A stream handler's interceptor may log a ContextVar error of its own when its caller
    # cancels: only the load's tasks count here.)
    leaked = [line for line in lines if ("never retrieved" in line or "Task was destroyed" in line) and "_load" in line]
    assert not leaked, leaked


# transfer_timeout 30 s: no test that shares it waits for a load to time out.
@pytest.fixture(scope="module")
def shared_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReplica]:
    with SharedReplica(tmp_path_factory.mktemp("shared-dit"), transport="mooncake", max_num_seqs=1,
                       transfer_timeout=30.0) as shared:  # fmt: skip
        yield shared
    # Stopped: what a load task left unretrieved is logged by now.
    _assert_no_load_task_leaked(shared.all_lines)


@pytest.fixture
def replica(shared_replica: SharedReplica) -> Iterator[SharedReplica]:
    with shared_replica.test():
        yield shared_replica


@contextlib.asynccontextmanager
async def _shared(replica: SharedReplica) -> AsyncIterator[Replica]:
    """`_replica` on the module's shared DiT (one slot, transfer_timeout 30 s)."""
    assert replica.dit is not None
    writer = ArWriter(replica.broker.address, "tiny", "mooncake")
    await writer.register()
    async with grpc.aio.insecure_channel(replica.dit.address) as channel:
        yield replica.core, replica.dit, writer, dit_pb2_grpc.DitServiceStub(channel)
    await writer.close()
    _assert_no_load_task_leaked(replica.test_lines())


async def _written(writer: ArWriter, counts: list[int], *, report_rows: set[int] | None = None,
                   seed: int = 0) -> tuple[broker_pb2.Ticket, broker_pb2.ReserveTicketResponse]:
    """A ticket created and armed, its rows written; the writes of `report_rows` (all by default)
    reported."""
    ticket = await writer.create_ticket(counts)
    armed = await writer.arm(ticket.ticket_id)
    outcomes = await asyncio.to_thread(writer.write, armed, writer.rows_kv(counts, seed=seed))
    await writer.report(ticket.ticket_id, [o for o in outcomes if report_rows is None or o.row in report_rows])
    return ticket, armed


async def _hold_the_slot(
    stub: dit_pb2_grpc.DitServiceStub, writer: ArWriter
) -> tuple[asyncio.Task[None], list[broker_pb2.Ticket], asyncio.Queue[int]]:
    """Take both admission slots of a `max_num_seqs: 1` replica: ticket A denoises 1000 steps at
    512x512 until the test cancels it, and ticket S (one small step) is its standby, admitted and
    LOADED with its command queued behind A's. Returns the holder task (cancel it with
    `_free_the_slot`: A stops, then S runs and ends), the tickets [A, S], and A's step events."""
    ticket, _ = await _written(writer, [6])
    standby, _ = await _written(writer, [6], seed=3)
    steps: asyncio.Queue[int] = asyncio.Queue()
    loaded = asyncio.Event()

    async def run() -> None:
        async for event in stub.Denoise(dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id, width=512, height=512, num_inference_steps=1000,
                guidance_scale=1.0, seed=0), timeout=120.0):
            if event.phase == dit_pb2.DENOISE_PHASE_STEP:
                steps.put_nowait(event.step)

    async def run_standby() -> None:
        async for event in stub.Denoise(_request(standby), timeout=120.0):
            if event.phase == dit_pb2.DENOISE_PHASE_LOADED:
                loaded.set()

    a = asyncio.ensure_future(run())
    await asyncio.wait_for(steps.get(), 30.0)
    s = asyncio.ensure_future(run_standby())
    await asyncio.wait_for(loaded.wait(), 30.0)
    # The standby waits for the ranks, not for a slot: it is admitted, but A still runs.
    assert not s.done()

    async def hold() -> None:
        try:
            await a
        finally:
            await asyncio.wait_for(s, 60.0)  # A stopped: its standby runs and completes

    return asyncio.ensure_future(hold()), [ticket, standby], steps


def _held_pages(core: Any, held: list[broker_pb2.Ticket]) -> int:
    return sum(len(core.get_ticket(t.ticket_id).page_ids) for t in held)


async def _free_the_slot(holder: asyncio.Task[None]) -> None:
    holder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holder


async def _until(core: Any, ticket_id: str, reached: Callable[[Ticket], bool], timeout: float = 10.0) -> Ticket:
    """The ticket's first version (now or later) for which `reached` holds."""

    async def watch() -> Ticket:
        async with contextlib.aclosing(core.waiters.watch_ticket(ticket_id)) as versions:
            async for ticket in versions:
                if reached(ticket):
                    return ticket
        raise AssertionError(f"ticket {ticket_id} was released before the awaited change")

    return await asyncio.wait_for(watch(), timeout)


def _request(ticket: broker_pb2.Ticket, rows: int = 1) -> dit_pb2.DenoiseRequest:
    return dit_pb2.DenoiseRequest(ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=1,
                                  guidance_scale=1.0 if rows == 1 else 2.0, seed=0)


def test_queued_requests_load_while_the_slot_is_taken_and_keep_reservation_order(replica: SharedReplica) -> None:
    """B and C (B reserved first, C calling first) are verified and READY while A holds the only
    slot; once it frees, B is admitted before C, and each LOADED reports its load's own time, not
    its wait for the slot."""

    async def scenario() -> None:
        async with _shared(replica) as (core, _dit, writer, stub):
            holder, held, a_steps = await _hold_the_slot(stub, writer)
            b = await writer.create_ticket([6])
            c = await writer.create_ticket([6])
            armed = {t.ticket_id: await writer.arm(t.ticket_id) for t in (b, c)}
            order: list[str] = []
            called: dict[str, float] = {}
            admitted: dict[str, float] = {}
            load_seconds: dict[str, float] = {}

            async def run(ticket: broker_pb2.Ticket, name: str) -> None:
                called[name] = time.monotonic()
                async for event in stub.Denoise(_request(ticket), timeout=60.0):
                    if event.phase == dit_pb2.DENOISE_PHASE_LOADING:
                        order.append(name)
                        admitted[name] = time.monotonic()
                    elif event.phase == dit_pb2.DENOISE_PHASE_LOADED:
                        load_seconds[name] = event.load_seconds

            c_call = asyncio.ensure_future(run(c, "C"))
            b_call = asyncio.ensure_future(run(b, "B"))
            # The writes land while both calls wait for A's slot.
            for t in (b, c):
                outcomes = await asyncio.to_thread(writer.write, armed[t.ticket_id], writer.rows_kv([6], seed=1))
                await writer.report(t.ticket_id, outcomes)
            for t in (b, c):
                await _until(core, t.ticket_id, lambda t: t.state is TicketState.READY)
            # Both verified and reported while queued: A still denoises in the only slot.
            assert not holder.done() and all(core.get_ticket(t.ticket_id).state is TicketState.CONSUMING for t in held)
            assert order == []
            # A few more of A's steps: the wait for the slot outlasts the loads by far.
            for _ in range(3):
                await asyncio.wait_for(a_steps.get(), 30.0)
            await _free_the_slot(holder)
            await asyncio.wait_for(asyncio.gather(b_call, c_call), 60.0)
            assert order == ["B", "C"]
            for name in ("B", "C"):
                assert 0 < load_seconds[name] < admitted[name] - called[name], (name, load_seconds, admitted, called)
            for t in (b, c):
                done = core.get_ticket(t.ticket_id)
                assert (done.state, done.outcome) == (TicketState.RELEASED, TicketOutcome.OK)
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages

    replica.run(scenario())


def test_queued_request_whose_writer_never_writes_times_out_while_queued(tmp_path: Path) -> None:
    """B's writes never come: B fails DEADLINE_EXCEEDED / TRANSFER_TIMEOUT after transfer_timeout
    while A still holds the only slot (it does not wait for admission first), and its ticket is
    released TIMED_OUT: its pages drain until the writer reports, then free."""

    async def scenario() -> None:
        async with _replica(tmp_path, transfer_timeout=1.0) as (core, _dit, writer, stub):
            holder, held, _ = await _hold_the_slot(stub, writer)
            b = await writer.create_ticket([6])
            armed = await writer.arm(b.ticket_id)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _event in stub.Denoise(_request(b), timeout=30.0):
                    raise AssertionError("admitted, although A holds the only slot")
            waited = time.monotonic() - started
            assert reason_of(info.value)[:2] == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), info.value
            assert 0.9 <= waited < 5.0
            assert not holder.done(), "B waited for A's slot"
            ended = core.get_ticket(b.ticket_id)
            # Released by the DiT; its armed, never reported write keeps the pages DRAINING.
            assert (ended.state, ended.outcome) == (TicketState.DRAINING, TicketOutcome.TIMED_OUT)
            await writer.report(b.ticket_id, [
                WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0) for w in writes_from_proto(armed.writes)
            ])
            await _until(core, b.ticket_id, lambda t: t.state is TicketState.RELEASED)
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages - _held_pages(core, held)
            await _free_the_slot(holder)

    asyncio.run(scenario())


def test_cancel_while_queued_stops_the_load_before_the_release(replica: SharedReplica) -> None:
    """B is queued with its load in flight (row 0 verified and reported, row 1 not reported yet):
    its caller cancels. The ticket is released CANCELLED while A still runs, B's load task ends
    with the call (`_replica` checks that no task was left to fail unseen), nothing of B is left
    in the queue, and the next request is served."""

    async def scenario() -> None:
        async with _shared(replica) as (core, _dit, writer, stub):
            holder, held, _ = await _hold_the_slot(stub, writer)
            b, armed = await _written(writer, [6, 3], report_rows={0})
            call = stub.Denoise(_request(b, rows=2), timeout=60.0)
            reader = asyncio.ensure_future(call.read())
            await _until(core, b.ticket_id, lambda t: any(ld.key.row == 0 and ld.loaded for ld in t.loads))
            assert not reader.done() and not holder.done()
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            ended = await _until(core, b.ticket_id, lambda t: t.outcome is not None)
            # Row 1's write was never reported: the pages drain until it is.
            assert (ended.state, ended.outcome) == (TicketState.DRAINING, TicketOutcome.CANCELLED)
            assert not holder.done()
            await writer.report(b.ticket_id, [
                WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0)
                for w in writes_from_proto(armed.writes) if w.row == 1
            ])
            await _until(core, b.ticket_id, lambda t: t.state is TicketState.RELEASED)
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages - _held_pages(core, held)
            await _free_the_slot(holder)
            # B left the queue: the next request is admitted and served.
            d, _ = await _written(writer, [5], seed=2)
            events = [e async for e in stub.Denoise(_request(d), timeout=60.0)]
            assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages

    replica.run(scenario())


def test_a_standby_cancelled_before_its_batch_never_reaches_the_ranks(replica: SharedReplica) -> None:
    """A denoises; B is admitted as its standby (LOADED, ticket CONSUMING, its command queued
    behind A's). B's caller cancels: B is taken back from the batcher at once (no rank sees it),
    its ticket is released CANCELLED while A still runs, and the replica serves the next call."""

    async def scenario() -> None:
        async with _shared(replica) as (core, dit, writer, stub):
            a, _ = await _written(writer, [6])
            a_steps: asyncio.Queue[int] = asyncio.Queue()

            async def run_a() -> None:
                async for event in stub.Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=a.ticket_id, width=512, height=512, num_inference_steps=1000,
                        guidance_scale=1.0, seed=0), timeout=120.0):
                    if event.phase == dit_pb2.DENOISE_PHASE_STEP:
                        a_steps.put_nowait(event.step)

            holder = asyncio.ensure_future(run_a())
            await asyncio.wait_for(a_steps.get(), 30.0)
            b, _ = await _written(writer, [6], seed=1)
            call = stub.Denoise(_request(b), timeout=60.0)
            phases = []
            while dit_pb2.DENOISE_PHASE_LOADED not in phases:
                phases.append((await asyncio.wait_for(call.read(), 30.0)).phase)
            assert core.get_ticket(b.ticket_id).state is TicketState.CONSUMING
            call.cancel()
            ended = await _until(core, b.ticket_id, lambda t: t.state is TicketState.RELEASED)
            assert ended.outcome is TicketOutcome.CANCELLED
            assert not holder.done(), "B was released while A still ran"
            await asyncio.sleep(0.2)
            assert any("denoise_withdrawn" in line for line in replica.test_lines()), "".join(dit.lines[-20:])
            await _free_the_slot(holder)
            c, _ = await _written(writer, [5], seed=2)
            events = [e async for e in stub.Denoise(_request(c), timeout=60.0)]
            assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages

    replica.run(scenario())


def test_queued_ready_tickets_survive_a_broker_restart(tmp_path: Path) -> None:
    """A denoises in the only slot (S its standby); B and C are queued with their loads done
    (READY). The broker restarts (same port, same journal): the DiT re-registers listing B and C
    as held with A and S, so the broker keeps them READY. C's caller then cancels: C is released.
    A stops: S, then B run (B marks its ticket CONSUMING on the restarted broker) and complete,
    and every page is free at the end."""

    async def scenario() -> None:
        config = write_config(tmp_path, transport="mooncake", max_num_seqs=1, transfer_timeout=30.0)
        journal = tmp_path / "restarting-broker.sqlite"
        first: Any = inprocess_broker(journal_path=journal)
        restarted: Any = None
        broker, core = await first.__aenter__()
        dit = start_dit(config, broker.address, cwd=tmp_path)
        try:
            await wait_serving(dit)
            writer = ArWriter(broker.address, "tiny", "mooncake")
            await writer.register()
            async with grpc.aio.insecure_channel(dit.address) as channel:
                stub = dit_pb2_grpc.DitServiceStub(channel)
                holder, held, _ = await _hold_the_slot(stub, writer)
                b, _ = await _written(writer, [6], seed=1)
                c, _ = await _written(writer, [6], seed=2)
                b_phases: list[int] = []

                async def run_b() -> None:
                    async for event in stub.Denoise(_request(b), timeout=60.0):
                        b_phases.append(event.phase)

                b_call = asyncio.ensure_future(run_b())
                c_call = stub.Denoise(_request(c), timeout=60.0)
                c_reader = asyncio.ensure_future(c_call.read())
                for t in (b, c):
                    await _until(core, t.ticket_id, lambda t: t.state is TicketState.READY)

                await first.__aexit__(None, None, None)
                first = None
                restarted = inprocess_broker(journal_path=journal, port=broker.bound_port)
                _, core = await restarted.__aenter__()
                # The DiT's next heartbeat is refused NOT_FOUND: it registers again (same incarnation).
                for _ in range(200):
                    if core.get_replica("dit-0").up:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the DiT never registered with the restarted broker")
                assert [core.get_ticket(t.ticket_id).state for t in (*held, b, c)] == [
                    TicketState.CONSUMING, TicketState.CONSUMING, TicketState.READY, TicketState.READY]
                assert not b_call.done() and not c_reader.done() and not holder.done()

                c_call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await c_reader
                await _until(core, c.ticket_id, lambda t: t.state is TicketState.RELEASED)
                pool = await writer.pool()
                assert pool.free_pages == pool.total_pages - _held_pages(core, [*held, b])

                await _free_the_slot(holder)
                await asyncio.wait_for(b_call, 60.0)
                assert b_phases[-1] == dit_pb2.DENOISE_PHASE_DECODED
                assert core.get_ticket(b.ticket_id).state is TicketState.RELEASED
                pool = await writer.pool()
                assert pool.free_pages == pool.total_pages
            await writer.close()
        finally:
            assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])
            for running in (restarted, first):
                if running is not None:
                    await running.__aexit__(None, None, None)

    asyncio.run(scenario())
