"""The AR replica's lifecycle against the real broker: TP=2 writes, the deadline, heartbeat polls
of a draining ticket, and fail stop when fenced."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvrelay.broker.tickets import TicketOutcome
from kvrelay.models.ar import build_ar_model
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.v1 import ar_pb2, broker_pb2, common_pb2
from tests.ar_service.harness import Receiver, ar_stub, start_ar, wait_serving, write_config
from tests.dit_service.harness import inprocess_broker

pytestmark = pytest.mark.slow

PROMPT = "an old lighthouse on a cliff at dusk, oil painting"


async def _prefill(
    address: str, request: ar_pb2.PrefillRequest, timeout: float = 60.0
) -> ar_pb2.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await ar_stub(channel).Prefill(request, timeout=timeout)


async def _wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError("condition not met")


@pytest.mark.parametrize("dit_tp", [2, 1])
def test_tp2_ar_writes_every_head_shard_and_is_deterministic(tmp_path: Path, dit_tp: int) -> None:
    """AR TP=2 -> DiT TP=2 (each AR rank writes its own DiT rank) and TP=2 -> TP=1 (both AR ranks
    write into one rank's pages): the pages hold the full prefill, and the same prompt on two
    tickets gives the same bits."""
    config = write_config(tmp_path, transport="mooncake", ar_tp=2)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, _core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="mooncake", world_size=dit_tp, num_pages=16
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                count = len(ByteTokenizer().encode(PROMPT))
                seen = []
                for _ in range(2):
                    ticket = await receiver.create_ticket([count])
                    reply = await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT])
                    )
                    after = await receiver.ticket(ticket.ticket_id)
                    assert {(w.src_rank, w.dst_rank) for w in after.writes} == (
                        {(0, 0), (1, 1)} if dit_tp == 2 else {(0, 0), (1, 0)}
                    )
                    assert all(w.status == common_pb2.WRITE_STATUS_OK for w in after.writes)
                    assert reply.bytes_written == sum(w.bytes for w in after.writes)
                    kv = torch.cat([receiver.row(r, after, 0) for r in range(dit_tp)], dim=2)
                    seen.append(kv)
                    await receiver.stub.CancelTicket(
                        broker_pb2.CancelTicketRequest(ticket_id=ticket.ticket_id), timeout=5.0
                    )
                assert torch.equal(seen[0], seen[1]), "the same prompt must give the same bits"
                local = build_ar_model(preset="tiny", seed=0).prefill(ByteTokenizer().encode(PROMPT))
                # TP=2 all-reduces in another order than one process: equal up to rounding.
                torch.testing.assert_close(seen[0], local, rtol=1e-4, atol=1e-4)
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_poll_of_a_ticket_the_writer_never_got_resolves_it_not_started(tmp_path: Path) -> None:
    """The broker armed a ticket for this AR incarnation but the answer never reached it (here:
    the test arms it directly), then the request ended: the ticket drains, the heartbeat polls
    its writes, the AR answers NOT_STARTED, and the pages come back."""
    config = write_config(tmp_path, transport="mooncake", lease_seconds=1.5)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0, drain_quiet_seconds=0.1) as (broker, core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="mooncake", world_size=1, num_pages=16
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                incarnation = core.get_replica("ar-0").spec.incarnation_id
                ticket = await receiver.create_ticket([9, 3])
                core.arm_ticket(ticket.ticket_id, "ar-0", incarnation)
                core.cancel_ticket(ticket.ticket_id, TicketOutcome.CANCELLED, "client went away")
                assert (await receiver.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_DRAINING

                async def released() -> broker_pb2.Ticket | None:
                    t = await receiver.ticket(ticket.ticket_id)
                    return t if t.state == broker_pb2.TICKET_STATE_RELEASED else None

                done = await _wait_for(released, timeout=15.0)
                assert all(w.status == common_pb2.WRITE_STATUS_NOT_STARTED for w in done.writes)
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_deadline_before_arming_rolls_the_ticket_back(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, _core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="mooncake", world_size=1, num_pages=16
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                long_prompt = "z" * 250
                ticket = await receiver.create_ticket([len(ByteTokenizer().encode(long_prompt))])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    # Far shorter than a prefill: the deadline passes before the AR could arm.
                    await _prefill(ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[long_prompt]),
                                   timeout=0.02)  # fmt: skip
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

                async def released() -> broker_pb2.Ticket | None:
                    t = await receiver.ticket(ticket.ticket_id)
                    return t if t.state == broker_pb2.TICKET_STATE_RELEASED else None

                done = await _wait_for(released, timeout=15.0)
                assert not done.armed
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_fenced_replica_fails_stop_with_exit_code_3_and_a_new_incarnation_can_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="mooncake", lease_seconds=1.5)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                first = core.get_replica("ar-0").spec.incarnation_id
                core.fence_replica("ar-0", "test: broken invariant")
                code = await asyncio.to_thread(ar.proc.wait, 20)
                assert code == 3, ar.output()
            finally:
                ar.stop()
            # The lock and every worker of the old incarnation are gone: a new one starts and registers.
            again = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(again.address)
                status = core.get_replica("ar-0")
                assert status.spec.incarnation_id != first and not status.fenced
                assert again.stop() == 0, again.output()
            finally:
                again.stop()

    asyncio.run(scenario())


def test_a_duplicate_replica_given_another_spelling_of_the_broker_is_refused(tmp_path: Path) -> None:
    """`--broker localhost:P` and `--broker 127.0.0.1:P` are one deployment: a second `kvrelay ar
    --replica 0` spelled the other way must not take its own lock and register as a new
    incarnation (which would pass for proof that the first one's writes are gone)."""
    config = write_config(tmp_path, transport="grpc", lease_seconds=1.5)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            host, port = broker.address.rsplit(":", 1)
            assert host == "127.0.0.1"
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                # The AR prints its listening line once it holds the replica lock (ar_service/main.py),
                # before its model load: the duplicate waits out its 10 s for the lock meanwhile.
                argv = [sys.executable, "-m", "kvrelay", "ar", "--config", str(config), "--replica", "0",
                        "--broker", f"localhost:{port}"]
                duplicate_run = asyncio.ensure_future(asyncio.to_thread(
                    subprocess.run, argv, cwd=tmp_path, capture_output=True, text=True, timeout=45
                ))  # fmt: skip
                await wait_serving(ar.address)
                first = core.get_replica("ar-0").spec.incarnation_id
                duplicate = await duplicate_run
                assert duplicate.returncode == 2, duplicate.stdout + duplicate.stderr
                # stderr goes through the JSON log (capture_native_output): one record per line.
                lines = [json.loads(r).get("line", r) if r.startswith("{") else r for r in duplicate.stderr.splitlines()]
                refused = [line for line in lines if "replica lock" in line]
                assert len(refused) == 1, duplicate.stderr
                assert refused[0].startswith("kvrelay ar: ") and f"pid {ar.proc.pid} (running)" in refused[0]
                status = core.get_replica("ar-0")
                assert status.spec.incarnation_id == first and not status.fenced
                assert ar.proc.poll() is None
            finally:
                ar.stop()

    asyncio.run(scenario())


def test_a_cancelled_request_never_interrupts_a_write_in_flight(tmp_path: Path) -> None:
    """The caller cancels Prefill while the AR's write is in flight (a slow gRPC-fallback receiver):
    the write still completes, every write is reported, and the pages hold the prefill."""
    config = write_config(tmp_path, transport="grpc")

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, _core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="grpc", world_size=1, num_pages=16, put_delay_s=1.5
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                ticket = await receiver.create_ticket([len(ByteTokenizer().encode(PROMPT))])
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    call = ar_stub(channel).Prefill(
                        ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT]), timeout=60.0
                    )

                    async def armed() -> bool:
                        return bool((await receiver.ticket(ticket.ticket_id)).armed)

                    await _wait_for(armed, timeout=20.0, interval=0.02)
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await call

                async def reported() -> broker_pb2.Ticket | None:
                    t = await receiver.ticket(ticket.ticket_id)
                    return (
                        t if all(w.status != common_pb2.WRITE_STATUS_UNSPECIFIED for w in t.writes) else None
                    )

                done = await _wait_for(reported, timeout=20.0)
                assert [w.status for w in done.writes] == [common_pb2.WRITE_STATUS_OK]
                local = build_ar_model(preset="tiny", seed=0).prefill(ByteTokenizer().encode(PROMPT))
                assert torch.equal(receiver.row(0, done, 0), local)
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_sigterm_lets_a_running_write_finish_and_report_then_exits_0(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="grpc")

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            receiver = Receiver(
                broker.address, preset="tiny", transport="grpc", world_size=1, num_pages=16, put_delay_s=1.5
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                ticket = await receiver.create_ticket([len(ByteTokenizer().encode(PROMPT))])
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    call = ar_stub(channel).Prefill(
                        ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT]), timeout=60.0
                    )

                    async def armed() -> bool:
                        return bool((await receiver.ticket(ticket.ticket_id)).armed)

                    await _wait_for(armed, timeout=20.0, interval=0.02)
                    ar.proc.terminate()
                    reply = await call
                assert reply.bytes_written > 0
                assert await asyncio.to_thread(ar.proc.wait, 30) == 0, ar.output()
                done = await receiver.ticket(ticket.ticket_id)
                assert [w.status for w in done.writes] == [common_pb2.WRITE_STATUS_OK]
                # Deregistered on the way out: no new tickets go to it.
                assert core.get_replica("ar-0").up is False
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_broker_restart_reregisters_the_same_incarnation(tmp_path: Path) -> None:
    from kvrelay.server import reserve_free_port
    from tests.procs import start_service

    config = write_config(tmp_path, transport="mooncake", lease_seconds=1.5)
    port = reserve_free_port()

    def broker() -> object:
        return start_service(["broker", "--config", str(config), "--port", str(port)], cwd=tmp_path)

    async def replicas(address: str) -> list[broker_pb2.ReplicaInfo]:
        from kvrelay.v1 import broker_pb2_grpc

        async with grpc.aio.insecure_channel(address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            return list((await stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=5.0)).replicas)

    async def scenario() -> None:
        first = await asyncio.to_thread(broker)
        address = first.address  # type: ignore[attr-defined]
        ar = await asyncio.to_thread(start_ar, config, address, cwd=tmp_path)
        second = None
        try:
            await wait_serving(ar.address)
            (before,) = await replicas(address)
            assert await asyncio.to_thread(first.stop) == 0  # type: ignore[attr-defined]
            second = await asyncio.to_thread(broker)

            async def back_up() -> broker_pb2.ReplicaInfo | None:
                reps = await replicas(address)
                return reps[0] if reps and reps[0].up else None

            after = await _wait_for(back_up, timeout=20.0)
            assert after.replica_id == "ar-0" and after.incarnation_id == before.incarnation_id
            assert ar.proc.poll() is None, ar.output()
            assert ar.stop() == 0, ar.output()
        finally:
            ar.stop()
            if second is not None:
                second.stop()  # type: ignore[attr-defined]

    asyncio.run(scenario())
