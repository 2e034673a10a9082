"""In-process tests of the AR's pieces: the write ledger's answers to broker polls, and the rank
handler's rule that a ticket's KV is freed once every write has a final outcome."""

from __future__ import annotations

from typing import Any

import grpc
import torch

from kvrelay.ar_service.engine import (
    ArRankHandler,
    ArRankSpec,
    DropTicket,
    HeldTickets,
    PrefillTicket,
    WriteTicket,
)
from kvrelay.ar_service.sender import WriteLedger
from kvrelay.models.ar import build_ar_model
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import get_preset
from kvrelay.transfer.planner import PlannedWrite, RowSpec, Segment, plan_transfer
from kvrelay.transfer.transport import RegionDescriptor, WriteOutcome
from kvrelay.worker import RankContext

W0 = PlannedWrite(0, 0, 0, (Segment(0, 0, 64),))
W1 = PlannedWrite(1, 0, 0, (Segment(64, 128, 64),))


def test_poll_answers_follow_what_the_writer_knows() -> None:
    ledger = WriteLedger()
    # Arming in flight: the broker may already expect writes we do not know yet.
    ledger.begin_arming("t1")
    unresolved, report = ledger.answer_poll([("t1", 0, 0, 0)])
    assert unresolved == [("t1", 0, 0, 0)] and report == []
    assert ledger.start("t1", [W0, W1])
    unresolved, report = ledger.answer_poll([("t1", 0, 0, 0), ("t1", 1, 0, 0)])
    assert sorted(unresolved) == [("t1", 0, 0, 0), ("t1", 1, 0, 0)] and report == []
    ok = WriteOutcome(0, 0, 0, "OK", 64, 123)
    ledger.finish("t1", ok)
    unresolved, report = ledger.answer_poll([("t1", 0, 0, 0), ("t1", 1, 0, 0)])
    assert unresolved == [("t1", 1, 0, 0)] and report == [("t1", ok)]
    assert ledger.busy_tickets() == ["t1"]
    # The first final outcome wins: a later, different one is never reported.
    assert ledger.finish("t1", WriteOutcome(0, 0, 0, "FAILED", 64, 1)) == ok


def test_a_write_never_heard_of_is_not_started_and_can_never_start() -> None:
    ledger = WriteLedger()
    unresolved, report = ledger.answer_poll([("t2", 0, 0, 0)])
    assert unresolved == []
    assert [(tid, o.status) for tid, o in report] == [("t2", "NOT_STARTED")]
    # The ReserveTicket answer arriving late must not start what was answered NOT_STARTED.
    assert not ledger.start("t2", [W0])
    assert ledger.in_flight() == []


def test_unacknowledged_reports_stay_pending_until_acknowledged() -> None:
    ledger = WriteLedger()
    ledger.start("t3", [W0, W1])
    a, b = WriteOutcome(0, 0, 0, "OK", 64, 9), WriteOutcome(1, 0, 0, "NOT_STARTED", 0, 0)
    ledger.finish("t3", a)
    ledger.finish("t3", b)
    assert sorted(o.row for _, o in ledger.pending_reports()) == [0, 1]
    ledger.acknowledge("t3", a)
    assert [o.row for _, o in ledger.pending_reports()] == [1]
    assert ledger.busy_tickets() == []


def _handler(staging_bytes: int = 1 << 20) -> ArRankHandler:
    ctx = RankContext(rank=0, world_size=1, device="cpu", backend="gloo", num_threads=1, tp=TpGroup.single())
    spec = ArRankSpec(preset="tiny", path=None, weight_seed=0, dtype=None, transport="grpc", hostname="127.0.0.1",
                      staging_bytes=staging_bytes)  # fmt: skip
    return ArRankHandler(ctx, spec)


def _write_command(ticket_id: str, counts: list[int], endpoint: str) -> WriteTicket:
    geometry = get_preset("tiny").kv_geometry(16)
    rows, page = [], 0
    for row, n in enumerate(counts):
        pages = geometry.pages_for(n)
        rows.append(RowSpec(row, n, tuple(range(page, page + pages))))
        page += pages
    plan = plan_transfer(geometry, 1, 1, rows)
    region = RegionDescriptor(0, "grpc", endpoint, 0, 64 << 20)
    return WriteTicket(ticket_id, tuple(rows), geometry, 1, 1, plan, (region,), timeout_s=2.0)


def test_prefill_matches_the_model_and_kv_is_freed_after_failed_writes() -> None:
    handler = _handler()
    ids = (256, 104, 105, 33)
    done = handler.handle(PrefillTicket("t", (ids, ids[:2])))
    assert done.token_counts == (4, 2) and done.kv_bytes > 0
    assert torch.equal(handler._held["t"][0], build_ar_model(preset="tiny", seed=0).prefill(list(ids)))
    assert handler.handle(HeldTickets()) == ["t"]
    # Nobody listens at port 1: each write gets a final non-OK outcome, and the KV is gone.
    result = handler.handle(_write_command("t", [4, 2], "127.0.0.1:1"))
    assert [(o.row, o.status in ("FAILED", "NOT_STARTED")) for o in result.outcomes] == [(0, True), (1, True)]
    assert handler.handle(HeldTickets()) == []
    handler.close()


def test_staging_too_small_is_not_started_and_frees_the_kv() -> None:
    handler = _handler(staging_bytes=1024)
    handler.handle(PrefillTicket("t", ((256, 1, 2),)))
    result = handler.handle(_write_command("t", [3], "127.0.0.1:1"))
    assert [o.status for o in result.outcomes] == ["NOT_STARTED"]
    assert "kv_cache_memory_bytes" in result.outcomes[0].message
    assert handler.handle(HeldTickets()) == []
    # A ticket that is never written is dropped explicitly.
    handler.handle(PrefillTicket("u", ((256, 1),)))
    handler.handle(DropTicket("u"))
    assert handler.handle(HeldTickets()) == []
    handler.close()


# --- In doubt: the ledger keeps the write unresolved; the rank keeps its staging region.


def test_an_in_doubt_write_stays_unresolved_until_its_final_outcome() -> None:
    ledger = WriteLedger()
    ledger.start("t4", [W0])
    doubt = WriteOutcome(0, 0, 0, "IN_DOUBT", 64, 5, "still in the engine")
    assert ledger.finish("t4", doubt) == doubt
    ledger.acknowledge("t4", doubt)  # the broker took the IN_DOUBT report: not the end of it
    assert ledger.needs_collect() and ledger.in_doubt() == [("t4", doubt)]
    unresolved, report = ledger.answer_poll([("t4", 0, 0, 0)])
    assert unresolved == [("t4", 0, 0, 0)] and report == [], "in doubt is unresolved, never NOT_STARTED"
    assert ledger.busy_tickets() == ["t4"]
    final = WriteOutcome(0, 0, 0, "OK", 64, 5)
    assert ledger.finish("t4", final) == final
    assert not ledger.needs_collect() and ledger.in_flight() == []
    assert ledger.pending_reports() == [("t4", final)]
    unresolved, report = ledger.answer_poll([("t4", 0, 0, 0)])
    assert unresolved == [] and report == [("t4", final)]
    # A stale in-doubt word after the final one changes nothing.
    assert ledger.finish("t4", doubt) == final


def test_rank_keeps_the_staging_region_of_an_in_doubt_write_and_packs_the_next_ticket_elsewhere() -> None:
    import threading

    import numpy as np

    from kvrelay.ar_service.engine import CollectFinished
    from kvrelay.transfer import mooncake

    ctx = RankContext(rank=0, world_size=1, device="cpu", backend="gloo", num_threads=1, tp=TpGroup.single())
    spec = ArRankSpec(preset="tiny", path=None, weight_seed=0, dtype=None, transport="mooncake",
                      hostname="127.0.0.1", staging_bytes=1 << 20)  # fmt: skip
    handler = ArRankHandler(ctx, spec)
    sender: Any = handler.sender
    pool = np.zeros(4 << 20, dtype=np.uint8)
    region = mooncake.endpoint("127.0.0.1").register_region(pool, 0)
    gate, real, calls = threading.Event(), sender._transfer, []

    def transfer(*args: Any) -> int:
        calls.append(args)
        if len(calls) == 1:
            gate.wait(30)  # the first ticket's call hangs in the engine
        return real(*args)

    sender._transfer = transfer
    try:
        def command(ticket_id: str, first_page: int, n: int) -> WriteTicket:
            geometry = get_preset("tiny").kv_geometry(16)
            rows = (RowSpec(0, n, tuple(range(first_page, first_page + geometry.pages_for(n)))),)
            plan = plan_transfer(geometry, 1, 1, rows)
            dest = RegionDescriptor(0, "mooncake", region.endpoint, region.base_address, region.length)
            return WriteTicket(ticket_id, rows, geometry, 1, 1, plan, (dest,), timeout_s=0.3)

        handler.handle(PrefillTicket("a", (tuple(range(40)),)))
        a = handler.handle(command("a", 0, 40))
        assert [o.status for o in a.outcomes] == ["IN_DOUBT"]
        held = handler.regions.region("a")
        assert held is not None and held.readers == 1
        a_bytes = handler.staging[held.offset : held.end].clone()
        # The second ticket does not wait for the first's in-doubt call: it packs elsewhere.
        handler.handle(PrefillTicket("b", (tuple(range(200, 233)),)))
        b = handler.handle(command("b", 8, 33))
        assert [o.status for o in b.outcomes] == ["OK"]
        assert torch.equal(handler.staging[held.offset : held.end], a_bytes), "a's staging was repacked"
        pending = handler.handle(CollectFinished())
        assert pending.finished == () and pending.in_doubt_tickets == ("a",)
        gate.set()
        for _ in range(500):
            done = handler.handle(CollectFinished())
            if done.finished:
                break
            threading.Event().wait(0.01)
        assert [(t, [o.status for o in outs]) for t, outs in done.finished] == [("a", ["OK"])]
        assert done.in_doubt_tickets == () and handler.regions.held() == []
        assert done.finished[0][1][0].checksum == a.outcomes[0].checksum
    finally:
        gate.set()
        del sender._transfer
        handler.close()


# --- Unknown is never final: a write sent to a rank that gave no outcome stays IN_DOUBT.


def test_a_sent_write_without_an_outcome_is_in_doubt_never_failed() -> None:
    from kvrelay.ar_service.sender import settle_outcomes

    ok = WriteOutcome(0, 0, 0, "OK", 64, 7)
    # Rank 0 answered for W0; the rank that had W1 raised (or its answer was lost) mid-call.
    settled = settle_outcomes([W0, W1], [ok], sent=True, why="rank error")
    assert settled[0] == ok
    assert (settled[1].status, settled[1].final, settled[1].message) == ("IN_DOUBT", False, "rank error")
    # Never sent: provably nothing of it will land.
    assert [o.status for o in settle_outcomes([W0, W1], [], sent=False)] == ["NOT_STARTED"] * 2
    # The ledger keeps it unresolved (pages held at the broker) until CollectFinished says more.
    ledger = WriteLedger()
    assert ledger.start("t5", [W0, W1])
    for o in settled:
        ledger.finish("t5", o)
    assert ledger.needs_collect()
    unresolved, report = ledger.answer_poll([("t5", 1, 0, 0)])
    assert unresolved == [("t5", 1, 0, 0)] and report == []


def test_a_ticket_whose_writes_have_outcomes_can_never_start_again() -> None:
    ledger = WriteLedger()
    assert ledger.start("t6", [W0])
    ledger.finish("t6", WriteOutcome(0, 0, 0, "NOT_STARTED", 0, 0, "the request ended"))
    # A second attempt (a retried Prefill) would send bytes behind a final NOT_STARTED report.
    assert not ledger.start("t6", [W0])
    assert ledger.start("t7", [W1]) and not ledger.start("t7", [W1]), "already in flight"


def test_an_error_before_the_send_is_not_started_and_after_it_never_final() -> None:
    from kvrelay.ar_service.engine import write_rank_share

    class Sender:
        def __init__(self, error: Exception | None) -> None:
            self.error, self.calls = error, 0

        def write(self, *args: Any) -> list[WriteOutcome]:
            self.calls += 1
            if self.error is not None:
                raise self.error
            return [WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, 1) for w in args[1]]

    handler = _handler()
    cmd = _write_command("t", [4], "127.0.0.1:1")

    def boom() -> None:
        raise RuntimeError("on_packed failed")

    # Raised before the sender was called: an outcome, NOT_STARTED, and the region handed back.
    handler.handle(PrefillTicket("t", ((256, 1, 2, 3),)))
    sender = Sender(None)
    done = write_rank_share(0, handler.staging, sender, handler._held["t"], cmd, on_packed=boom,
                            regions=handler.regions)  # fmt: skip
    assert sender.calls == 0 and [o.status for o in done.outcomes] == ["NOT_STARTED"]
    assert "on_packed failed" in done.outcomes[0].message and handler.regions.held() == []
    # The sender itself raised mid-call: in doubt, the region stays held (never FAILED).
    sender = Sender(RuntimeError("engine exploded"))
    done = write_rank_share(0, handler.staging, sender, handler._held["t"], cmd, regions=handler.regions)
    assert [o.status for o in done.outcomes] == ["IN_DOUBT"]
    assert [r.ticket_id for r in handler.regions.held()] == ["t"]
    handler.close()


# --- The write protocol (pure): events in, commands out.

W2 = PlannedWrite(0, 1, 0, (Segment(0, 192, 64),))  # rank 1's write


def _armed(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(plan_mismatch="", writing=True, ticket_state="TICKET_STATE_WRITING",
                                transfer_timeout_s=5.0, deadline_left_s=2.0)  # fmt: skip
    args.update(kw)
    return args


def test_write_protocol_ends_with_nothing_sent_before_the_send() -> None:
    from kvrelay.ar_service.sender import EndWrites, WriteProtocol

    for kw, reason in [
        (dict(plan_mismatch="plan.writes differ"), "PLAN_MISMATCH"),
        (dict(writing=False, ticket_state="TICKET_STATE_ABORTED"), "REQUEST_ENDED"),
        (dict(deadline_left_s=0.01), "DEADLINE_EXCEEDED"),
    ]:
        end = WriteProtocol("t", [W0, W2], 0.05).on_armed(**_armed(**kw))
        assert isinstance(end, EndWrites) and not end.sent and not end.in_doubt
        assert end.failure is not None and end.failure.reason == reason
        assert [o.status for o in end.outcomes] == ["NOT_STARTED", "NOT_STARTED"]


def test_write_protocol_never_turns_an_unknown_into_failed() -> None:
    from kvrelay.ar_service.sender import SendWrites, WriteProtocol

    p = WriteProtocol("t", [W0, W2], 0.05)
    assert p.on_armed(**_armed()) == SendWrites(2.0)  # min(transfer timeout, deadline left)
    ok = WriteOutcome(0, 0, 0, "OK", 64, 1)
    # Rank 1 raised while its call may still run: rank 0's OK stands, rank 1's write is in doubt.
    end = p.on_rank_error([ok], "rank 1 raised")
    assert [o.status for o in end.outcomes] == ["OK", "IN_DOUBT"] and end.in_doubt and end.sent
    assert end.failure is not None and end.failure.reason == "WRITE_FAILED"
    # A rank died mid-write: every write is in doubt until the incarnation is seen gone.
    assert [o.status for o in p.on_ranks_lost("rank 1 died").outcomes] == ["IN_DOUBT", "IN_DOUBT"]
    # A rank that answered without an outcome for its write: in doubt, the request times out.
    end = p.on_written([ok])
    assert [o.status for o in end.outcomes] == ["OK", "IN_DOUBT"]
    assert end.failure is not None and end.failure.reason == "TRANSFER_TIMEOUT" and end.ok_bytes == 64
    # Every call returned: a final failure is final, success answers with the bytes.
    failed = WriteOutcome(0, 1, 0, "FAILED", 64, 2, "peer said no")
    end = p.on_written([ok, failed])
    assert not end.in_doubt and end.failure is not None and end.failure.reason == "TRANSFER_FAILED"
    end = p.on_written([ok, WriteOutcome(0, 1, 0, "OK", 64, 2)])
    assert end.failure is None and end.ok_bytes == 128


def test_prefill_then_arming_decisions() -> None:
    from kvrelay.ar_service.sender import Abandon, Arm, after_arming, after_prefill
    from kvrelay.errors import KvRelayServerError

    assert after_prefill(cancel_requested=False, deadline_left_s=1.0, min_transfer_s=0.05) == Arm()
    cancelled = after_prefill(cancel_requested=True, deadline_left_s=1.0, min_transfer_s=0.05)
    assert isinstance(cancelled, Abandon) and cancelled.rollback == "CANCELLED"
    late = after_prefill(cancel_requested=False, deadline_left_s=0.05, min_transfer_s=0.05)
    assert isinstance(late, Abandon) and late.rollback == "TIMED_OUT"
    assert late.failure.reason == "TIMED_OUT"
    # Once arming was asked for, nothing rolls back: the broker's answer decides.
    lost = after_arming(None)
    assert lost is not None and lost.rollback is None and lost.failure.reason == "BROKER_UNAVAILABLE"
    refused = KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, "FENCED", "stale incarnation")
    assert after_arming(refused) == Abandon(refused)
    assert after_arming(object()) is None


def test_sent_bytes_are_counted_by_source_rank_and_outcome_and_not_started_sends_nothing() -> None:
    from prometheus_client import CollectorRegistry

    from kvrelay.ar_service.service import ArMetrics

    registry = CollectorRegistry()
    metrics = ArMetrics.create(registry)
    metrics.record_sent("mooncake", [
        WriteOutcome(0, 0, 1, "OK", 100, 1),
        WriteOutcome(1, 0, 1, "OK", 30, 2),
        WriteOutcome(0, 1, 0, "FAILED", 40, 3, "refused"),
        WriteOutcome(1, 1, 0, "IN_DOUBT", 50, 0, "call still running"),
        WriteOutcome(0, 2, 0, "NOT_STARTED", 0, 0),
    ])  # fmt: skip
    counted = {
        (s.labels["rank"], s.labels["transport"], s.labels["outcome"]): s.value
        for family in registry.collect() if family.name == "kvrelay_ar_sent_bytes"
        for s in family.samples if s.name.endswith("_total")
    }
    assert counted == {
        ("0", "mooncake", "ok"): 130.0, ("1", "mooncake", "failed"): 40.0, ("1", "mooncake", "in_doubt"): 50.0,
    }  # fmt: skip


def test_a_mooncake_ar_exports_each_ranks_engine_replacements_from_zero() -> None:
    """The dashboard's panel queries kvrelay_ar_mooncake_engine_replacements_total: a node that
    never replaced an engine has the series at 0 (one per rank), and increase() counts the first."""
    from prometheus_client import CollectorRegistry

    from kvrelay.ar_service.service import ArMetrics

    def replacements(registry: CollectorRegistry) -> dict[str, float]:
        return {
            s.labels["rank"]: s.value
            for family in registry.collect() if family.name == "kvrelay_ar_mooncake_engine_replacements"
            for s in family.samples if s.name.endswith("_total")
        }

    registry = CollectorRegistry()
    ArMetrics.create(registry, mooncake_ranks=2)
    assert replacements(registry) == {"0": 0.0, "1": 0.0}
    other = CollectorRegistry()
    ArMetrics.create(other)  # not a Mooncake sender: nothing to say
    assert replacements(other) == {}


def test_tokenize_leaves_the_event_loop_free_while_a_long_prompt_is_encoded() -> None:
    # Found black-box: 12 Generate calls with 1 MiB prompts (3 tokens each under the demo's
    # vocabulary: accepted) held the AR's event loop ~27 s; a 0.2 s generation took 31 s and
    # others got UNAVAILABLE AR_UNAVAILABLE. The tokenizer now runs in a thread, GIL released.
    import asyncio
    import random
    import string
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    import kvrelay.models
    from kvrelay.ar_service.service import ArMetrics, ArServicer
    from kvrelay.models.tokenizer import BagelTokenizer
    from kvrelay.v1 import ar_pb2

    tokenizer = BagelTokenizer(Path(kvrelay.models.__file__).parent / "demo")
    text = "".join(random.Random(0).choice(string.ascii_letters) for _ in range(1 << 20))
    started = time.perf_counter()
    expected = len(tokenizer.encode(text))
    encode_s = time.perf_counter() - started
    servicer = ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None)
    servicer.state = SimpleNamespace(tokenizer=tokenizer, max_tokens=256)  # type: ignore[assignment]

    async def body() -> tuple[list[int], float]:
        stop = asyncio.Event()

        async def ticker() -> float:
            worst = 0.0
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.01)
                worst = max(worst, time.perf_counter() - t0 - 0.01)
            return worst

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        reply = await servicer.Tokenize(ar_pb2.TokenizeRequest(texts=[text, text]), None)  # type: ignore[arg-type]
        stop.set()
        return list(reply.token_counts), await task

    counts, worst_stall = asyncio.run(body())
    assert counts == [expected, expected]
    assert worst_stall < max(0.3, encode_s / 3), (worst_stall, encode_s)


def _arming_and_plan() -> tuple[Any, Any, tuple[PlannedWrite, ...]]:
    """A ReserveTicketResponse as the broker answers it (AR TP=1 -> DiT TP=2, two rows) and the
    TicketPlan the broker hands with Prefill for the same ticket."""
    from kvrelay.transfer.convert import geometry_to_proto, write_to_proto
    from kvrelay.v1 import broker_pb2, common_pb2

    geometry = get_preset("tiny").kv_geometry(16)
    rows = (RowSpec(0, 40, (3, 4, 5)), RowSpec(1, 7, (9,)))
    writes = plan_transfer(geometry, 1, 2, rows)
    ticket = broker_pb2.Ticket(
        ticket_id="t1", request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", sequence=7,
        state=broker_pb2.TICKET_STATE_WRITING, armed=True,
        rows=[common_pb2.RowPages(row=r.row, num_tokens=r.num_tokens, page_ids=r.page_ids) for r in rows],
    )  # fmt: skip
    regions = [
        common_pb2.MemoryRegion(rank=r, transport=common_pb2.TRANSPORT_KIND_MOONCAKE, endpoint="127.0.0.1:17000",
                                base_address=0x7F0000000000 + r * (1 << 24), length=1 << 24)
        for r in (0, 1)
    ]  # fmt: skip
    common = dict(
        destinations=regions, writes=[write_to_proto(w) for w in writes], dit_geometry=geometry_to_proto(geometry),
        dit_parallelism=common_pb2.Parallelism(tensor_parallel_size=2, sequence_parallel_size=1, cfg_parallel_size=1),
        dit_num_pages=32, verify_checksums=True,
    )  # fmt: skip
    arming = broker_pb2.ReserveTicketResponse(ticket=ticket, **common)
    plan_ticket = broker_pb2.Ticket()
    plan_ticket.CopyFrom(ticket)
    plan_ticket.state, plan_ticket.armed = broker_pb2.TICKET_STATE_RESERVED, False
    plan = broker_pb2.TicketPlan(ticket=plan_ticket, src_shards=1, **common)
    return arming, plan, writes


def test_arming_mismatch_names_every_field_a_plan_could_redirect_writes_with() -> None:
    """The AR writes where the broker's arming reply says; a Prefill plan that differs from it
    in anything that decides where bytes land is named, as is an arming reply whose writes leave
    the ticket's own pages (ar_service/sender.py arming_mismatch)."""
    from kvrelay.ar_service.sender import arming_mismatch

    arming, plan, writes = _arming_and_plan()
    # The genuine plan (it differs from arming only in the ticket's state) and no plan at all.
    assert arming_mismatch(arming, plan, writes) == ""
    assert arming_mismatch(arming, None, writes) == ""

    def tampered(change: Any) -> Any:
        forged = type(plan)()
        forged.CopyFrom(plan)
        change(forged)
        return forged

    cases = {
        "plan.ticket.ticket_id": lambda p: setattr(p.ticket, "ticket_id", "t2"),
        "plan.ticket.dit_replica_id": lambda p: setattr(p.ticket, "dit_replica_id", "dit-1"),
        "plan.ticket.sequence": lambda p: setattr(p.ticket, "sequence", 8),
        "plan.ticket.rows": lambda p: p.ticket.rows[0].page_ids.__setitem__(0, 20),
        "plan.writes": lambda p: setattr(p.writes[0].segments[0], "dst_offset", p.writes[0].segments[0].dst_offset + 1),
        "plan.destinations": lambda p: setattr(p.destinations[1], "base_address", p.destinations[0].base_address),
        "plan.dit_geometry": lambda p: setattr(p.dit_geometry, "page_size", 32),
        "plan.dit_parallelism": lambda p: setattr(p.dit_parallelism, "tensor_parallel_size", 1),
        "plan.dit_num_pages": lambda p: setattr(p, "dit_num_pages", 64),
    }
    for field_name, change in cases.items():
        got = arming_mismatch(arming, tampered(change), writes)
        assert got.startswith(field_name), (field_name, got)
    # Another DiT endpoint (a restarted replica's old port): destinations.
    assert arming_mismatch(arming, tampered(lambda p: setattr(p.destinations[0], "endpoint", "10.0.0.9:1")), writes)

    # The arming reply itself must be the plan of its own pages: writes past them are refused...
    shifted = type(arming)()
    shifted.CopyFrom(arming)
    shifted.writes[0].segments[0].dst_offset += 1
    assert arming_mismatch(shifted, None, writes).startswith("ReserveTicketResponse.writes")
    # ...and so are pages outside the DiT's pool (writes planned for them, consistently).
    outside = type(arming)()
    outside.CopyFrom(arming)
    outside.dit_num_pages = 5
    assert "outside the DiT pool" in arming_mismatch(outside, None, writes)
