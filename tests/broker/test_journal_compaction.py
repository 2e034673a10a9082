"""Journal retention: finished generations past `result_ttl_seconds` leave the journal in bounded
batches, their pages go back to the filesystem, and nothing replay needs goes with them.

Found black-box: the journal never shrank (86 MB, 96% free pages, for 996 rows, all expired):
SQLite keeps a deleted row's pages unless auto_vacuum is on, and expired generations were
deleted only when someone next asked for a generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from kvrelay.broker.compaction import JournalCompactor
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import GenerationParams, GenerationStore, GenState, ImageResult
from kvrelay.broker.journal import Journal
from kvrelay.broker.tickets import TicketState
from kvrelay.v1 import generation_pb2 as G
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, full_lifecycle
from tests.orchestrator.harness import cluster, collect, request, run

TTL = 60.0
PNG_BYTES = 40_000


def _params(seed: int) -> GenerationParams:
    return GenerationParams("a cat", "", seed, 64, 64, 1, 1.0)


def finish_generations(store: GenerationStore, ids: list[str], png_bytes: int = PNG_BYTES) -> None:
    for n, request_id in enumerate(ids):
        record, _ = store.create_or_attach(request_id, _params(n), True)
        store.update(record, GenState.SUCCEEDED, image=ImageResult(os.urandom(png_bytes), 64, 64, n))
        store.persist(record)


def journal_rows(path: Path) -> dict[str, set[str]]:
    db = sqlite3.connect(path)
    try:
        return {
            "tickets": {r[0] for r in db.execute("SELECT ticket_id FROM tickets")},
            "generations": {r[0] for r in db.execute("SELECT request_id FROM generations")},
            "blobs": {r[0] for r in db.execute("SELECT key FROM blobs")},
        }
    finally:
        db.close()


def build_then_die(path: str, report: str, expired: int) -> None:
    """The broker's side of the kill test, run in a child process: released, DRAINING and WRITING
    tickets, `expired` generations past retention and one within it; one compaction pass; then
    SIGKILL (no close, no checkpoint: what the disk and WAL hold is all that survives)."""
    wall = [1_000_000.0]
    mono = ManualClock()
    core = BrokerCore(path, clock=mono, drain_quiet_seconds=2.0, journal_synchronous="NORMAL")
    ar, dit = ar_spec(), dit_spec(num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    for n in range(40):  # ended tickets leave the journal in the commit that releases them
        full_lifecycle(core, ar, dit, f"done-{n}", [16])
    draining = core.create_ticket("draining", "ar-0", "dit-0", [16, 16])
    writing = core.create_ticket("writing", "ar-0", "dit-0", [16])
    assert draining is not None and writing is not None
    core.arm_ticket(draining.ticket_id, "ar-0", ar.incarnation_id)
    core.arm_ticket(writing.ticket_id, "ar-0", ar.incarnation_id)
    assert core.cancel_ticket(draining.ticket_id).state is TicketState.DRAINING
    store = GenerationStore(
        result_ttl_seconds=TTL, max_results=100_000, clock=mono, wall_clock=lambda: wall[0], journal=core.journal
    )
    finish_generations(store, [f"old-{n}" for n in range(expired)])
    mono.advance(TTL + 1)
    wall[0] += TTL + 1
    finish_generations(store, ["kept"])
    core.journal.checkpoint()
    before = core.journal.page_stats()
    size_before = core.journal.size_bytes()
    compactor = JournalCompactor(core.journal, store)
    result = asyncio.run(compactor.compact_once())
    after = core.journal.page_stats()
    Path(report).write_text(json.dumps({
        "draining": draining.ticket_id, "writing": writing.ticket_id,
        "ar_incarnation": ar.incarnation_id, "dit_incarnation": dit.incarnation_id,
        "kept_png": store.get("kept").image.png.hex(),  # type: ignore[union-attr]
        "before": before, "after": after, "size_before": size_before, "size_after": core.journal.size_bytes(),
        "rows_deleted": result.rows_deleted, "steps": result.steps, "longest_step_ms": result.longest_step_ms,
        "metric_rows": compactor.rows_deleted, "metric_bytes": compactor.bytes_reclaimed,
    }))  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)


def test_expired_generations_leave_the_file_shrinks_and_what_replay_needs_survives_a_kill(
    repo_root: Path, tmp_path: Path
) -> None:
    path, report, expired = tmp_path / "broker.sqlite", tmp_path / "report.json", 300
    script = f"from tests.broker.test_journal_compaction import build_then_die; build_then_die({str(path)!r}, {str(report)!r}, {expired})"
    child = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(repo_root)})  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    got: dict[str, Any] = json.loads(report.read_text())

    # The expired rows and their PNGs are gone; the one within retention and the live tickets are not.
    rows = journal_rows(path)
    assert rows == {"tickets": {got["draining"], got["writing"]}, "generations": {"kept"}, "blobs": {"kept"}}
    # The access that expired them (the "kept" generation's end) deleted one batch of 32; the
    # pass the rest, one batch per transaction, then the page steps.
    assert got["metric_rows"] == expired and got["rows_deleted"] == expired - 32
    assert got["steps"] >= (expired - 32) // 32 + 1
    # The file shrank: its pages (page_count * page_size) and the bytes on disk.
    (pages_before, _, page_size), (pages_after, free_after, _) = got["before"], got["after"]
    assert free_after == 0
    assert pages_after * page_size < pages_before * page_size / 20, (got["before"], got["after"])
    assert got["size_after"] < got["size_before"] / 20 and got["metric_bytes"] > 0
    assert path.stat().st_size <= pages_after * page_size

    # Replay after the kill: the DRAINING ticket stays DRAINING, the WRITING one drains, both keep
    # their pages; the incarnations are the journaled ones; the kept generation is served.
    clock = ManualClock()
    core = BrokerCore(path, clock=clock, drain_quiet_seconds=2.0, journal_synchronous="NORMAL")
    try:
        assert core.get_ticket(got["draining"]).state is TicketState.DRAINING
        assert core.get_ticket(got["writing"]).state is TicketState.DRAINING
        (pool,) = core.pool_status("dit-0")
        assert (pool.free, pool.draining) == (64 - 3, 3)
        assert core.get_replica("ar-0").spec.incarnation_id == got["ar_incarnation"]
        assert core.get_replica("dit-0").spec.incarnation_id == got["dit_incarnation"]
        store = GenerationStore(result_ttl_seconds=TTL, max_results=100, journal=core.journal,
                                wall_clock=lambda: 1_000_000.0 + TTL + 2)  # fmt: skip
        assert store.restore() == 1
        image = store.get("kept").image
        assert image is not None and image.png.hex() == got["kept_png"]
    finally:
        core.close()


def test_a_journal_from_before_auto_vacuum_is_vacuumed_once_at_open(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path, isolation_level=None)  # as journal.py created it before
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(
        "CREATE TABLE tickets (ticket_id TEXT PRIMARY KEY, data TEXT NOT NULL);"
        "CREATE TABLE generations (request_id TEXT PRIMARY KEY, data TEXT NOT NULL);"
    )
    db.executemany("INSERT INTO generations VALUES (?, ?)", [(f"r{n}", "x" * 50_000) for n in range(200)])
    db.execute("INSERT INTO tickets VALUES ('t0', '{\"state\": \"DRAINING\"}')")
    db.execute("DELETE FROM generations")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    before = path.stat().st_size
    assert before > 5_000_000

    journal = Journal(path, "NORMAL")
    try:
        assert journal._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # noqa: SLF001 - INCREMENTAL
        assert journal.size_bytes() < before / 50
        assert journal.load().tickets == {"t0": {"state": "DRAINING"}}
        # From now on deleted rows' pages go back in bounded steps.
        journal.commit(generations={f"g{n}": {"png": os.urandom(20_000)} for n in range(50)})
        journal.commit(generations={f"g{n}": None for n in range(50)})
        assert journal.reclaim(64) == 64
        while journal.reclaim(64):
            pass
        assert journal.page_stats()[1] == 0
    finally:
        journal.close()


def test_a_journal_written_back_after_deletion_keeps_incremental_vacuum(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path, "NORMAL")
    try:
        journal.commit(tickets={"t0": {"state": "DRAINING"}})
        for name in ("journal.sqlite", "journal.sqlite-wal", "journal.sqlite-shm"):
            (tmp_path / name).unlink(missing_ok=True)
        assert journal.keep_on_disk()
        assert journal._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # noqa: SLF001
        journal.commit(generations={"g": {"png": os.urandom(200_000)}})
        journal.commit(generations={"g": None})
        assert journal.reclaim(1_000) > 40
    finally:
        journal.close()
    assert Journal(path, "NORMAL").load().tickets == {"t0": {"state": "DRAINING"}}


def test_compaction_under_rpc_load_fails_no_rpc_and_keeps_what_is_retained(tmp_path: Path) -> None:
    """Thousands of rows past retention compacted in many short steps while clients generate, get
    and list: every RPC succeeds, the expired rows and their pages leave, and every generation the
    clients made is still served and journaled. (How long a step holds the event loop, against the
    same load without compaction: benchmarks/journal_compaction.py; no timing is asserted here.)"""
    journal_path = tmp_path / "broker.sqlite"
    seeded, ttl = 2_000, 60.0
    journal = Journal(journal_path, "OFF")
    finish_generations(
        GenerationStore(result_ttl_seconds=ttl, max_results=100_000, journal=journal),
        [f"seed-{n}" for n in range(seeded)],
        png_bytes=10_000,
    )
    journal.close()

    async def body() -> None:
        async with cluster(journal_path=str(journal_path), result_ttl_seconds=ttl, max_results=100_000) as c:
            assert c.orchestrator.store.counts() == (0, seeded)
            c.core.journal.checkpoint()
            size_before = c.core.journal.size_bytes()
            stop = asyncio.Event()
            failures: list[BaseException] = []
            made: list[str] = []

            async def client(n: int) -> None:
                while not stop.is_set():
                    try:
                        rid = f"load-{n}-{len(made)}"
                        events = await collect(c.api.Generate(request(request_id=rid, seed=n), timeout=20))
                        assert events[-1].state == G.GENERATION_STATE_SUCCEEDED, events[-1]
                        got = await c.api.GetGeneration(G.GetGenerationRequest(request_id=rid), timeout=5)
                        assert got.generation.state == G.GENERATION_STATE_SUCCEEDED
                        await c.api.ListGenerations(G.ListGenerationsRequest(), timeout=5)
                        made.append(rid)
                    except (grpc.aio.AioRpcError, AssertionError) as err:
                        failures.append(err)
                        return

            # Every seeded generation is past retention now. The clock jumps before the clients
            # start: a generation of theirs that finished before a jump would be gone when they
            # read it back (NOT_FOUND), which is retention working, not a failed RPC.
            c.clock_offset[0] += ttl + 1
            clients = [asyncio.create_task(client(n)) for n in range(3)]
            while not made and not failures:  # the load is running before the pass starts
                await asyncio.sleep(0.01)
            result = await c.orchestrator.compactor.compact_once()
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*clients)

            assert failures == []
            assert made
            await c.core.journal.durable()
            rows = journal_rows(journal_path)
            assert not any(r.startswith("seed-") for r in rows["generations"] | rows["blobs"])
            assert set(made) <= rows["generations"]
            for rid in made:
                got = await c.api.GetGeneration(G.GetGenerationRequest(request_id=rid), timeout=5)
                assert got.generation.state == G.GENERATION_STATE_SUCCEEDED, rid
            assert c.orchestrator.compactor.rows_deleted >= seeded
            # One step is one short transaction: a pass of thousands of rows is many of them.
            assert result.steps > seeded // 32
            assert c.core.journal.size_bytes() < size_before / 4, (size_before, result)
            assert c.metric("kvrelay_journal_compacted_rows_total") >= seeded
            assert 0 < c.metric("kvrelay_journal_size_bytes") < size_before / 4
            assert c.metric("kvrelay_journal_reclaimed_bytes_total") > 0
            print(f"compaction of {seeded} rows under load: {result}")

    run(body(), timeout=120)


def test_an_id_reused_while_its_old_row_waits_for_deletion_keeps_its_new_row(tmp_path: Path) -> None:
    """A forgotten id is free for a new generation; a batch that deletes the old row later must
    not take the new one with it."""
    clock, wall = ManualClock(), [1_000_000.0]
    journal = Journal(tmp_path / "j.sqlite", "OFF")
    store = GenerationStore(result_ttl_seconds=TTL, max_results=1_000, clock=clock,
                            wall_clock=lambda: wall[0], journal=journal)  # fmt: skip
    try:
        finish_generations(store, [f"old-{n}" for n in range(40)], png_bytes=100)
        clock.advance(TTL + 1)
        wall[0] += TTL + 1
        assert store.counts() == (0, 0)  # forgotten; 32 rows deleted, 8 still due
        assert len(journal.load().generations) == 8
        record, created = store.create_or_attach("old-39", _params(7), True)
        assert created
        store.update(record, GenState.SUCCEEDED, image=ImageResult(b"new", 64, 64, 7))
        store.persist(record)
        assert asyncio.run(JournalCompactor(journal, store).compact_once()).rows_deleted == 7
        rows = journal.load().generations
        assert list(rows) == ["old-39"] and rows["old-39"]["image"]["png"] == b"new"
    finally:
        journal.close()
