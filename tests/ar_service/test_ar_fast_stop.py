"""`kvrelay ar`: a second signal cuts the graceful drain. A real AR writes into a slow receiver
(gRPC fallback, the write stays in flight); SIGTERM starts the drain, which would wait up to 30 s
for that write; SIGTERM again: the AR kills its ranks and exits EXIT_FAST_STOP at once. To the
broker that is a crash, never a clean release: the write is not final, the ticket's pages stay
held past the quiet period, and only the AR's next incarnation resolves the write (WRITER_GONE)
and frees every page."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.stopping import EXIT_FAST_STOP
from kvrelay.v1 import ar_pb2, broker_pb2, common_pb2
from tests.ar_service.harness import Receiver, ar_stub, start_ar, wait_serving, write_config
from tests.dit_service.harness import inprocess_broker
from tests.foundation.test_stop_while_starting import _printed, _wait_for_event

pytestmark = pytest.mark.slow

PROMPT = "an old lighthouse on a cliff at dusk, oil painting"
# Far under the graceful drain this write would get (STOP_GRACE_S, 30 s, then the ranks' stop),
# generous for a loaded 2-core runner.
EXIT_WITHIN_S = 15.0
FINAL = {common_pb2.WRITE_STATUS_OK, common_pb2.WRITE_STATUS_FAILED, common_pb2.WRITE_STATUS_NOT_STARTED}


async def _wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError("condition not met")


def test_a_second_sigterm_cuts_the_drain_and_leaves_the_in_flight_write_to_the_broker(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="grpc")

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="grpc", world_size=1, num_pages=16, put_delay_s=300.0
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            again = None
            try:
                await wait_serving(ar.address)
                ticket = await receiver.create_ticket([len(ByteTokenizer().encode(PROMPT))])
                pages = sum(len(r.page_ids) for r in ticket.rows)
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    call = ar_stub(channel).Prefill(
                        ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT]), timeout=120.0
                    )

                    async def armed() -> bool:
                        return bool((await receiver.ticket(ticket.ticket_id)).armed)

                    await _wait_for(armed, interval=0.02)
                    ar.proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(_wait_for_event, ar.lines, "stop_requested", ar.proc, 10.0)
                    ar.proc.send_signal(signal.SIGTERM)
                    try:
                        code = await asyncio.to_thread(ar.proc.wait, EXIT_WITHIN_S)
                    except subprocess.TimeoutExpired:
                        raise AssertionError("the AR still drains after a second SIGTERM:\n" + ar.output()) from None
                    with pytest.raises(grpc.aio.AioRpcError):
                        await call
                assert code == EXIT_FAST_STOP, ar.output()
                assert any("SIGTERM again: fast stop" in line for line in _printed(ar.lines)), ar.output()

                # A crash to the broker: nothing final was reported for the write, and its pages
                # stay held well past the quiet period (0.2 s) after the request ends (as the
                # orchestrator ends it): bytes may still land.
                await receiver.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                    ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"),
                    timeout=5.0)
                await asyncio.sleep(1.0)
                held = await receiver.ticket(ticket.ticket_id)
                assert held.state != broker_pb2.TICKET_STATE_RELEASED
                assert [w.status for w in held.writes if w.status in FINAL] == [], held
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages - pages
                assert pool.free_pages + pool.reserved_pages + pool.draining_pages == pool.total_pages

                # The next incarnation proves the writer gone: the write is WRITER_GONE and every
                # page comes back; nothing leaked.
                again = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
                await wait_serving(again.address)

                async def released() -> broker_pb2.Ticket | None:
                    t = await receiver.ticket(ticket.ticket_id)
                    return t if t.state == broker_pb2.TICKET_STATE_RELEASED else None

                done = await _wait_for(released, timeout=20.0)
                assert [w.status for w in done.writes] == [common_pb2.WRITE_STATUS_WRITER_GONE]
                pool = await receiver.pool()
                assert (pool.free_pages, pool.reserved_pages, pool.draining_pages) == (pool.total_pages, 0, 0)
                assert again.stop() == 0, again.output()
            finally:
                ar.stop()
                if again is not None:
                    again.stop()
                await receiver.close()

    asyncio.run(scenario())
