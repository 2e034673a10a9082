"""Several tickets in one prefill (issue 15): the rank command `PrefillTickets` holds each ticket's
KV exactly as separate `PrefillTicket`s do and isolates a bad ticket; the service's PrefillBatcher
takes the tickets that wait while the ranks are busy into one prefill, and leaves out a ticket
cancelled while it waited. In-process: the real ArServicer over gRPC, the real BrokerCore, one real
rank handler (tiny, CPU) answering in a thread, a gRPC-fallback receiver the test reads back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvrelay.ar_service.batcher import PrefillBatcher
from kvrelay.ar_service.engine import (
    ArRankHandler,
    ArRankSpec,
    DropTicket,
    HeldTickets,
    PrefillDone,
    PrefillFailed,
    PrefillTicket,
    PrefillTickets,
    WriteTicket,
)
from kvrelay.ar_service.registration import ArIdentity
from kvrelay.ar_service.service import AR_SERVICE, ArMetrics, ArReplicaState, ArServicer
from kvrelay.models.parallel import TpGroup
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.server import GrpcServer
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, broker_pb2, broker_pb2_grpc, common_pb2
from kvrelay.worker import RankContext, RankError, WorkerCommandError
from tests.ar_service.harness import PAGE_SIZE, Receiver, ar_stub
from tests.dit_service.harness import inprocess_broker


def _handler() -> ArRankHandler:
    ctx = RankContext(rank=0, world_size=1, device="cpu", backend="gloo", num_threads=1, tp=TpGroup.single())
    spec = ArRankSpec(preset="tiny", path=None, weight_seed=0, dtype=None, transport="grpc", hostname="127.0.0.1")
    return ArRankHandler(ctx, spec)


def _spy_prefill_batch(handler: ArRankHandler, fail: Callable[[list[Any]], bool] | None = None) -> list[int]:
    """Count rows per `prefill_batch` call; `fail(rows)` makes a call raise (an OOM stand-in)."""
    calls: list[int] = []
    real = handler.model.prefill_batch

    def spy(rows: list[Any]) -> Any:
        calls.append(len(rows))
        if fail is not None and fail(rows):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(rows)

    handler.model.prefill_batch = spy
    return calls


TICKETS = {
    "a": ((256, 104, 105, 33), (256, 98)),
    "b": ((256, *range(60, 90)),),
    "c": ((256, 1, 2, 3, 4, 5), (256, 7, 7)),
}


# --- The rank command ----------------------------------------------------------------------------


def test_prefill_tickets_holds_each_tickets_kv_as_separate_prefills_from_one_forward() -> None:
    handler = _handler()
    try:
        calls = _spy_prefill_batch(handler)
        done = handler.handle(PrefillTickets(tuple(PrefillTicket(t, rows) for t, rows in TICKETS.items())))
        assert calls == [5], "every row of every ticket in one prefill_batch call"
        assert [d.token_counts for d in done] == [tuple(len(r) for r in rows) for rows in TICKETS.values()]
        assert len({d.seconds for d in done}) == 1, "each ticket's time is the shared forward's"
        together = {t: dict(handler._held[t]) for t in TICKETS}
        assert handler.handle(HeldTickets()) == sorted(TICKETS)
        for t, rows in TICKETS.items():
            alone = handler.handle(PrefillTicket(f"{t}-alone", rows))
            assert alone.kv_bytes == next(d for d, tid in zip(done, TICKETS, strict=True) if tid == t).kv_bytes
            held = handler._held[f"{t}-alone"]
            assert sorted(held) == sorted(together[t]) == list(range(len(rows)))
            for row in held:
                assert torch.equal(held[row], together[t][row]), f"ticket {t} row {row} differs"
        for t in [*TICKETS, *(f"{t}-alone" for t in TICKETS)]:
            handler.handle(DropTicket(t))
        assert handler.handle(HeldTickets()) == []
    finally:
        handler.close()


def test_a_bad_ticket_fails_alone_and_a_failed_shared_forward_is_retried_ticket_by_ticket() -> None:
    handler = _handler()
    try:
        vocab = handler.model.config.vocab
        poison = (256, 13, 13, 13)  # valid ids the (stubbed) model fails on
        calls = _spy_prefill_batch(handler, fail=lambda rows: len(rows) > 2 or list(poison) in rows)
        items = (
            PrefillTicket("good-1", TICKETS["a"]),
            PrefillTicket("bad-vocab", ((256, vocab),)),
            PrefillTicket("bad-empty", ((256, 1), ())),
            PrefillTicket("poisoned", (poison,)),
            PrefillTicket("good-2", TICKETS["b"]),
        )
        done = handler.handle(PrefillTickets(items))
        assert [type(d) for d in done] == [PrefillDone, PrefillFailed, PrefillFailed, PrefillFailed, PrefillDone]
        assert f"[0, {vocab})" in done[1].message
        assert "row 1 has no tokens" in done[2].message
        assert "out of memory" in done[3].message
        # Invalid tickets never reached the model; the shared forward (3 rows) failed, then each
        # valid ticket ran alone.
        assert calls == [4, 2, 1, 1]
        assert handler.handle(HeldTickets()) == ["good-1", "good-2"]
        alone = handler.model.prefill(list(TICKETS["b"][0]))
        assert torch.equal(handler._held["good-2"][0], alone)
    finally:
        handler.close()


# --- The batcher (pure asyncio) -------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    name: str
    num_tokens: int = 10


def test_batcher_takes_waiting_items_up_to_its_limits_and_gives_turns_one_at_a_time() -> None:
    async def main() -> None:
        ranks = asyncio.Lock()
        gate = asyncio.Event()
        batches: list[list[str]] = []
        turns: list[str] = []

        async def run(items: list[_Item]) -> list[Any]:
            assert ranks.locked()
            batches.append([i.name for i in items])
            if len(batches) == 1:
                await gate.wait()
            return [ValueError(i.name) if i.name == "bad" else f"kv:{i.name}" for i in items]

        batcher = PrefillBatcher(run, ranks, max_batch=3, max_tokens=40)

        async def member(item: _Item) -> str:
            async with batcher.turn(item) as result:
                assert ranks.locked(), "a member's turn runs while its batch holds the ranks"
                turns.append(item.name)
                await asyncio.sleep(0.01)  # a turn that yields: no other turn may start meanwhile
                turns.append(f"/{item.name}")
                return str(result)

        first = asyncio.ensure_future(member(_Item("a")))
        await asyncio.sleep(0)
        names = [_Item("b"), _Item("bad"), _Item("c", 25), _Item("d"), _Item("e")]
        others = [asyncio.ensure_future(member(i)) for i in names]
        await asyncio.sleep(0.01)
        assert batches == [["a"]], "an idle batcher starts at once"
        assert batcher.waiting == 5
        gate.set()
        assert await first == "kv:a"
        results = await asyncio.gather(*others, return_exceptions=True)
        assert results[0] == "kv:b" and isinstance(results[1], ValueError) and results[2:] == ["kv:c", "kv:d", "kv:e"]
        # b + bad + c = 45 tokens > 40: c waits for the next batch (oldest first, nobody jumps it).
        assert batches == [["a"], ["b", "bad"], ["c", "d"], ["e"]]
        assert turns == ["a", "/a", "b", "/b", "c", "/c", "d", "/d", "e", "/e"]
        assert not ranks.locked()

    asyncio.run(main())


def test_batcher_discards_what_it_prefilled_for_a_caller_gone_during_the_run() -> None:
    async def main() -> None:
        ranks = asyncio.Lock()
        running: asyncio.Queue[list[str]] = asyncio.Queue()
        release = asyncio.Semaphore(0)
        discarded: list[tuple[str, Any]] = []

        async def run(items: list[_Item]) -> list[Any]:
            running.put_nowait([i.name for i in items])
            await release.acquire()
            return [f"kv:{i.name}" for i in items]

        batcher = PrefillBatcher(run, ranks, max_batch=4, max_tokens=100,
                                 discard=lambda item, result: discarded.append((item.name, result)))  # fmt: skip

        async def member(name: str) -> Any:
            async with batcher.turn(_Item(name)) as result:
                return result

        a = asyncio.ensure_future(member("a"))
        assert await running.get() == ["a"]
        b, c = asyncio.ensure_future(member("b")), asyncio.ensure_future(member("c"))
        await asyncio.sleep(0)
        c.cancel()  # gone before its batch: never run
        release.release()
        assert await a == "kv:a"
        assert await running.get() == ["b"]
        b.cancel()  # gone while its batch runs: what it was given is discarded
        release.release()
        with pytest.raises(asyncio.CancelledError):
            await b
        await asyncio.wait_for(batcher._loop_task, 5.0)  # type: ignore[arg-type]
        assert batcher.batch_sizes == [1, 1] and discarded == [("b", "kv:b")]
        assert not ranks.locked()

    asyncio.run(main())


# --- The service ------------------------------------------------------------------------------------


class _Ranks:
    """WorkerGroup stand-in: one real rank handler answering in the calling thread. The first
    prefill holds the ranks until `gate` is set; `fail_batches` makes PrefillTickets fail on the
    ranks (what TP > 1 does when the shared forward raises)."""

    def __init__(self, handler: ArRankHandler, fail_batches: bool) -> None:
        self.handler = handler
        self.fail_batches = fail_batches
        self.commands: list[Any] = []
        self.busy = threading.Event()
        self.gate = threading.Event()
        self._lock = threading.Lock()

    def call_all(self, command: Any) -> list[Any]:
        with self._lock:
            self.commands.append(command)
            if isinstance(command, (PrefillTicket, PrefillTickets)) and not self.busy.is_set():
                self.busy.set()
                assert self.gate.wait(20), "the test never released the ranks"
            if isinstance(command, PrefillTickets) and self.fail_batches:
                error = RankError(0, "RuntimeError", "CUDA out of memory (simulated)", "")
                raise WorkerCommandError(command, [error], [None])
            return [self.handler.handle(command)]

    def prefills(self) -> list[tuple[str, ...]]:
        out = []
        for c in self.commands:
            if isinstance(c, PrefillTicket):
                out.append((c.ticket_id,))
            elif isinstance(c, PrefillTickets):
                out.append(tuple(i.ticket_id for i in c.items))
        return out

    def touched(self) -> set[str]:
        ids = {t for p in self.prefills() for t in p}
        return ids | {c.ticket_id for c in self.commands if isinstance(c, (WriteTicket, DropTicket))}


PROMPTS = ["a red fox", "a grey wolf in the snow", "a white owl", "an old oak, watercolor", "a blue whale"]


async def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("max_num_seqs", "fail_batches", "expected"),
    [
        (4, False, [("t0",), ("t1", "t2", "t3")]),
        (1, False, [("t0",), ("t1",), ("t2",), ("t3",)]),
        (4, True, [("t0",), ("t1", "t2", "t3"), ("t1",), ("t2",), ("t3",)]),
    ],
    ids=["batched", "max_num_seqs-1", "batch-fails-on-the-ranks"],
)
def test_tickets_waiting_for_busy_ranks_share_one_prefill_and_a_cancelled_one_is_never_written(
    max_num_seqs: int, fail_batches: bool, expected: list[tuple[str, ...]]
) -> None:
    async def scenario() -> None:
        handler = _handler()
        ranks = _Ranks(handler, fail_batches)
        registry = CollectorRegistry()
        tok = ByteTokenizer()
        async with inprocess_broker(lease_seconds=120.0) as (broker_server, _core):
            receiver = Receiver(broker_server.address, preset="tiny", transport="grpc", world_size=1, num_pages=64)
            await receiver.start()
            channel = grpc.aio.insecure_channel(broker_server.address)
            broker = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            g = receiver.geometry
            cfg = handler.model.config
            identity = ArIdentity("ar-0", "inc-1", "127.0.0.1:1", g.num_layers, g.num_kv_heads, g.head_dim,
                                  g.dtype, PAGE_SIZE, 1, cfg.max_tokens, "grpc", 0, max_num_seqs)  # fmt: skip
            await broker.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=identity.to_proto()), timeout=5.0)
            servicer = ArServicer(broker, ArMetrics.create(registry), lambda reason: None)
            servicer.attach(ArReplicaState(
                replica_id="ar-0", incarnation_id="inc-1", group=ranks, tokenizer=tok,  # type: ignore[arg-type]
                max_tokens=cfg.max_tokens, vocab=cfg.vocab, tensor_parallel_size=1, transport="grpc",
                transfer_timeout_s=10.0, request_timeout_s=30.0,
                max_prefill_batch=max_num_seqs, max_prefill_batch_tokens=4096,
            ))  # fmt: skip
            server = GrpcServer(name="ar-0", host="127.0.0.1", port=0,
                                registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server, servicer, AR_SERVICE)])  # fmt: skip
            await server.start()
            await server.set_serving(True)
            ar_channel = grpc.aio.insecure_channel(server.address)
            try:
                stub = ar_stub(ar_channel)
                tickets = [await receiver.create_ticket([len(tok.encode(p))]) for p in PROMPTS]
                ids = {t.ticket_id: f"t{i}" for i, t in enumerate(tickets)}

                def call(i: int) -> Any:
                    t = tickets[i]
                    request = ar_pb2.PrefillRequest(ticket_id=t.ticket_id, request_id=t.request_id, rows=[PROMPTS[i]])
                    return stub.Prefill(request, timeout=30.0)

                calls = [call(0)]
                assert await asyncio.to_thread(ranks.busy.wait, 10.0), "the first prefill never reached the ranks"
                calls += [call(i) for i in range(1, 5)]
                await _wait_until(lambda: servicer.prefills.waiting == 4, "four tickets waiting for the ranks")
                # The last one's caller goes away while it waits: it must never be prefilled or written.
                calls[4].cancel()
                gone = tickets[4].ticket_id
                await _wait_until(lambda: servicer._jobs[gone].cancel_requested, "the cancel to reach the job")
                ranks.gate.set()

                replies = [await c for c in calls[:4]]
                with pytest.raises(asyncio.CancelledError):
                    await calls[4]
                assert [tuple(ids[t] for t in p) for p in ranks.prefills()] == expected
                assert gone not in ranks.touched()
                # Arming and writes stay per ticket, in order, each after its own prefill.
                assert [ids[c.ticket_id] for c in ranks.commands if isinstance(c, WriteTicket)] == ["t0", "t1", "t2", "t3"]
                shared = len(expected) == 2
                batch_count = registry.get_sample_value("kvrelay_ar_prefill_batch_tickets_count")
                batch_sum = registry.get_sample_value("kvrelay_ar_prefill_batch_tickets_sum")
                assert (batch_count, batch_sum) == ((2.0, 4.0) if shared else (4.0, 4.0))
                assert registry.get_sample_value("kvrelay_ar_prefill_seconds_count") == batch_count
                assert registry.get_sample_value("kvrelay_ar_prefill_tokens_total") == sum(
                    len(tok.encode(p)) for p in PROMPTS[:4]
                )
                for i, reply in enumerate(replies):
                    assert list(reply.token_counts) == [len(tok.encode(PROMPTS[i]))] and reply.bytes_written > 0
                    after = await receiver.ticket(tickets[i].ticket_id)
                    assert after.armed and after.state == broker_pb2.TICKET_STATE_WRITING
                    expect = handler.model.prefill(tok.encode(PROMPTS[i]))
                    assert torch.equal(receiver.row(0, after, 0), expect), f"t{i}'s pages differ from its prefill"
                if shared:
                    # One forward's time for each ticket of the batch.
                    assert len({r.prefill_seconds for r in replies[1:]}) == 1
                # The cancelled ticket was rolled back, never armed, and nothing is left on the ranks.
                await _wait_until(lambda: gone not in servicer._jobs, "the cancelled job to end")
                left = await receiver.ticket(gone)
                assert left.state == broker_pb2.TICKET_STATE_RELEASED
                assert not left.armed
                assert all(w.status == common_pb2.WRITE_STATUS_UNSPECIFIED for w in left.writes), "nothing reported"
                assert left.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED
                assert handler.handle(HeldTickets()) == []
            finally:
                ranks.gate.set()
                await servicer.drain(10.0)
                await ar_channel.close()
                await server.stop(grace=0.5)
                await channel.close()
                await receiver.close()
                handler.close()

    asyncio.run(scenario())


class _ReplacingSender:
    """The rank's real sender, standing in for a Mooncake one that replaced its engine
    `bumps[i]` times during write i (`MooncakeEndpoint.engine_replacements` is cumulative)."""

    def __init__(self, sender: Any, bumps: list[int]) -> None:
        self._sender = sender
        self._bumps = bumps
        self.engine_replacements = 0

    def write(self, *args: Any, **kwargs: Any) -> Any:
        outcomes = self._sender.write(*args, **kwargs)
        self.engine_replacements += self._bumps.pop(0)
        return outcomes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sender, name)


def test_engine_replacements_a_rank_reports_with_its_writes_are_counted_once() -> None:
    """kvrelay_ar_mooncake_engine_replacements_total{rank}: a rank's sender that started fresh
    engines (a peer on a dead one's port) is visible on the AR's metrics, each replacement once
    although every write answer carries the rank's total so far."""

    async def scenario() -> None:
        handler = _handler()
        handler.sender = _ReplacingSender(handler.sender, [1, 0, 2])
        ranks = _Ranks(handler, fail_batches=False)
        ranks.gate.set()
        registry = CollectorRegistry()
        tok = ByteTokenizer()
        async with inprocess_broker(lease_seconds=120.0) as (broker_server, _core):
            receiver = Receiver(broker_server.address, preset="tiny", transport="grpc", world_size=1, num_pages=64)
            await receiver.start()
            channel = grpc.aio.insecure_channel(broker_server.address)
            broker = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
            g = receiver.geometry
            cfg = handler.model.config
            identity = ArIdentity("ar-0", "inc-1", "127.0.0.1:1", g.num_layers, g.num_kv_heads, g.head_dim,
                                  g.dtype, PAGE_SIZE, 1, cfg.max_tokens, "grpc", 0, 1)  # fmt: skip
            await broker.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=identity.to_proto()), timeout=5.0)
            servicer = ArServicer(broker, ArMetrics.create(registry), lambda reason: None)
            servicer.attach(ArReplicaState(
                replica_id="ar-0", incarnation_id="inc-1", group=ranks, tokenizer=tok,  # type: ignore[arg-type]
                max_tokens=cfg.max_tokens, vocab=cfg.vocab, tensor_parallel_size=1, transport="grpc",
                transfer_timeout_s=10.0, request_timeout_s=30.0,
            ))  # fmt: skip
            server = GrpcServer(name="ar-0", host="127.0.0.1", port=0,
                                registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server, servicer, AR_SERVICE)])  # fmt: skip
            await server.start()
            await server.set_serving(True)
            ar_channel = grpc.aio.insecure_channel(server.address)
            try:
                stub = ar_stub(ar_channel)
                counted = []
                for prompt in PROMPTS[:3]:
                    t = await receiver.create_ticket([len(tok.encode(prompt))])
                    request = ar_pb2.PrefillRequest(ticket_id=t.ticket_id, request_id=t.request_id, rows=[prompt])
                    reply = await stub.Prefill(request, timeout=30.0)
                    assert reply.bytes_written > 0
                    counted.append(registry.get_sample_value(
                        "kvrelay_ar_mooncake_engine_replacements_total", {"rank": "0"}
                    ))  # fmt: skip
                assert counted == [1.0, 1.0, 3.0]
            finally:
                await servicer.drain(10.0)
                await ar_channel.close()
                await server.stop(grace=0.5)
                await channel.close()
                await receiver.close()
                handler.close()

    asyncio.run(scenario())
