"""The AR writes only where the broker's arming reply says (ReserveTicketResponse: writes,
destinations, pages, geometry), never where a Prefill request's plan alone says.

A caller that can call Prefill (any holder of the shared replica token, or a broker with a stale
plan) hands the AR a plan whose writes, pages or receive region point into another live ticket's
pages, or into pages no ticket owns. Before, the AR checked only that the plan's write keys
(row, src_rank, dst_rank) matched the arming reply's and wrote at the plan's offsets: the other
ticket's pages were overwritten. Now the Prefill is refused FAILED_PRECONDITION / PLAN_MISMATCH
naming the field, no byte of any page changes, every write of the ticket is reported NOT_STARTED
(so the ticket ends cleanly and no page leaks), and the genuine plan still writes bit for bit.

Real broker (BrokerCore behind the gRPC servicer), real AR process, a receiver whose pages the
test reads back; Mooncake (TCP, non-CUDA) and the gRPC fallback (the transports available on CPU).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.timestamp_pb2 import Timestamp

from kvrelay.errors import reason_of
from kvrelay.models.ar import build_ar_model
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.v1 import ar_pb2, broker_pb2, common_pb2
from kvrelay.worker import default_threads_per_rank
from tests.ar_service.harness import ArProcess, Receiver, ar_stub, start_ar, wait_serving, write_config
from tests.dit_service.harness import inprocess_broker
from tests.threads import torch_threads

pytestmark = pytest.mark.slow

PROMPT = "a red fox in the snow, watercolor, soft morning light"


def _local_kv(text: str) -> torch.Tensor:
    ids = ByteTokenizer().encode(text)
    with torch_threads(default_threads_per_rank(1)):
        return build_ar_model(preset="tiny", seed=0).prefill(ids)


def _forge(
    genuine: broker_pb2.TicketPlan, victim: broker_pb2.TicketPlan, forgery: str, page_bytes: int, free_page: int
) -> broker_pb2.TicketPlan:
    """The genuine plan of the caller's ticket, redirected at pages it does not own."""
    forged = broker_pb2.TicketPlan()
    forged.CopyFrom(genuine)
    if forgery == "other_ticket_pages":
        # Write keys unchanged (row 0, rank 0 -> rank 0); segments and page ids are the victim's.
        del forged.writes[:]
        forged.writes.extend(victim.writes)
        del forged.ticket.rows[:]
        forged.ticket.rows.extend(victim.ticket.rows)
    elif forgery == "other_ticket_region":
        # Same offsets, the receive region moved so that they land on the victim's pages.
        shift = (victim.ticket.rows[0].page_ids[0] - genuine.ticket.rows[0].page_ids[0]) * page_bytes
        forged.destinations[0].base_address += shift
    elif forgery == "unowned_pages":
        # Pages no ticket holds (free in the pool): the offsets and page ids moved there.
        shift_pages = free_page - genuine.ticket.rows[0].page_ids[0]
        for w in forged.writes:
            for s in w.segments:
                s.dst_offset += shift_pages * page_bytes
        for r in forged.ticket.rows:
            r.page_ids[:] = [p + shift_pages for p in r.page_ids]
    else:
        raise AssertionError(forgery)
    return forged


async def _wait_logged(ar: ArProcess, event: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not any(event in line for line in ar.lines):
        assert time.monotonic() < end, f"the AR never logged {event}: {ar.output()}"
        await asyncio.sleep(0.05)


async def _wait_state(receiver: Receiver, ticket_id: str, state: int, timeout: float = 20.0) -> broker_pb2.Ticket:
    deadline = time.monotonic() + timeout
    while True:
        ticket = await receiver.ticket(ticket_id)
        if ticket.state == state or time.monotonic() > deadline:
            return ticket
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("transport", "forgery"),
    [
        ("mooncake", "other_ticket_pages"),
        ("mooncake", "other_ticket_region"),
        ("mooncake", "unowned_pages"),
        ("grpc", "other_ticket_pages"),
        ("grpc", "unowned_pages"),
    ],
)
def test_a_forged_plan_is_refused_before_any_byte_moves(tmp_path: Path, transport: str, forgery: str) -> None:
    from kvrelay.broker.service import plan_to_proto

    config = write_config(tmp_path, transport=transport)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            receiver = Receiver(broker.address, preset="tiny", transport=transport, world_size=1, num_pages=32)
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                counts = [len(ByteTokenizer().encode(PROMPT))]
                victim = await receiver.create_ticket(counts)
                caller = await receiver.create_ticket(counts)
                owned = set(victim.rows[0].page_ids) | set(caller.rows[0].page_ids)
                assert not set(victim.rows[0].page_ids) & set(caller.rows[0].page_ids)
                page_bytes = receiver.layouts[0].page_bytes
                free_page = max(owned) + 4
                assert free_page + len(caller.rows[0].page_ids) <= receiver.num_pages
                before = receiver.regions[0].clone()

                forged = _forge(
                    plan_to_proto(core.plan_for(caller.ticket_id)),
                    plan_to_proto(core.plan_for(victim.ticket_id)),
                    forgery, page_bytes, free_page,
                )  # fmt: skip
                refusal: grpc.aio.AioRpcError | None = None
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    try:
                        await ar_stub(channel).Prefill(
                            ar_pb2.PrefillRequest(ticket_id=caller.ticket_id, request_id=caller.request_id,
                                                  rows=[PROMPT], seed=1, plan=forged),
                            timeout=60.0,
                        )  # fmt: skip
                    except grpc.aio.AioRpcError as err:
                        refusal = err
                # Not one byte of any page moved: the victim's, the unowned ones, the caller's own.
                changed = sorted({i // page_bytes for i in torch.nonzero(receiver.regions[0] != before).flatten().tolist()})
                assert not changed, f"a forged plan wrote into pages {changed} (victim {list(victim.rows[0].page_ids)})"
                assert refusal is not None, "the forged plan was served"
                assert reason_of(refusal)[:2] == ("FAILED_PRECONDITION", "PLAN_MISMATCH"), refusal
                assert "plan." in (refusal.details() or ""), refusal.details()
                # The caller's ticket was armed and every write it expects is resolved NOT_STARTED:
                # it ends cleanly. The victim is untouched (still RESERVED, never armed).
                refused = await receiver.ticket(caller.ticket_id)
                assert refused.armed and refused.writes
                assert all(w.status == common_pb2.WRITE_STATUS_NOT_STARTED for w in refused.writes), refused
                untouched = await receiver.ticket(victim.ticket_id)
                assert untouched.state == broker_pb2.TICKET_STATE_RESERVED and not untouched.armed
                # The AR logged the refusal before answering; its output is read by another thread,
                # which may not have reached that line yet on a loaded machine.
                await _wait_logged(ar, "plan_mismatch")

                # A deadline_time outside Timestamp's range: INVALID_ARGUMENT naming it (was UNKNOWN,
                # a ValueError from Timestamp.ToNanoseconds()), before any prefill or write.
                spare = await receiver.create_ticket(counts)
                spare_plan = plan_to_proto(core.plan_for(spare.ticket_id))
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    for stamp in (Timestamp(seconds=2**62), Timestamp(seconds=10**9, nanos=-5)):
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await ar_stub(channel).Prefill(
                                ar_pb2.PrefillRequest(ticket_id=spare.ticket_id, request_id=spare.request_id,
                                                      rows=[PROMPT], seed=1, deadline_time=stamp,
                                                      plan=spare_plan),
                                timeout=60.0,
                            )  # fmt: skip
                        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                        assert (info.value.details() or "").startswith("deadline_time:"), info.value.details()

                # The genuine plan still writes, bit for bit, into the victim's own pages only.
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    reply = await ar_stub(channel).Prefill(
                        ar_pb2.PrefillRequest(ticket_id=victim.ticket_id, request_id=victim.request_id,
                                              rows=[PROMPT], seed=1,
                                              plan=plan_to_proto(core.plan_for(victim.ticket_id))),
                        timeout=60.0,
                    )  # fmt: skip
                assert reply.bytes_written == len(victim.rows[0].page_ids) * page_bytes
                written = await receiver.ticket(victim.ticket_id)
                assert all(w.status == common_pb2.WRITE_STATUS_OK for w in written.writes), written
                assert torch.equal(receiver.row(0, written, 0), _local_kv(PROMPT))
                mask = torch.ones_like(before, dtype=torch.bool)
                for p in victim.rows[0].page_ids:
                    mask[p * page_bytes : (p + 1) * page_bytes] = False
                assert torch.equal(receiver.regions[0][mask], before[mask]), "bytes outside the ticket's pages"

                # Both tickets end; every page comes back (nothing leaked or left draining).
                for t in (caller, victim):
                    await receiver.stub.CancelTicket(
                        broker_pb2.CancelTicketRequest(ticket_id=t.ticket_id,
                                                       outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"),
                        timeout=5.0,
                    )  # fmt: skip
                    ended = await _wait_state(receiver, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED)
                    assert ended.state == broker_pb2.TICKET_STATE_RELEASED, ended
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages, pool
                assert await asyncio.to_thread(ar.stop) == 0, ar.output()
            finally:
                await asyncio.to_thread(ar.stop)
                await receiver.close()

    asyncio.run(scenario())
