"""The gRPC-stream fallback into the DiT's pages: a whole request over PutKv, and the bounds
check that keeps every chunk inside the pages the broker reserved for its ticket and row."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvrelay.errors import reason_of
from kvrelay.models.dit import DitRunner
from kvrelay.models.image import decode_png
from kvrelay.transfer.convert import writes_from_proto
from kvrelay.transfer.transport import not_started_outcomes
from kvrelay.v1 import broker_pb2, dit_pb2, dit_pb2_grpc
from tests.dit_service.harness import (
    ArWriter,
    SharedReplica,
    inprocess_broker,
    start_dit,
    wait_serving,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReplica]:
    """The broker and DiT (the gRPC-stream fallback) of the tests below that take `replica`."""
    with SharedReplica(tmp_path_factory.mktemp("shared-dit"), transport="grpc") as shared:
        yield shared


@pytest.fixture
def replica(shared_replica: SharedReplica) -> Iterator[SharedReplica]:
    with shared_replica.test():
        yield shared_replica


async def _put(stub: dit_pb2_grpc.DitServiceStub, chunks: list[dit_pb2.PutKvRequest]) -> dit_pb2.PutKvResponse:
    async def gen():  # type: ignore[no-untyped-def]
        for c in chunks:
            yield c

    return await stub.PutKv(gen(), timeout=10.0)


def test_putkv_fallback_end_to_end_and_bounds(replica: SharedReplica) -> None:
    broker, dit = replica.broker, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "grpc")
        await writer.register()
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)

            # 1. A whole request over the fallback: same tickets, same pages, same image.
            counts = [30]
            ticket = await writer.create_ticket(counts)
            armed = await writer.arm(ticket.ticket_id)
            assert armed.destinations[0].endpoint == dit.address
            prefixes = writer.rows_kv(counts, seed=9)
            call = stub.Denoise(dit_pb2.DenoiseRequest(ticket_id=ticket.ticket_id, width=64, height=64,
                                                       num_inference_steps=2, guidance_scale=1.0, seed=4),
                                timeout=60.0)
            events = asyncio.ensure_future(_drain(call))
            outcomes = await asyncio.to_thread(writer.write, armed, prefixes)
            assert all(o.ok for o in outcomes), outcomes
            await writer.report(ticket.ticket_id, outcomes)
            final = (await events)[-1]
            assert final.phase == dit_pb2.DENOISE_PHASE_DECODED
            local = DitRunner("tiny").generate(prefixes, width=64, height=64, steps=2, guidance_scale=1.0,
                                               seed=4).numpy()
            assert int(np.abs(decode_png(final.image.png).astype(int) - local.astype(int)).max()) <= 1

            # 2. Bounds: only the named row's reserved pages of an armed, unreleased ticket.
            counts = [20, 20]
            ticket = await writer.create_ticket(counts)
            page_bytes = armed.writes[0].segments[0].length // len(armed.ticket.rows[0].page_ids)
            row0 = list(ticket.rows[0].page_ids)
            inside = dit_pb2.PutKvRequest(ticket_id=ticket.ticket_id, row=0, dst_rank=0,
                                          dst_offset=row0[0] * page_bytes, data=b"\x01" * 64)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _put(stub, [inside])  # not armed yet: the map was never handed out
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
            await writer.arm(ticket.ticket_id)
            reply = await _put(stub, [inside])
            assert (reply.bytes_received, reply.chunks_received) == (64, 1)

            row1_page = ticket.rows[1].page_ids[0]
            cases = {
                "other row's page": dict(row=0, dst_offset=row1_page * page_bytes),
                "straddles the end of the row": dict(row=0, dst_offset=(row0[-1] + 1) * page_bytes - 32),
                "past the pool": dict(row=0, dst_offset=1 << 40),
                "unknown row": dict(row=5, dst_offset=row0[0] * page_bytes),
                "unknown rank": dict(row=0, dst_rank=3, dst_offset=row0[0] * page_bytes),
                "unknown source rank": dict(row=0, src_rank=2, dst_offset=row0[0] * page_bytes),
            }
            for name, fields in cases.items():
                bad = dit_pb2.PutKvRequest(ticket_id=ticket.ticket_id, data=b"\x02" * 64,
                                           **{"dst_rank": 0, **fields})
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _put(stub, [inside, bad])
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                if name == "unknown source rank":
                    assert "from rank 2 to rank 0 (source ranks [0])" in (info.value.details() or "")

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _put(stub, [dit_pb2.PutKvRequest(ticket_id="no-such-ticket", data=b"x")])
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

            # Cancelled with writes unresolved: DRAINING, and a late chunk may still land.
            await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=5.0)
            assert (await writer.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_DRAINING
            assert (await _put(stub, [inside])).bytes_received == 64
            # Once released, the pages may belong to another ticket: nothing lands any more.
            await writer.report(ticket.ticket_id, not_started_outcomes(
                writes_from_proto((await writer.arm(ticket.ticket_id)).writes), "test"))
            for _ in range(100):
                if (await writer.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_RELEASED:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _put(stub, [inside])
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
        await writer.close()

    replica.run(scenario())


async def _cancel_armed(writer: ArWriter, armed: broker_pb2.ReserveTicketResponse) -> None:
    """Cancel an armed ticket and report its writes NOT_STARTED: it is released."""
    ticket_id = armed.ticket.ticket_id
    await writer.stub.CancelTicket(
        broker_pb2.CancelTicketRequest(ticket_id=ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=5.0
    )
    await writer.report(ticket_id, not_started_outcomes(writes_from_proto(armed.writes), "test"))


async def _drain(call: object) -> list[dit_pb2.DenoiseEvent]:
    return [e async for e in call]  # type: ignore[attr-defined]


def test_bytes_landing_after_the_report_are_rechecked(replica: SharedReplica) -> None:
    """A writer's OK is no proof the bytes landed: the DiT re-checks the destination checksum until
    they do (here: reported OK while the pages still hold other bytes, fixed 0.5 s later)."""

    broker, dit = replica.broker, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "grpc")
        await writer.register()
        counts = [17, 3]
        ticket = await writer.create_ticket(counts)
        armed = await writer.arm(ticket.ticket_id)
        prefixes = writer.rows_kv(counts, seed=12)
        outcomes = await asyncio.to_thread(writer.write, armed, prefixes)
        # Overwrite row 0's pages with other bytes: the report below arrives "too early".
        wrong = await asyncio.to_thread(writer.write, armed, writer.rows_kv(counts, seed=99), [(0, 0)])
        assert wrong[0].checksum != next(o for o in outcomes if o.row == 0).checksum
        await writer.report(ticket.ticket_id, outcomes)
        async with grpc.aio.insecure_channel(dit.address) as channel:
            call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=1,
                guidance_scale=2.0, seed=0), timeout=30.0)
            events = asyncio.ensure_future(_drain(call))
            await asyncio.sleep(0.5)
            assert (await writer.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_WRITING
            await asyncio.to_thread(writer.write, armed, prefixes, [(0, 0)])  # the bytes land
            done = await events
        loaded = next(e for e in done if e.phase == dit_pb2.DENOISE_PHASE_LOADED)
        assert loaded.load_seconds >= 0.5
        assert done[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
        await writer.close()

    replica.run(scenario())


def test_a_late_chunk_of_an_ended_ticket_never_lands_in_the_next_tickets_pages(replica: SharedReplica) -> None:
    """The page fence: a PutKv stream of ticket A is still open (its sender gave up: a deadline,
    keepalive, a stopped DiT) when A is released and its pages go to ticket B. Once B has claimed
    them (its first chunk here; its load's verification otherwise), A's next chunk is refused
    TICKET_NOT_WRITABLE and the bytes B wrote stay B's."""

    broker, dit = replica.broker, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "grpc")
        await writer.register()
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            a = await writer.create_ticket([20])
            armed_a = await writer.arm(a.ticket_id)
            page_bytes = armed_a.writes[0].segments[0].length // len(armed_a.ticket.rows[0].page_ids)
            pages_a = set(a.rows[0].page_ids)

            def chunk(ticket_id: str, page: int, fill: bytes) -> dit_pb2.PutKvRequest:
                return dit_pb2.PutKvRequest(ticket_id=ticket_id, row=0, dst_rank=0,
                                            dst_offset=page * page_bytes, data=fill * 64)

            queue: asyncio.Queue[dit_pb2.PutKvRequest | None] = asyncio.Queue()

            async def stale_stream():  # type: ignore[no-untyped-def]
                while (c := await queue.get()) is not None:
                    yield c

            stale = stub.PutKv(stale_stream(), timeout=60.0)
            first = min(pages_a)
            await queue.put(chunk(a.ticket_id, first, b"\x0a"))
            # A ends: its (never sent) write is reported NOT_STARTED, the ticket is released.
            await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                ticket_id=a.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=5.0)
            await writer.report(a.ticket_id, not_started_outcomes(writes_from_proto(armed_a.writes), "test"))
            for _ in range(100):
                if (await writer.ticket(a.ticket_id)).state == broker_pb2.TICKET_STATE_RELEASED:
                    break
                await asyncio.sleep(0.05)
            # The next tickets get A's pages; B is the first that holds A's first page.
            b = None
            armed_since = []
            for _ in range(64):
                t = await writer.create_ticket([20])
                armed_since.append(await writer.arm(t.ticket_id))
                if first in t.rows[0].page_ids:
                    b = t
                    break
            assert b is not None, "no later ticket was given ticket A's pages"
            reply = await _put(stub, [chunk(b.ticket_id, first, b"\x0b")])
            assert reply.bytes_received == 64
            # A's stream sends on: refused, and B's bytes stay.
            await queue.put(chunk(a.ticket_id, first, b"\x0c"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stale
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
            assert f"now belongs to ticket {b.ticket_id}" in (info.value.details() or "")
            # B still writes its pages (its claim stands).
            assert (await _put(stub, [chunk(b.ticket_id, first, b"\x0b")])).bytes_received == 64
        for armed in armed_since:  # the replica is shared: end every ticket made here
            await _cancel_armed(writer, armed)
        await writer.close()

    replica.run(scenario())


def test_cfg_groups_page_ids_are_two_pages_to_the_fence(tmp_path: Path) -> None:
    """CFG-parallel (2 groups): the broker keeps a page pool per group, so two live tickets may
    hold the same page id, one in each group. Ticket B (later) writes page P of group 1, then
    ticket A (earlier, live) writes its own page P of group 0: it lands. Before, the DiT's fence
    keyed pages by id alone, so B's claim shut A out of its own page (TICKET_NOT_WRITABLE "page P
    now belongs to ticket B"; with a load, TICKET_ENDED: `kvrelay bench --dit-parallel`'s CFG=2
    layout failed a request so in CI)."""
    config = write_config(tmp_path, transport="grpc", cfg_parallel=2)

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "grpc")
                await writer.register()
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    stub = dit_pb2_grpc.DitServiceStub(channel)
                    # A: a long row 0 (group 0), a short row 1 (group 1); B: short rows. B's row 1
                    # then holds, in group 1, an id that A's row 0 holds in group 0.
                    a = await writer.create_ticket([5 * 16, 16])
                    b = await writer.create_ticket([16, 16])
                    armed_a = await writer.arm(a.ticket_id)
                    await writer.arm(b.ticket_id)
                    shared = sorted(set(a.rows[0].page_ids) & set(b.rows[1].page_ids))
                    assert shared, (list(a.rows[0].page_ids), list(b.rows[1].page_ids))
                    page = shared[0]
                    page_bytes = armed_a.writes[0].segments[0].length // len(a.rows[0].page_ids)

                    def chunk(ticket_id: str, row: int, fill: bytes) -> dit_pb2.PutKvRequest:
                        return dit_pb2.PutKvRequest(ticket_id=ticket_id, row=row, dst_rank=row,
                                                    dst_offset=page * page_bytes, data=fill * 64)

                    assert (await _put(stub, [chunk(b.ticket_id, 1, b"\x0b")])).bytes_received == 64
                    assert (await _put(stub, [chunk(a.ticket_id, 0, b"\x0a")])).bytes_received == 64
                    # B's claim stands too: A's claim of its group-0 page took nothing from B.
                    assert (await _put(stub, [chunk(b.ticket_id, 1, b"\x0b")])).bytes_received == 64
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_a_stale_loads_claim_never_refuses_the_next_tickets_chunks(tmp_path: Path) -> None:
    """A load that is itself stale: ticket A is being loaded (its writer's checksum does not match
    the pages yet, so the load re-verifies, claiming A's pages before each look) when A is
    cancelled and released, and its pages go at once to ticket B. The DiT's watch of A lags (held
    here), so A's load goes on re-claiming. B's gRPC chunks must still land: a page only ever goes
    to later tickets (higher reservation sequence), so A's claim cannot supersede B's (before, B's
    second chunk was refused TICKET_NOT_WRITABLE "page N now belongs to ticket A"). The fence
    holds the other way: A's late chunk is refused once B claimed the page, and A's load ends
    TICKET_ENDED at its next look instead of waiting out its transfer_timeout."""
    from kvrelay.broker.service import BrokerServicer

    config = write_config(tmp_path, transport="grpc")
    lagging: set[str] = set()

    class LaggingWatch(BrokerServicer):
        async def WatchTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
            async for reply in super().WatchTicket(request, context):
                yield reply
                if request.ticket_id in lagging:
                    await asyncio.Event().wait()  # what comes next never reaches the DiT

    async def scenario() -> None:
        async with inprocess_broker(servicer_class=LaggingWatch) as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "grpc")
                await writer.register()
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    stub = dit_pb2_grpc.DitServiceStub(channel)
                    a = await writer.create_ticket([20])
                    lagging.add(a.ticket_id)
                    armed_a = await writer.arm(a.ticket_id)
                    page_bytes = armed_a.writes[0].segments[0].length // len(armed_a.ticket.rows[0].page_ids)
                    first = min(a.rows[0].page_ids)
                    # Reported OK with a checksum the pages never match: A's load keeps re-checking.
                    outcomes = await asyncio.to_thread(writer.write, armed_a, writer.rows_kv([20], seed=3))
                    await writer.report(a.ticket_id, [dataclasses.replace(o, checksum=o.checksum ^ 1)
                                                      for o in outcomes])
                    denoise_a = stub.Denoise(dit_pb2.DenoiseRequest(ticket_id=a.ticket_id, width=64, height=64,
                                                                    num_inference_steps=1, guidance_scale=1.0),
                                             timeout=30.0)
                    events_a = asyncio.ensure_future(_drain(denoise_a))
                    await asyncio.sleep(0.5)  # A's load is re-verifying
                    assert not events_a.done()
                    await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                        ticket_id=a.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=5.0)
                    for _ in range(100):
                        if (await writer.ticket(a.ticket_id)).state == broker_pb2.TICKET_STATE_RELEASED:
                            break
                        await asyncio.sleep(0.05)
                    b = None
                    for _ in range(64):
                        t = await writer.create_ticket([20])
                        await writer.arm(t.ticket_id)
                        if first in t.rows[0].page_ids:
                            b = t
                            break
                    assert b is not None, "no later ticket was given ticket A's pages"

                    def chunk(ticket_id: str, fill: bytes) -> dit_pb2.PutKvRequest:
                        return dit_pb2.PutKvRequest(ticket_id=ticket_id, row=0, dst_rank=0,
                                                    dst_offset=first * page_bytes, data=fill * 64)

                    queue: asyncio.Queue[dit_pb2.PutKvRequest | None] = asyncio.Queue()

                    async def b_stream():  # type: ignore[no-untyped-def]
                        while (c := await queue.get()) is not None:
                            yield c

                    b_call = stub.PutKv(b_stream(), timeout=30.0)
                    for _ in range(4):
                        await queue.put(chunk(b.ticket_id, b"\x0b"))
                        await asyncio.sleep(0.3)  # A's stale load looks again meanwhile
                    await queue.put(None)
                    reply = await b_call
                    assert (reply.chunks_received, reply.bytes_received) == (4, 256)
                    # The fence still holds against A: its late chunk is refused, its load ended.
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _put(stub, [chunk(a.ticket_id, b"\x0a")])
                    assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await asyncio.wait_for(events_a, 10.0)
                    assert reason_of(info.value)[1] == "TICKET_ENDED", info.value.details()
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_no_chunk_lands_in_a_loaded_tickets_pages(replica: SharedReplica) -> None:
    """By READY every write is final and verified, and the ranks read the pages from CONSUMING on:
    no chunk may land in them any more, not even one of that ticket (a replayed stream, a caller
    that holds the replica token). A stream opened while the ticket was WRITING is refused at its
    next chunk once the load is done, and a new stream of the ticket at its first; the image is
    the one of the verified bytes. Before, both landed: the fence only asked whose pages they were."""

    broker, dit = replica.broker, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "grpc")
        await writer.register()
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            counts = [20]
            t = await writer.create_ticket(counts)
            armed = await writer.arm(t.ticket_id)
            page_bytes = armed.writes[0].segments[0].length // len(armed.ticket.rows[0].page_ids)
            first = min(t.rows[0].page_ids)
            junk = dit_pb2.PutKvRequest(ticket_id=t.ticket_id, row=0, dst_rank=0,
                                        dst_offset=first * page_bytes, data=b"\x5a" * 64)
            queue: asyncio.Queue[dit_pb2.PutKvRequest | None] = asyncio.Queue()

            async def open_stream():  # type: ignore[no-untyped-def]
                while (c := await queue.get()) is not None:
                    yield c

            lingering = stub.PutKv(open_stream(), timeout=60.0)
            await queue.put(junk)  # WRITING: lands (the real write below overwrites it)
            # ... but only once the DiT has it (after its GetTicket): wait until the pages
            # hold it. The queue only hands the chunk to gRPC; written beside it, the real
            # write could land first, the junk after it, and the load would re-verify
            # mismatching pages (WRITING) until its transfer_timeout.
            deadline = time.monotonic() + 20.0
            while await asyncio.to_thread(dit.pool_bytes, 0, junk.dst_offset, len(junk.data)) != junk.data:
                assert time.monotonic() < deadline, "the WRITING ticket's chunk never landed"
                await asyncio.sleep(0.01)
            prefixes = writer.rows_kv(counts, seed=5)
            await writer.report(t.ticket_id, await asyncio.to_thread(writer.write, armed, prefixes))
            request = dit_pb2.DenoiseRequest(ticket_id=t.ticket_id, width=256, height=256,
                                             num_inference_steps=60, guidance_scale=1.0, seed=2)
            events = asyncio.ensure_future(_drain(stub.Denoise(request, timeout=60.0)))
            deadline = time.monotonic() + 20.0
            while (state := (await writer.ticket(t.ticket_id)).state) != broker_pb2.TICKET_STATE_CONSUMING:
                assert time.monotonic() < deadline, (
                    f"ticket {broker_pb2.TicketState.Name(state)}, not CONSUMING:\n" + "".join(dit.lines[-30:]))
                await asyncio.sleep(0.01)
            await queue.put(junk)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await lingering
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
            assert "verified" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _put(stub, [junk])
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_NOT_WRITABLE")
            done = await events
            assert done[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
            local = DitRunner("tiny").generate(prefixes, width=256, height=256, steps=60,
                                               guidance_scale=1.0, seed=2).numpy()
            image = decode_png(done[-1].image.png).astype(int)
            assert int(np.abs(image - local.astype(int)).max()) <= 1
        await writer.close()

    replica.run(scenario())
