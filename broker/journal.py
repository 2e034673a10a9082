"""The broker's write-ahead journal: SQLite in WAL mode (stdlib sqlite3).

Owns the on-disk record of replicas (incarnations, fences), live tickets (reservations,
write and load state) and generations. `commit` writes one transaction; BrokerCore calls it
before any RPC that reveals the change returns, so a broker restart never forgets a page
that a remote writer may still target. Also keeps the file the size of what it holds: deleted
rows' pages go back to the filesystem in bounded steps (`reclaim`, incremental auto_vacuum) and
the WAL is cut back after checkpoints; what to delete is its callers' decision (compaction.py).
Must never interpret what it stores: replaying the records into pools and tickets is
BrokerCore's job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

log = structlog.get_logger(__name__)  # not kvrelay.logging: a pure core imports no gRPC

Synchronous = Literal["OFF", "NORMAL", "FULL"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS replicas (replica_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tickets (ticket_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS generations (request_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (
    tbl TEXT NOT NULL, key TEXT NOT NULL, idx INTEGER NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (tbl, key, idx)
);
"""
# Tables whose rows may hold `bytes` (a finished generation's PNG): each bytes value is stored
# as a BLOB row beside the JSON, which keeps a placeholder. Base64 inside the JSON cost ~4 ms
# of the broker's CPU per 700 KB image (encode, JSON, a third more to write and fsync;
# benchmarks/served_cpu.py). Rows journaled before keep their base64 text; readers take both.
_BLOB_TABLES = frozenset({"generations"})
_BLOB_KEY = "$journal_blob"
# SQLite never gives a deleted row's pages back to the filesystem unless auto_vacuum is on, and
# auto_vacuum can only be chosen before the first table is created (or by one VACUUM after):
# a journal without it grew to 86 MB, 96% free pages, for 996 small rows. INCREMENTAL (not FULL)
# so that the pages come back in bounded steps (`reclaim`), never in one long transaction.
_AUTO_VACUUM_INCREMENTAL = 2
# A checkpoint that empties the WAL cuts its file back to this size; without a limit the WAL
# keeps its high-water mark (a burst of PNGs) for good.
WAL_SIZE_LIMIT_BYTES = 4 << 20


def _encode(data: dict[str, Any]) -> tuple[str, list[bytes]]:
    blobs: list[bytes] = []

    def default(value: object) -> object:
        if isinstance(value, bytes | bytearray | memoryview):
            blobs.append(bytes(value))
            return {_BLOB_KEY: len(blobs) - 1}
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    return json.dumps(data, default=default), blobs


def _decode(text: str, blobs: Mapping[int, bytes]) -> dict[str, Any]:
    if not blobs:
        return dict(json.loads(text))

    def hook(obj: dict[str, Any]) -> Any:
        if len(obj) == 1 and _BLOB_KEY in obj:
            return blobs[obj[_BLOB_KEY]]
        return obj

    return dict(json.loads(text, object_hook=hook))


_KEY_COLUMNS = {"tickets": "ticket_id", "generations": "request_id"}


class JournalWriteError(Exception):
    """A commit of broker state (replicas, tickets) did not reach the disk.

    BrokerCore changes memory before it commits, so from here on memory is ahead of disk: the
    journal refuses every later commit and the broker process must stop and recover from what
    the disk holds (`kvrelay.broker.main` exits non-zero; its supervisor restarts it).
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"journal write failed ({path}): {reason}")
        self.path = path
        self.reason = reason


class JournalInUse(Exception):
    """Another broker holds this journal: two brokers on one file would each replay and rewrite
    the other's tickets (one orphans the other's live requests as BROKER_RESTARTED)."""

    def __init__(self, path: str, holder: str) -> None:
        super().__init__(f"the journal {path!r} is in use by another broker ({holder}); stop it or give this broker its own journal_path")
        self.path = path


@dataclass(frozen=True, slots=True)
class JournalContents:
    replicas: dict[str, dict[str, Any]]
    tickets: dict[str, dict[str, Any]]
    generations: dict[str, dict[str, Any]]
    meta: dict[str, str]


class Journal:
    """One SQLite file. Single-threaded: the broker's event loop is its only caller.

    `synchronous="FULL"` (the default) fsyncs every commit: a broker host that loses power
    must not come back having forgotten pages a remote AR may still write. Tests and
    benchmarks may pass "NORMAL" (durable across a broker crash, not a power cut).
    """

    def __init__(
        self,
        path: str | Path,
        synchronous: Synchronous = "FULL",
        on_failure: Callable[[JournalWriteError], None] | None = None,
    ) -> None:
        self.path = str(path)
        # Set by the first failed commit of broker state; called once (the broker's fail stop).
        self.failure: JournalWriteError | None = None
        self.on_failure = on_failure
        self._lock_fd: int | None = None
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_exclusively(f"{self.path}.lock", self.path)
        # isolation_level=None: transactions are explicit (BEGIN/COMMIT) so one core
        # operation is one atomic commit, never split by sqlite3's implicit transactions.
        self._synchronous = synchronous
        try:
            self._db = self._connect()
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise
        self._identity = _file_identity(self.path)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # First, while a new file has no table yet; an older journal takes it at its VACUUM below.
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self._synchronous}")
        # Builds of SQLite with SECURE_DELETE (Debian's) zero every freed page: deleting one
        # finished generation wrote its whole PNG again as zeros (~15 ms per 32 rows instead of
        # <1 ms). FAST zeroes what costs no extra I/O; the rest goes with `reclaim`.
        db.execute("PRAGMA secure_delete=FAST")
        db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        db.executescript(_SCHEMA)
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != _AUTO_VACUUM_INCREMENTAL:
            self._vacuum_once(db)
        return db

    def _vacuum_once(self, db: sqlite3.Connection) -> None:
        """A journal created before incremental auto_vacuum: rewrite it once with it on (only the
        live pages are copied, so its free pages go too). Runs at open, before the broker serves.
        A failure (no room for the copy) leaves the journal as it was: deleted rows' pages are
        then reused, never returned, and the next start tries again."""
        before = _size_on_disk(self.path)
        try:
            db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as err:
            log.warning("journal_vacuum_failed", path=self.path, reason=str(err), size_bytes=before)
            return
        log.info("journal_vacuumed", path=self.path, size_before_bytes=before, size_bytes=_size_on_disk(self.path))

    def keep_on_disk(self) -> bool:
        """Put the journal back at its path when the file there was deleted or replaced while open.

        SQLite keeps writing into the open, unlinked file: nothing fails, and the next broker
        start would find an empty journal and forget every reservation, DRAINING tickets'
        included (pages freed while a write may still land). So the broker calls this every
        maintenance pass; a deleted journal is copied back from the open one (SQLite's backup)
        and written there from then on. Returns whether it did. A failure is a JournalWriteError.
        """
        if self._lock_fd is None or self.failure is not None or _file_identity(self.path) == self._identity:
            return False
        restoring = f"{self.path}.restoring"
        try:
            with contextlib.closing(sqlite3.connect(restoring)) as copy:
                self._db.backup(copy)
            self._db.close()
            os.replace(restoring, self.path)
            self._db = self._connect()
            self._identity = _file_identity(self.path)
            if _file_identity(f"{self.path}.lock") != _fd_identity(self._lock_fd):
                # The lock file went too: take a new one, or another broker could take this path.
                os.close(self._lock_fd)
                self._lock_fd = _lock_exclusively(f"{self.path}.lock", self.path)
        except (sqlite3.Error, OSError) as err:
            self.failure = JournalWriteError(self.path, f"restoring the deleted journal: {err}")
            if self.on_failure is not None:
                self.on_failure(self.failure)
            raise self.failure from err
        return True

    # ------------------------------------------------------------------ file size
    # Called from the event loop by the compactor, between commits (never inside one).

    def reclaim(self, max_pages: int) -> int:
        """Give up to `max_pages` free pages back: one short transaction in which SQLite moves
        pages from the end of the file into free slots and cuts the end off (the file itself
        shrinks at the next checkpoint). Returns how many pages it gave back (0: none free, or a
        journal without auto_vacuum). A failure is logged and returns 0: no row changes, so
        memory and disk still agree."""
        if self.failure is not None or max_pages <= 0:
            return 0
        try:
            free = int(self._db.execute("PRAGMA freelist_count").fetchone()[0])
            if free == 0 or self._db.execute("PRAGMA auto_vacuum").fetchone()[0] != _AUTO_VACUUM_INCREMENTAL:
                return 0
            # executescript, not execute: the sqlite3 module steps a row-less pragma once, and
            # one step of incremental_vacuum frees one page.
            self._db.executescript(f"PRAGMA incremental_vacuum({min(free, max_pages)});")
            return free - int(self._db.execute("PRAGMA freelist_count").fetchone()[0])
        except sqlite3.Error as err:
            log.warning("journal_reclaim_failed", path=self.path, reason=str(err))
            return 0

    def checkpoint(self, truncate: bool = False) -> None:
        """Copy the WAL's frames into the file (which shrinks to what `reclaim` left); with
        `truncate`, also cut the WAL file to zero bytes. Costs one fsync plus the frames written
        since the last one. A failure is logged (nothing is lost: the frames stay in the WAL)."""
        if self.failure is not None:
            return
        try:
            self._db.execute(f"PRAGMA wal_checkpoint({'TRUNCATE' if truncate else 'PASSIVE'})").fetchone()
        except sqlite3.Error as err:
            log.warning("journal_checkpoint_failed", path=self.path, reason=str(err))

    def page_stats(self) -> tuple[int, int, int]:
        """(page_count, freelist_count, page_size): the file's logical size is the first times
        the last once checkpointed."""
        db = self._db
        return (
            int(db.execute("PRAGMA page_count").fetchone()[0]),
            int(db.execute("PRAGMA freelist_count").fetchone()[0]),
            int(db.execute("PRAGMA page_size").fetchone()[0]),
        )

    def size_bytes(self) -> int:
        """Bytes on disk: the file and its WAL. Only stat calls, so the metrics thread may call it
        while the event loop commits (an in-memory journal reports 0)."""
        return 0 if self._lock_fd is None else _size_on_disk(self.path)

    def load(self) -> JournalContents:
        blobs: dict[tuple[str, str], dict[int, bytes]] = {}
        for tbl, key, idx, value in self._db.execute("SELECT tbl, key, idx, value FROM blobs"):
            blobs.setdefault((tbl, key), {})[idx] = bytes(value)

        def table(name: str, key: str) -> dict[str, dict[str, Any]]:
            return {k: _decode(v, blobs.get((name, k), {})) for k, v in self._db.execute(f"SELECT {key}, data FROM {name}")}

        return JournalContents(
            replicas=table("replicas", "replica_id"),
            tickets=table("tickets", "ticket_id"),
            generations=table("generations", "request_id"),
            meta=dict(self._db.execute("SELECT key, value FROM meta").fetchall()),
        )

    def commit(
        self,
        *,
        replicas: Mapping[str, dict[str, Any] | None] | None = None,
        tickets: Mapping[str, dict[str, Any] | None] | None = None,
        generations: Mapping[str, dict[str, Any] | None] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        """Write everything given in one transaction; a None value deletes that row.

        Raises JournalWriteError when the write fails (disk full, I/O error, file gone read-only).
        A failed write of replicas, tickets or meta marks the journal failed: every later commit
        raises at once. A failed write of generations alone does not (their retention across
        restarts is best effort, and no page depends on it).
        """
        if self.failure is not None:
            raise JournalWriteError(self.path, self.failure.reason)
        try:
            self._commit(replicas, tickets, generations, meta)
        except (sqlite3.Error, OSError) as err:
            failure = JournalWriteError(self.path, str(err) or type(err).__name__)
            if replicas or tickets or meta:
                self.failure = failure
                if self.on_failure is not None:
                    self.on_failure(failure)
            raise failure from err

    def _commit(
        self,
        replicas: Mapping[str, dict[str, Any] | None] | None,
        tickets: Mapping[str, dict[str, Any] | None] | None,
        generations: Mapping[str, dict[str, Any] | None] | None,
        meta: Mapping[str, str] | None,
    ) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for rid, data in (replicas or {}).items():
                if data is None:
                    db.execute("DELETE FROM replicas WHERE replica_id = ?", (rid,))
                else:
                    db.execute("INSERT OR REPLACE INTO replicas VALUES (?, ?)", (rid, json.dumps(data)))
            self._upsert("tickets", (tickets or {}).items())
            self._upsert("generations", (generations or {}).items())
            for key, value in (meta or {}).items():
                db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            db.execute("COMMIT")
        except BaseException:
            # SQLite has already rolled back after SQLITE_FULL or an I/O error: a ROLLBACK then
            # would raise "no transaction is active" and hide the real reason.
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def _upsert(self, table: str, rows: Iterable[tuple[str, dict[str, Any] | None]]) -> None:
        key_column = _KEY_COLUMNS[table]
        for key, data in rows:
            if table in _BLOB_TABLES:
                self._db.execute("DELETE FROM blobs WHERE tbl = ? AND key = ?", (table, key))
            if data is None:
                self._db.execute(f"DELETE FROM {table} WHERE {key_column} = ?", (key,))
                continue
            if table not in _BLOB_TABLES:
                self._db.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", (key, json.dumps(data)))
                continue
            text, blobs = _encode(data)
            self._db.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", (key, text))
            self._db.executemany(
                "INSERT INTO blobs VALUES (?, ?, ?, ?)", [(table, key, i, b) for i, b in enumerate(blobs)]
            )

    # Generations belong to the orchestrator (issue 8); it stores them here so one file and
    # one commit discipline cover the whole broker process.
    def put_generation(self, request_id: str, data: dict[str, Any] | None) -> None:
        self.commit(generations={request_id: data})

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _size_on_disk(path: str) -> int:
    total = 0
    for name in (path, f"{path}-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(name).st_size
    return total


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _fd_identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _lock_exclusively(lock_path: str, journal_path: str) -> int:
    """One broker per journal: an exclusive flock on `PATH.lock`, held until close() or exit (the
    kernel drops it with the process, so a broker killed with SIGKILL never leaves it stale)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise JournalInUse(journal_path, f"pid {holder}" if holder.isdigit() else "an unknown process") from None
        raise
    # Who holds it, for the next broker's message; not used for correctness.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
