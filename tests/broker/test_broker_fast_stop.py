"""`kvrelay broker`: a second signal during the graceful stop is a fast stop. The real broker
process, a real DiT and a test writer: with a WatchTicket stream open (an RPC the graceful stop
gives its 2 s grace), SIGTERM then SIGTERM again: the broker exits EXIT_FAST_STOP at once, saying
so in one line; restarted on its journal it still holds the armed ticket's pages (a fast stop, like
a crash, frees nothing), and once the write is reported and the ticket ends every page is free."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.stopping import EXIT_FAST_STOP
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.dit_service.harness import ArWriter, start_dit, wait_serving, write_config
from tests.foundation.test_stop_while_starting import _printed, _wait_for_event
from tests.procs import start_service

pytestmark = pytest.mark.slow

# Well under what a graceful stop would take here (the 2 s grace, then interpreter teardown),
# and generous for a loaded 2-core runner.
EXIT_WITHIN_S = 10.0


async def _wait_ticket(writer: ArWriter, ticket_id: str, state: int, timeout: float) -> broker_pb2.Ticket:
    deadline = time.monotonic() + timeout
    while True:
        ticket = await writer.ticket(ticket_id)
        if ticket.state == state or time.monotonic() > deadline:
            return ticket
        await asyncio.sleep(0.05)


def test_a_second_signal_cuts_the_brokers_drain_and_its_journal_still_holds_the_pages(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="mooncake", transfer_timeout=30.0)

    async def scenario() -> None:
        args = ["broker", "--config", str(config), "--metrics-port", "0"]
        broker = await asyncio.to_thread(start_service, [*args, "--port", "0"], cwd=tmp_path)
        port = broker.address.rsplit(":", 1)[1]
        dit = start_dit(config, broker.address, cwd=tmp_path)
        try:
            await wait_serving(dit)
            writer = ArWriter(broker.address, "tiny", "mooncake")
            await writer.register()
            counts = [10]
            ticket = await writer.create_ticket(counts)
            armed = await writer.arm(ticket.ticket_id)
            pages = sum(len(r.page_ids) for r in armed.ticket.rows)
            assert pages > 0
            async with grpc.aio.insecure_channel(broker.address) as channel:
                watch = broker_pb2_grpc.BrokerServiceStub(channel).WatchTicket(
                    broker_pb2.WatchTicketRequest(ticket_id=ticket.ticket_id), timeout=60.0
                )
                await watch.read()  # the stream is open: the graceful stop waits for it
                broker.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(_wait_for_event, broker.lines, "stop_requested", broker.proc, 10.0)
                broker.proc.send_signal(signal.SIGTERM)
                try:
                    code = await asyncio.to_thread(broker.proc.wait, EXIT_WITHIN_S)
                except subprocess.TimeoutExpired:
                    raise AssertionError("the broker still drains after a second SIGTERM:\n" + broker.output()) from None
                with contextlib.suppress(grpc.aio.AioRpcError):
                    while await watch.read() is not grpc.aio.EOF:
                        pass
            assert code == EXIT_FAST_STOP, broker.output()
            assert any("SIGTERM again: fast stop" in line for line in _printed(broker.lines)), broker.output()

            # Restarted on the same journal and port: the armed ticket and its pages are still held.
            broker = await asyncio.to_thread(start_service, [*args, "--port", port], cwd=tmp_path)
            await writer.register()
            held = await writer.ticket(ticket.ticket_id)
            assert held.state != broker_pb2.TICKET_STATE_RELEASED
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages - pages
            assert pool.free_pages + pool.reserved_pages + pool.draining_pages == pool.total_pages
            # The write is done and reported, the request ends: every page comes back.
            await writer.report(ticket.ticket_id, await asyncio.to_thread(
                writer.write, armed, writer.rows_kv(counts, seed=5)))
            with contextlib.suppress(grpc.aio.AioRpcError):
                await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                    ticket_id=ticket.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"),
                    timeout=5.0)
            released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
            assert released.state == broker_pb2.TICKET_STATE_RELEASED, released
            pool = await writer.pool()
            assert (pool.free_pages, pool.reserved_pages, pool.draining_pages) == (pool.total_pages, 0, 0)
            await writer.close()
        finally:
            assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])
            await asyncio.to_thread(broker.stop)

    asyncio.run(scenario())
