"""The broker's write-ahead journal: SQLite in WAL mode (stdlib sqlite3).

Owns the on-disk record of replicas (incarnations, fences), live tickets (reservations,
write and load state) and generations. `commit` records one atomic change; BrokerCore calls it
before any RPC that reveals the change returns, so a broker restart never forgets a page
that a remote writer may still target. With `group_commit` (the broker process), `commit` only
queues the change: one writer thread applies queued commits in order, many per transaction and
fsync; each commit has a sequence number, `await durable_through(n)` returns once commit n and
those before it are on disk and `await durable()` once everything committed so far is; whoever
reveals state outside the process (an RPC reply, a call to a replica) awaits the commits behind
what it reveals first. Also keeps the file the size of what it holds: deleted
rows' pages go back to the filesystem in bounded steps (`reclaim`, incremental auto_vacuum) and
the WAL is cut back after checkpoints; what to delete is its callers' decision (compaction.py).
Must never interpret what it stores: replaying the records into pools and tickets is
BrokerCore's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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
# At most this many queued commits go into one group transaction (bounds its size and the time
# the connection is held; a longer queue simply takes several transactions, in order).
GROUP_COMMIT_MAX = 256

# One statement of a commit, its parameters bound on the caller's thread: (sql, rows) runs
# `executemany(sql, rows)`. Encoding (JSON) happens when the change is made, so the writer thread
# never reads a dict the event loop may change afterwards.
_Statement = tuple[str, list[tuple[Any, ...]]]


@dataclass(slots=True)
class JournalStats:
    """What the journal did since it opened (benchmarks/broker_journal.py reads these)."""

    commits: int = 0  # commit() calls: changes recorded
    transactions: int = 0  # SQLite transactions that wrote them (one WAL fsync each at FULL)
    caller_seconds: float = 0.0  # time callers (the event loop) spent inside commit()
    writer_seconds: float = 0.0  # time the writer thread spent in transactions (group commit)
    largest_group: int = 0  # most commits one transaction carried


@dataclass(slots=True)
class _Queued:
    seq: int
    statements: list[_Statement]
    state: bool  # replicas, tickets or meta: a failure fails the journal (generations alone do not)
    failure: list[JournalWriteError] = field(default_factory=list)


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


class JournalOpenError(Exception):
    """The journal cannot be opened at its path: a directory, a parent that is a file, a file that
    is not an SQLite journal, no permission. The operator's setting, not a fault of the broker:
    `kvrelay broker` names broker.journal_path in one line and exits 2 before it listens."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot open the journal {path!r}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class JournalContents:
    replicas: dict[str, dict[str, Any]]
    tickets: dict[str, dict[str, Any]]
    generations: dict[str, dict[str, Any]]
    meta: dict[str, str]


class Journal:
    """One SQLite file. The broker's event loop is its only caller; with `group_commit` a writer
    thread of its own applies the commits, and `_db_lock` keeps the two off the connection at once.

    `synchronous="FULL"` (the default) fsyncs every transaction: a broker host that loses power
    must not come back having forgotten pages a remote AR may still write. Tests and
    benchmarks may pass "NORMAL" (durable across a broker crash, not a power cut).

    `group_commit=False`: `commit` writes and fsyncs its transaction before it returns (on the
    caller's thread: an fsync on the event loop per commit). `group_commit=True`: `commit`
    encodes and queues the change and returns; the writer applies the queue in order, every
    commit queued while the previous transaction was syncing in one transaction, so a crash at
    any point leaves a prefix of the commits on disk. `durable()` waits for it in both modes.
    """

    def __init__(
        self,
        path: str | Path,
        synchronous: Synchronous = "FULL",
        on_failure: Callable[[JournalWriteError], None] | None = None,
        group_commit: bool = False,
    ) -> None:
        self.path = str(path)
        self.group_commit = group_commit
        self.stats = JournalStats()
        # The connection: the writer thread holds it for a transaction; the loop's own calls
        # (load, reclaim, checkpoint, keep_on_disk, close) take it too.
        self._db_lock = threading.Lock()
        # Guards the queue, the sequence numbers and the waiters (never held across I/O).
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._submitted = 0  # sequence number of the last commit handed in
        self._durable = 0  # every commit up to this one is on disk (or was generations only and failed)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: threading.Thread | None = None
        self._closing = False
        # Set by the first failed commit of broker state; called once (the broker's fail stop).
        self.failure: JournalWriteError | None = None
        self.on_failure = on_failure
        self._lock_fd: int | None = None
        if self.path != ":memory:":
            # Checked first: SQLite says only "unable to open database file" for a directory (and
            # the lock would be made beside it), mkdir only "File exists" under a regular file.
            unusable = _unusable_path(self.path)
            if unusable is not None:
                raise JournalOpenError(self.path, unusable)
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                self._lock_fd = _lock_exclusively(f"{self.path}.lock", self.path)
            except OSError as err:
                raise JournalOpenError(self.path, err.strerror or str(err)) from None
        # isolation_level=None: transactions are explicit (BEGIN/COMMIT) so one core
        # operation is one atomic commit, never split by sqlite3's implicit transactions.
        self._synchronous = synchronous
        try:
            self._db = self._connect()
        except BaseException as err:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            if isinstance(err, (OSError, sqlite3.Error)):
                # A file that is not an SQLite journal, a read-only place.
                reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                raise JournalOpenError(self.path, reason) from None
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
            # Between two group transactions: commits still queued go to the restored file.
            with self._db_lock:
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
    # Called from the event loop by the compactor, between commits (never inside one); with
    # group commit they wait for the writer's transaction in progress (one fsync at most).

    def reclaim(self, max_pages: int) -> int:
        """Give up to `max_pages` free pages back: one short transaction in which SQLite moves
        pages from the end of the file into free slots and cuts the end off (the file itself
        shrinks at the next checkpoint). Returns how many pages it gave back (0: none free, or a
        journal without auto_vacuum). A failure is logged and returns 0: no row changes, so
        memory and disk still agree."""
        if self.failure is not None or max_pages <= 0:
            return 0
        with self._db_lock:
            return self._reclaim(max_pages)

    def _reclaim(self, max_pages: int) -> int:
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
            with self._db_lock:
                self._db.execute(f"PRAGMA wal_checkpoint({'TRUNCATE' if truncate else 'PASSIVE'})").fetchone()
        except sqlite3.Error as err:
            log.warning("journal_checkpoint_failed", path=self.path, reason=str(err))

    def page_stats(self) -> tuple[int, int, int]:
        """(page_count, freelist_count, page_size): the file's logical size is the first times
        the last once checkpointed."""
        with self._db_lock:
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
        """Everything on disk. Waits for queued commits first (at startup: the replay's own)."""
        self.flush()
        with self._db_lock:
            return self._load()

    def _load(self) -> JournalContents:
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

    def meta_value(self, key: str) -> str | None:
        """One value of the meta table (None: no such key). Waits for queued commits first."""
        self.flush()
        with self._db_lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def commit(
        self,
        *,
        replicas: Mapping[str, dict[str, Any] | None] | None = None,
        tickets: Mapping[str, dict[str, Any] | None] | None = None,
        generations: Mapping[str, dict[str, Any] | None] | None = None,
        meta: Mapping[str, str | None] | None = None,
    ) -> int:
        """Record everything given as one atomic change; a None value deletes that row. Returns
        the commit's sequence number.

        Without group commit the transaction is on disk when this returns. With it, the change is
        queued (encoded now: later changes to the dicts given do not reach it) and on disk once
        `durable()` returns; commits reach the disk in the order they were made.

        Raises JournalWriteError when the write fails (disk full, I/O error, file gone read-only;
        with group commit, the failure of an earlier queued commit). A failed write of replicas,
        tickets or meta marks the journal failed: every later commit raises at once. A failed
        write of generations alone does not (their retention across restarts is best effort, and
        no page depends on it).
        """
        t0 = time.perf_counter()
        try:
            if self.failure is not None:
                raise JournalWriteError(self.path, self.failure.reason)
            state = bool(replicas or tickets or meta)
            statements = _statements(replicas, tickets, generations, meta)
            if self.group_commit:
                return self._enqueue(statements, state)
            try:
                with self._db_lock:
                    self._transaction([statements])
            except (sqlite3.Error, OSError) as err:
                raise self._failed(err, state, on_loop=True) from err
            with self._cond:
                self._submitted += 1
                self._durable = self._submitted
                self.stats.transactions += 1
                self.stats.largest_group = max(self.stats.largest_group, 1)
                return self._submitted
        finally:
            self.stats.commits += 1
            self.stats.caller_seconds += time.perf_counter() - t0

    async def durable(self) -> None:
        """Return once every commit made before this call is on disk: await it before revealing
        anything read from the broker's state that no narrower bound covers (a call to a replica,
        a refusal). Raises JournalWriteError once a write failed (the broker then stops).
        Without group commit it returns at once (every commit was on disk when it returned)
        unless a write failed."""
        await self.durable_through(self._submitted)

    async def durable_through(self, seq: int) -> None:
        """Return once commit `seq` and every commit before it are on disk (commits reach the disk
        in order, so a prefix is all there is). A reply awaits the newest commit behind anything it
        reveals, and nothing later: 0 (or a commit already on disk) returns at once, without
        suspending. Raises JournalWriteError once any write of state failed, whatever `seq`: from
        then on the core changes memory and its commit raises (is never numbered), so a commit
        already on disk no longer bounds what memory shows (a ticket armed after the failure,
        with `seq` its creation's)."""
        with self._cond:
            if self.failure is not None:
                raise JournalWriteError(self.path, self.failure.reason)
            target = min(seq, self._submitted)
            if self._durable >= target:
                return
            loop = asyncio.get_running_loop()
            self._loop = loop
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((target, fut))
        try:
            await fut
        finally:
            if not fut.done():  # cancelled: leave no waiter behind
                with self._cond:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove((target, fut))

    def flush(self) -> None:
        """Block until every queued commit is on disk or the journal failed (startup, close and
        tests; never on the serving path)."""
        with self._cond:
            target = self._submitted
            while self._durable < target and self.failure is None and self._writer is not None:
                self._cond.wait(0.05)

    @property
    def submitted(self) -> int:
        """Sequence number of the last commit made (0: none yet); the next one is this plus one."""
        return self._submitted

    @property
    def pending(self) -> int:
        """Commits made and not yet on disk (0 without group commit)."""
        return self._submitted - self._durable

    # ------------------------------------------------------------------ writing

    def _enqueue(self, statements: list[_Statement], state: bool) -> int:
        if self._loop is None:
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()
        with self._cond:
            self._submitted += 1
            self._queue.append(_Queued(self._submitted, statements, state))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="journal-writer", daemon=True)
                self._writer.start()
            self._cond.notify_all()
            return self._submitted

    def _write_queued(self) -> None:
        """The writer thread: every commit queued so far in one transaction (one fsync), in order,
        until close() and the queue is empty. A failure of state stops all writing: nothing
        queued after it may reach the disk before it (recovery must see a prefix)."""
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue[:GROUP_COMMIT_MAX]
                del self._queue[:GROUP_COMMIT_MAX]
            t0 = time.perf_counter()
            failure = self._write_batch(batch)
            with self._cond:
                self.stats.writer_seconds += time.perf_counter() - t0
                if failure is None:
                    self._durable = batch[-1].seq
                ready = [w for w in self._waiters if w[0] <= self._durable or failure is not None]
                self._waiters = [w for w in self._waiters if w not in ready]
                self._cond.notify_all()
            self._resolve([fut for _, fut in ready], failure)

    def _write_batch(self, batch: list[_Queued]) -> JournalWriteError | None:
        """Apply one batch; returns the failure that fails the journal, if any. A batch whose
        generations fail while its state would fit is written again without them (as a commit of
        generations alone fails alone)."""
        if self.failure is not None:
            return self.failure
        try:
            with self._db_lock:
                self._transaction([q.statements for q in batch])
        except Exception as err:  # noqa: BLE001 - anything else too: a dead writer would hang every reply
            state = [q for q in batch if q.state]
            if len(state) == len(batch):
                return self._failed(err, True, on_loop=False)
            log.error("generation_journal_write_failed", path=self.path, reason=str(err),
                      rows=len(batch) - len(state))  # fmt: skip
            if not state:
                return None
            return self._write_batch(state)
        self.stats.transactions += 1
        self.stats.largest_group = max(self.stats.largest_group, len(batch))
        return None

    def _transaction(self, groups: list[list[_Statement]]) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for statements in groups:
                for sql, rows in statements:
                    db.executemany(sql, rows)
            db.execute("COMMIT")
        except BaseException:
            # SQLite has already rolled back after SQLITE_FULL or an I/O error: a ROLLBACK then
            # would raise "no transaction is active" and hide the real reason.
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def _failed(self, err: BaseException, state: bool, *, on_loop: bool) -> JournalWriteError:
        failure = JournalWriteError(self.path, str(err) or type(err).__name__)
        if state and self.failure is None:
            self.failure = failure
            if self.on_failure is not None:
                loop = self._loop
                if on_loop or loop is None:
                    self.on_failure(failure)
                else:
                    with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                        loop.call_soon_threadsafe(self.on_failure, failure)
        return failure

    def _resolve(self, futures: list[asyncio.Future[None]], failure: JournalWriteError | None) -> None:
        loop = self._loop
        if not futures or loop is None:
            return

        def resolve() -> None:
            for fut in futures:
                if fut.done():
                    continue
                if failure is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(JournalWriteError(self.path, failure.reason))

        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(resolve)

    # Generations belong to the orchestrator (issue 8); it stores them here so one file and
    # one commit discipline cover the whole broker process.
    def put_generation(self, request_id: str, data: dict[str, Any] | None) -> None:
        self.commit(generations={request_id: data})

    def close(self) -> None:
        """Write what is queued, stop the writer, close the file."""
        writer = self._writer
        if writer is not None:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            writer.join()
        with self._db_lock:
            self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _statements(
    replicas: Mapping[str, dict[str, Any] | None] | None,
    tickets: Mapping[str, dict[str, Any] | None] | None,
    generations: Mapping[str, dict[str, Any] | None] | None,
    meta: Mapping[str, str | None] | None,
) -> list[_Statement]:
    """One commit's statements, values encoded now."""
    out: list[_Statement] = []
    for rid, data in (replicas or {}).items():
        if data is None:
            out.append(("DELETE FROM replicas WHERE replica_id = ?", [(rid,)]))
        else:
            out.append(("INSERT OR REPLACE INTO replicas VALUES (?, ?)", [(rid, json.dumps(data))]))
    _upsert(out, "tickets", (tickets or {}).items())
    _upsert(out, "generations", (generations or {}).items())
    for key, value in (meta or {}).items():
        if value is None:
            out.append(("DELETE FROM meta WHERE key = ?", [(key,)]))
        else:
            out.append(("INSERT OR REPLACE INTO meta VALUES (?, ?)", [(key, value)]))
    return out


def _upsert(out: list[_Statement], table: str, rows: Iterable[tuple[str, dict[str, Any] | None]]) -> None:
    key_column = _KEY_COLUMNS[table]
    for key, data in rows:
        if table in _BLOB_TABLES:
            out.append(("DELETE FROM blobs WHERE tbl = ? AND key = ?", [(table, key)]))
        if data is None:
            out.append((f"DELETE FROM {table} WHERE {key_column} = ?", [(key,)]))
            continue
        if table not in _BLOB_TABLES:
            out.append((f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", [(key, json.dumps(data))]))
            continue
        text, blobs = _encode(data)
        out.append((f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", [(key, text)]))
        if blobs:
            out.append(("INSERT INTO blobs VALUES (?, ?, ?, ?)", [(table, key, i, b) for i, b in enumerate(blobs)]))


def _size_on_disk(path: str) -> int:
    total = 0
    for name in (path, f"{path}-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(name).st_size
    return total


def _unusable_path(path: str) -> str | None:
    """Why no journal file can be at `path` (a directory is there, or a parent is a file); None
    when nothing on the way says so (the open itself may still fail, with SQLite's reason)."""
    target = Path(path)
    if target.is_dir():
        return f"it is a directory; journal_path names the journal's file (e.g. {str(target / 'broker.sqlite')!r})"
    for parent in target.parents:  # the nearest first: the first that exists decides
        if parent.exists():
            return None if parent.is_dir() else f"{str(parent)!r} is a file, not a directory"
    return None


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
