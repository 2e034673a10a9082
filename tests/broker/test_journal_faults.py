"""The broker's journal when the disk refuses a write (full, I/O error, a file-size limit).

A failed commit of broker state leaves BrokerCore's memory ahead of disk: the journal must say
why (not SQLite's "cannot rollback - no transaction is active"), refuse every later commit, and
the broker process must stop (exit 1, so its supervisor restarts it from the journal) instead of
serving on with requests stuck in the queue. Found by putting a node's journal on a 2 MiB tmpfs
under load: the broker kept running, RPCs failed UNKNOWN and five requests hung to their deadline.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.broker.journal import Journal, JournalInUse, JournalWriteError
from kvrelay.broker.main import serve
from kvrelay.config import ConfigError, load_config
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import replica
from tests.procs import start_service


def _full(journal: Journal) -> None:
    """Let the journal's database grow no further: the next commit that needs a page fails
    SQLITE_FULL ("database or disk is full"), as on a full filesystem."""
    pages = journal._db.execute("PRAGMA page_count").fetchone()[0]  # noqa: SLF001 - the fault is injected here
    journal._db.execute(f"PRAGMA max_page_count={pages}")  # noqa: SLF001


def test_a_failed_commit_names_its_reason_and_refuses_every_later_commit(tmp_path: Path) -> None:
    failures: list[JournalWriteError] = []
    journal = Journal(tmp_path / "j.sqlite", "NORMAL", on_failure=failures.append)
    journal.commit(tickets={"t0": {"state": "RESERVED"}})
    _full(journal)
    with pytest.raises(JournalWriteError, match="database or disk is full"):
        journal.commit(tickets={"t1": {"state": "RESERVED", "pad": "x" * 50_000}})
    assert [f.reason for f in failures] == ["database or disk is full"]
    # A later commit that would fit is refused all the same: memory is ahead of disk now.
    with pytest.raises(JournalWriteError, match="database or disk is full"):
        journal.commit(tickets={"t0": None})
    assert len(failures) == 1
    journal.close()
    assert Journal(tmp_path / "j.sqlite").load().tickets == {"t0": {"state": "RESERVED"}}


def test_a_failed_write_of_generations_alone_does_not_fail_the_journal(tmp_path: Path) -> None:
    failures: list[JournalWriteError] = []
    journal = Journal(tmp_path / "j.sqlite", "NORMAL", on_failure=failures.append)
    _full(journal)
    with pytest.raises(JournalWriteError, match="database or disk is full"):
        journal.commit(generations={"r1": {"png": "x" * 50_000}})
    assert failures == [] and journal.failure is None
    journal.commit(generations={"r1": None})


def test_the_broker_stops_when_its_journal_cannot_be_written(repo_root: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    limit = 256 * 1024

    def limit_file_size() -> None:  # a full disk, for this process's files only (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    broker = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"],
                           cwd=repo_root, preexec_fn=limit_file_size)
    refused: list[tuple[str, str]] = []
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            deadline = time.monotonic() + 60
            n = 0
            while broker.proc.poll() is None and time.monotonic() < deadline and n < 2000:
                spec = replica(f"dit-{n}", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
                n += 1
                try:
                    stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=spec), timeout=10)
                except grpc.RpcError as err:
                    code, reason, _ = reason_of(err)  # type: ignore[arg-type]
                    refused.append((code, reason))
                    if code != "UNAVAILABLE":
                        break
            broker.proc.wait(30)
    finally:
        returncode = broker.stop()
    assert returncode == 1, broker.output()
    assert "journal write failed" in broker.output() and "stopping to recover from the journal" in broker.output()
    assert refused and refused[0] == ("UNAVAILABLE", "JOURNAL_FAILED"), (refused, broker.output())
    # What the disk holds is a journal the next broker opens.
    assert Journal(tmp_path / "journal.sqlite").load().replicas


def test_a_second_broker_on_the_same_journal_is_refused(repo_root: Path, tmp_path: Path) -> None:
    """Two brokers on one journal (a second `kvrelay broker` with the node's config) each replayed
    the other's tickets: the second one orphaned the first one's live requests."""
    path = tmp_path / "journal.sqlite"
    first = Journal(path, "NORMAL")
    first.commit(tickets={"t0": {"state": "WRITING"}})
    with pytest.raises(JournalInUse, match=rf"in use by another broker \(pid {os.getpid()}\)"):
        Journal(path, "NORMAL")
    cfg = load_config(repo_root / "tests" / "configs" / "test-fast.yaml")
    cfg = cfg.model_copy(update={"broker": cfg.broker.model_copy(update={"journal_path": str(path)})})
    with pytest.raises(ConfigError, match=r"broker\.journal_path: the journal .* is in use by another broker"):
        asyncio.run(serve(cfg, "127.0.0.1", 0, 0))
    assert first.load().tickets == {"t0": {"state": "WRITING"}}  # untouched
    first.close()
    second = Journal(path, "NORMAL")  # the lock goes with its holder
    assert second.load().tickets == {"t0": {"state": "WRITING"}}
    second.close()


def test_a_journal_deleted_while_the_broker_runs_is_written_back(tmp_path: Path) -> None:
    """`rm journal.sqlite*` under a running broker: SQLite kept writing into the unlinked file
    and the next start found an empty journal (every reservation forgotten, DRAINING ones too)."""
    path = tmp_path / "journal.sqlite"
    journal = Journal(path, "NORMAL")
    journal.commit(tickets={"t0": {"state": "DRAINING"}}, meta={"sequence": "1"})
    assert not journal.keep_on_disk()  # nothing to do while the file is there
    for name in ("journal.sqlite", "journal.sqlite-wal", "journal.sqlite-shm", "journal.sqlite.lock"):
        (tmp_path / name).unlink(missing_ok=True)
    journal.commit(tickets={"t1": {"state": "WRITING"}})
    assert journal.keep_on_disk()
    journal.commit(tickets={"t2": {"state": "RESERVED"}})
    with pytest.raises(JournalInUse):  # the lock came back with the file
        Journal(path, "NORMAL")
    journal.close()
    restored = Journal(path, "NORMAL").load()
    assert set(restored.tickets) == {"t0", "t1", "t2"} and restored.meta == {"sequence": "1"}
