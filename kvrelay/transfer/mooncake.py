"""The Mooncake transport (`kv_connector: MooncakeConnector`, DESIGN.md section 5).

Owns the process's one `mooncake.engine.TransferEngine`: initialised with P2PHANDSHAKE (no
metadata server), the protocol from config (`tcp` by default), memory registered once per
buffer, and writes pushed from the AR's staging buffer straight into DiT pool regions.

Facts about the engine this module relies on (mooncake-transfer-engine 0.3.13, verified by
experiment, see docs/transfer.md):
- Some settings are read once, when `mooncake.engine` is imported (MC_LOG_LEVEL,
  MC_DISABLE_METACACHE; MC_TRANSFER_TIMEOUT is read by each `TransferEngine()`): one set in
  `os.environ` after the import reaches only processes started later (MC_DISABLE_METACACHE=1
  set between the import and the first engine left its descriptor cache on).
- Under P2PHANDSHAKE `initialize(host, ...)` ignores any port in `host` and listens on a random
  RPC port (`get_rpc_port()`) plus a random TCP data port, on all interfaces: every process
  start gets fresh ports. `MC_TCP_BIND_ADDRESS` narrows neither listener, and the address peers
  dial is the `hostname` given to `initialize` (the stage's `advertise_host`), whatever it says.
- `batch_transfer_sync_write(session, src_addrs, dst_addrs, lengths)` returns 0 or -1 and
  releases the GIL; it rejects a whole batch past MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024)
  segments, a destination outside the peer's registered memory, and an unreachable peer.
- It has no per-call timeout (the engine's own is MC_TRANSFER_TIMEOUT, 30 s by default), so
  the per-call timeout here bounds the *wait*, not the call: a write whose batch is still in the
  engine when the wait ends is reported IN_DOUBT (bytes may still land; it reads the staging
  memory until it returns). The call's real end is picked up later by `collect_finished()`,
  which turns each in-doubt write into its final OK or FAILED (vLLM's `get_finished`). Until
  then the broker keeps the pages and the caller keeps the staging bytes.
- A sender engine keeps what it learnt of a peer under the peer's session name "host:rpc_port"
  for good: its TCP lanes keep the data port of the first process it wrote to by that name, and
  the Python binding keeps the segment handle. A process that took a dead peer's RPC port (a
  restarted DiT) is then never written by that engine: every batch fails at once, the lanes
  reconnecting to the dead data port. The binding has no call that drops one peer's state; a
  fresh engine has none (see `_replace_sender`). `send_probe(session)` answers 0 when a process
  answers at the session's RPC port, fast non-zero when nothing listens there.
- Destroying an engine holds the GIL (pybind11) while its destructor joins the handshake
  listener, which waits out a 1 s accept timeout: every thread of the process stopped for about a
  second, whichever thread dropped it. Replaced engines are destroyed by `EngineReaper` (its own
  thread, the listener woken from another process: milliseconds) once no call runs on them.

Never hands a sender "OK" off as proof of delivery: receivers verify checksums.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kvrelay.logging import get_logger
from kvrelay.transfer.checksum import write_checksum
from kvrelay.transfer.engine_reaper import EngineReaper, RetiredEngine
from kvrelay.transfer.planner import PlannedWrite
from kvrelay.transfer.transport import (
    MOONCAKE_MAX_QUEUED_TRANSFERS_PER_PEER,
    FinishedCall,
    RegionDescriptor,
    WriteOutcome,
    check_writes_fit,
    staging_address,
)

# Below these, a batch uses the plain sync call and does not update the goodput estimate.
_MIN_NAP_S = 0.001
_MIN_LEARN_BYTES = 4 << 20
# A failed batch is sent once more after this pause (see `_send_session`).
_RETRY_PAUSE_S = 0.02
# Attempts of one batch while each fails fast (stale connections to a reused port), and how
# fast a failure must be to count as one.
_STALE_TRIES = 5
_STALE_FAILURE_S = 1.0
# Replacing the sending engine (`_replace_sender`), bounded three ways. Only for a peer the
# engine has written before (it can hold nothing stale for any other: a fresh engine would fail
# the same). A token bucket per endpoint: _REPLACE_BURST new engines at once, then one per
# _REPLACE_REFILL_S. And per peer: one that caused a replacement may cause the next only
# _REPLACE_PEER_INTERVAL_S later, so that one peer whose batches keep failing fast now and then
# (not stale: the queue limit, say) cannot use up the bucket; a name really goes stale again only
# once its port came round to a third process, which took a minute or more (TIME_WAIT) in
# benchmarks/mooncake/port_reuse.py. A peer that does not answer its probe is probed again only
# after _DEAD_PEER_PROBE_S. Replaced engines are destroyed in the background once no call runs
# on them (`EngineReaper`).
_REPLACE_BURST = 4
_REPLACE_REFILL_S = 10.0
_REPLACE_PEER_INTERVAL_S = 30.0
_DEAD_PEER_PROBE_S = 10.0
# Per-peer entries kept (last replacements, dead-peer probes) before expired ones are dropped.
_MAX_PEER_ENTRIES = 1024
# How long `close()` waits for the reaper to destroy the engines (it never holds up an exit).
_REAPER_CLOSE_S = 10.0

_log = get_logger(__name__)


def quiet_engine_info_log() -> None:
    """Default ``MC_LOG_LEVEL`` to WARNING; call before the first ``import mooncake.engine``.

    Mooncake reads it when its module loads; its INFO lines (eight on every engine start, more
    per peer) drowned a console log. Warnings and errors still print (e.g. "No RDMA devices
    found" where RDMA was expected). An explicit ``MC_LOG_LEVEL`` wins."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


class MooncakeError(RuntimeError):
    """The Mooncake engine could not be started or could not register memory."""


def _max_segments_per_batch() -> int:
    # Stay strictly below the engine's per-peer queue limit, read from the same variable the
    # engine reads, leaving headroom for other writers to the same peer.
    limit = int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", MOONCAKE_MAX_QUEUED_TRANSFERS_PER_PEER))
    return max(1, min(limit - 24, int(limit * 0.9)))


@dataclass(slots=True, eq=False)
class _Engine:
    """One TransferEngine and the engine calls running on it."""

    engine: Any
    rpc_port: int
    generation: int
    in_flight: int = 0
    registered: set[int] = field(default_factory=set)  # addresses registered on it
    # Sessions a batch completed to through this engine: the only ones it can hold stale state
    # for (a data port, a segment handle) once another process takes the name.
    written: set[str] = field(default_factory=set)

    def register(self, addr: int, length: int) -> None:
        rc = self.engine.register_memory(addr, length)
        if rc != 0:
            raise MooncakeError(f"register_memory({addr:#x}, {length}) returned {rc}")
        self.registered.add(addr)

    def hand_over(self, host: str, *, replaced: bool = True) -> RetiredEngine:
        """This engine, for the reaper: its binding object and registrations go with it (the
        caller has made sure no call runs on it, and none can start)."""
        engine, self.engine = self.engine, None
        registered, self.registered = tuple(self.registered), set()
        return RetiredEngine(engine, host, self.rpc_port, self.generation, registered, replaced)


@dataclass(slots=True)
class _InDoubtCall:
    ticket_id: str
    writes: list[tuple[int, PlannedWrite, str, int]]  # (index, write, session, checksum) in doubt
    progress: dict[str, _SessionProgress]
    futures: dict[str, Future[None]]
    timeout_s: float


@dataclass(slots=True)
class _SessionProgress:
    """Per destination session: which writes have fully landed on the sender side, which failed."""

    segments_left: dict[int, int]
    started: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)


class MooncakeEndpoint:
    """The process's TransferEngine, usable as both a KvSender and a KvReceiver.

    Construct it through `endpoint()` (or the transport factory) so that a process never holds
    two endpoints: two would listen on two sessions and split registrations. The engines that
    replace its sending engine (`_replace_sender`) only send; peers write to the first one.
    """

    name = "mooncake"

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", sleep_fraction: float = 0.75
    ) -> None:
        quiet_engine_info_log()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - exercised where Mooncake is absent
            raise ImportError(
                "the mooncake transport needs Mooncake: pip install 'kvrelay[mooncake]'"
            ) from e
        self.hostname = hostname
        self.protocol = protocol
        self.device_name = device_name
        if not 0.0 <= sleep_fraction < 1.0:
            raise ValueError(f"sleep_fraction must be in [0, 1), got {sleep_fraction}")
        # The engine's completion wait spins on the status (clock_gettime + getTransferStatus):
        # a core burnt per transfer, which a 2-core host cannot spare. With sleep_fraction > 0 a
        # batch is submitted async and the thread sleeps through that fraction of the time the
        # peer's recent goodput predicts before the (spinning) wait; 0 = the plain sync call.
        self.sleep_fraction = sleep_fraction
        self._goodput: dict[str, float] = {}
        # Set for the engine's sake (an explicit MC_TCP_BIND_ADDRESS wins), but it is no guard:
        # measured in network namespaces, the listeners stay on every interface and peers reach
        # the advertised host even with it set to another address. Mooncake has no
        # authentication: firewall its ports (docs/operations.md, Security).
        self.bind_address = os.environ.setdefault("MC_TCP_BIND_ADDRESS", _bind_address(hostname))
        # MC_DISABLE_METACACHE is left to the environment (the engine's descriptor cache stays on
        # by default). Setting it here reached no engine of this process (the engine reads its
        # setting at import, above), only the processes it started later: a test process's
        # endpoint turned the cache off in every node that later tests started. With the cache
        # off each batch fetches the peer's descriptor from the peer first, and to a stopped
        # receiver that fetch blocks ~60 s, past MC_TRANSFER_TIMEOUT (docs/transfer.md).
        self._engine_class = TransferEngine
        # The first engine is the one peers write to (`session_id`, `register_region`): it lives
        # as long as the endpoint. Writes go through `_sender`, the primary until a peer on a
        # reused port makes the endpoint replace it (`_replace_sender`).
        self._primary = self._start_engine(generation=0)
        self._sender = self._primary
        self._generations = 0
        # Replaced senders that calls still run on (or that wait for room in the reaper's queue),
        # oldest first; never the primary. Each goes to the reaper once idle.
        self._retired: list[_Engine] = []
        self._reaper = EngineReaper()
        self._replace_tokens = float(_REPLACE_BURST)
        self._tokens_at = time.monotonic()
        self._peer_replaced_at: dict[str, float] = {}  # session -> when it last caused a replacement
        self._probe_not_before: dict[str, float] = {}  # session -> when a dead peer is probed again
        self._replace_lock = threading.Lock()  # one replacement at a time
        self.engine_replacements = 0
        self.rpc_port = self._primary.rpc_port
        self.session_id = f"{hostname}:{self.rpc_port}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        # Sync writes block in C++ with the GIL released; one thread per concurrent peer.
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mooncake-write")
        # Calls whose wait ended with writes still in the engine, until they really return.
        self._in_doubt: list[_InDoubtCall] = []
        self._closed = False

    def _start_engine(self, generation: int) -> _Engine:
        engine = self._engine_class()
        rc = engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, self.device_name)
        if rc != 0:
            raise MooncakeError(
                f"TransferEngine.initialize({self.hostname!r}, 'P2PHANDSHAKE', {self.protocol!r}, "
                f"{self.device_name!r}) returned {rc}: check the protocol and that {self.hostname} is an "
                "address of this host"
            )
        return _Engine(engine, int(engine.get_rpc_port()), generation)

    # -- memory ---------------------------------------------------------------------------------

    def register(self, memory: Any) -> tuple[int, int]:
        """Register a host buffer once (idempotent per address); returns (address, length)."""
        addr, length = staging_address(memory)
        with self._lock:
            if self._closed:
                raise MooncakeError("register on a closed MooncakeEndpoint")
            if self._is_registered(addr, length):
                # A view into a registered buffer (a rank's pool inside one arena, a slice of the
                # staging buffer): registering it again would overlap the first registration.
                return addr, length
            known = self._registered.get(addr)
            if known is not None:
                if known < length:
                    raise MooncakeError(
                        f"buffer at {addr:#x} was registered with {known} bytes; re-registering a larger "
                        "buffer at the same address is not supported: register the full buffer up front"
                    )
                return addr, length
            # On the primary (peers write there) and on a replacement sender (writes read it).
            for eng in {id(e): e for e in (self._primary, self._sender)}.values():
                eng.register(addr, length)
            self._registered[addr] = length
        return addr, length

    def _is_registered(self, addr: int, length: int) -> bool:
        return any(a <= addr and addr + length <= a + n for a, n in self._registered.items())

    # -- receiving side ---------------------------------------------------------------------------

    def register_region(self, memory: Any, rank: int) -> RegionDescriptor:
        """Register a rank's pool (or its pinned host mirror) and describe it for senders.

        Memory registered after a sender's first write here is writable too: the receiver checks
        each write against its registered buffers, whether or not the sender cached this
        process's segment descriptor (tests/transfer/test_mooncake_peer_restart.py)."""
        addr, length = self.register(memory)
        return RegionDescriptor(
            rank=rank, transport="mooncake", endpoint=self.session_id, base_address=addr, length=length
        )

    # -- sending side ---------------------------------------------------------------------------

    def write(
        self,
        staging: Any,
        writes: Sequence[PlannedWrite],
        destinations: Mapping[int, RegionDescriptor],
        ticket_id: str,
        timeout_s: float,
        *,
        write_token: str = "",
    ) -> list[WriteOutcome]:
        """Push `writes` from `staging` into their destination regions; one outcome per write.

        Bad input (a segment outside staging or a region, a missing region) raises ValueError
        before anything is sent; transport failures come back as FAILED outcomes. A write still
        in the engine when `timeout_s` passes is IN_DOUBT: `staging` stays in use by it until
        `collect_finished()` returns its final outcome."""
        del write_token  # Mooncake has no authentication (docs/operations.md)
        if self._closed:
            raise MooncakeError("write on a closed MooncakeEndpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        base, staging_len = staging_address(staging)
        check_writes_fit(writes, destinations, staging_len)
        for w in writes:
            if destinations[w.dst_rank].transport != "mooncake":
                raise ValueError(f"destination rank {w.dst_rank} is not a mooncake region")
        if not self._is_registered(base, staging_len):
            self.register(staging)

        # Coalesce every segment bound for one peer session into as few batches as the peer
        # queue allows: batches, not segments, are what cost round trips.
        by_session: dict[str, list[int]] = {}
        for i, w in enumerate(writes):
            by_session.setdefault(destinations[w.dst_rank].endpoint, []).append(i)
        cancel = threading.Event()
        progress: dict[str, _SessionProgress] = {}
        futures = {}
        for session, idxs in by_session.items():
            prog = _SessionProgress(segments_left={i: len(writes[i].segments) for i in idxs})
            progress[session] = prog
            futures[session] = self._executor.submit(
                self._send_session, session, base, [(i, writes[i]) for i in idxs], destinations, prog, cancel
            )
        deadline = time.monotonic() + timeout_s
        # Hash while the engine sends (its threads run without the GIL; staging is read-only
        # meanwhile): hashing first cost ~30% of goodput at 32 MiB+ on a 16-core host.
        checksums = [write_checksum(staging, w) for w in writes]
        timed_out: set[str] = set()
        raised: dict[str, str] = {}
        for session, fut in futures.items():
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                timed_out.add(session)
            except Exception as exc:  # noqa: BLE001 - the session's call returned (by raising)
                # Its future is done: nothing more of it runs. Its started writes are FAILED
                # below; escaping here would leave the other sessions' calls unaccounted for.
                raised[session] = f"sending to {session} raised {exc!r}"
        cancel.set()

        outcomes: list[WriteOutcome] = []
        doubtful: list[tuple[int, PlannedWrite, str, int]] = []
        for i, w in enumerate(writes):
            session = destinations[w.dst_rank].endpoint
            prog = progress[session]
            with self._lock:
                left = prog.segments_left[i]
                started = i in prog.started
                failure = prog.failed.get(i) or raised.get(session)
                # `cancel` is set: a write not started now never starts (checked under the lock).
                returned = session not in timed_out or futures[session].done()
            if failure is None and left == 0:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, checksums[i]))
            elif not started:
                why = failure or f"not started: ticket {ticket_id} timed out after {timeout_s:.1f}s"
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, why))
            elif failure is not None or returned:
                # The engine call returned an error (or returned short): final, nothing more lands.
                why = failure or f"write to {session} ended with {left} segments unsent (cancelled)"
                outcomes.append(
                    WriteOutcome(w.row, w.src_rank, w.dst_rank, "FAILED", w.num_bytes, checksums[i], why)
                )
            else:
                why = (
                    f"stopped waiting after {timeout_s:.1f}s writing to {session}; the engine call still "
                    "runs and the write may still land"
                )
                outcomes.append(
                    WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", w.num_bytes, checksums[i], why)
                )
                doubtful.append((i, w, session, checksums[i]))
        if doubtful:
            with self._lock:
                self._in_doubt.append(_InDoubtCall(ticket_id, doubtful, progress, futures, timeout_s))
        return outcomes

    def collect_finished(self) -> list[FinishedCall]:
        """Calls that had in-doubt writes and have returned since: each write's final outcome.

        Called often (cheap when nothing is in doubt); each finished call is returned once."""
        with self._lock:
            calls, self._in_doubt = self._in_doubt, []
            done = [c for c in calls if all(f.done() for f in c.futures.values())]
            self._in_doubt = [c for c in calls if c not in done]
            finished = []
            for c in done:
                outcomes = []
                for i, w, session, checksum in c.writes:
                    prog = c.progress[session]
                    failure = prog.failed.get(i)
                    left = prog.segments_left[i]
                    if failure is None and left == 0:
                        outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, checksum))
                    else:
                        why = failure or (
                            f"the engine call to {session} returned after the {c.timeout_s:.1f}s wait "
                            f"with {left} segments unsent"
                        )
                        outcomes.append(
                            WriteOutcome(w.row, w.src_rank, w.dst_rank, "FAILED", w.num_bytes, checksum, why)
                        )
                finished.append(FinishedCall(c.ticket_id, tuple(outcomes)))
        return finished

    def in_doubt_tickets(self) -> list[str]:
        with self._lock:
            return [c.ticket_id for c in self._in_doubt]

    def _send_session(
        self,
        session: str,
        base: int,
        items: list[tuple[int, PlannedWrite]],
        destinations: Mapping[int, RegionDescriptor],
        prog: _SessionProgress,
        cancel: threading.Event,
    ) -> None:
        flat = [
            (i, base + s.src_offset, destinations[w.dst_rank].base_address + s.dst_offset, s.length)
            for i, w in items
            for s in w.segments
        ]
        step = _max_segments_per_batch()
        for start in range(0, len(flat), step):
            batch = flat[start : start + step]
            batch_writes = {i for i, *_ in batch}
            with self._lock:
                if cancel.is_set():
                    return
                prog.started |= batch_writes
            args = ([b[1] for b in batch], [b[2] for b in batch], [b[3] for b in batch])
            generation = self._sender.generation
            t0 = time.monotonic()
            rc = self._transfer(session, *args)
            tries = 1
            # Again, while the failure is quick. A quick failure to a peer that answers at its
            # RPC port is this engine's stale state for the session name (a process that took a
            # dead peer's port: the engine keeps writing to the dead one's data port, every
            # try; measured: benchmarks/mooncake/port_reuse.py): the next try goes through a
            # fresh engine (`_replace_sender`, bounded). Otherwise the same engine tries again: a
            # stale connection from a dead peer fails one batch at once. A slow failure (an
            # unreachable peer, a connect timeout) is not retried. The failed call has returned
            # (nothing of it is in flight), the pages are still this ticket's and the bytes are
            # the same: writing them again, through either engine, is safe.
            not_replaced = ""
            while (
                rc != 0
                and tries < _STALE_TRIES
                and time.monotonic() - t0 < _STALE_FAILURE_S
                and not cancel.is_set()
            ):
                why_not = self._replace_sender(session, generation, cancel)
                if why_not is not None:
                    not_replaced = why_not
                    time.sleep(_RETRY_PAUSE_S)
                if cancel.is_set():
                    break
                generation = self._sender.generation
                t0 = time.monotonic()
                rc = self._transfer(session, *args)
                tries += 1
            with self._lock:
                if rc != 0:
                    msg = (
                        f"Mooncake batch write to {session} returned {rc} ({len(batch)} segments, "
                        f"{tries} {'try' if tries == 1 else 'tries'}): peer unreachable, region not "
                        "registered there, or queue limit exceeded"
                        + (f"; not sent through a fresh engine: {not_replaced}" if not_replaced else "")
                    )
                    for i in batch_writes:
                        prog.failed.setdefault(i, msg)
                    # Later batches to a failed peer would only wait out the same failure.
                    return
                for i, *_ in batch:
                    prog.segments_left[i] -= 1

    def _replace_sender(self, session: str, failed_generation: int, cancel: threading.Event) -> str | None:
        """Write through a fresh engine from now on, because a batch to `session` failed fast on
        engine `failed_generation`. None if the next try should go through another engine than
        that one (replaced now, or by another thread since); otherwise why not.

        Only when that engine has written `session` before (stale state is what a fresh engine
        drops; a peer it never wrote fails a fresh one the same), a process answers at the
        session's RPC port (a dead peer is not helped by a new engine), and within the bounds
        above (token bucket per endpoint, interval per peer). A peer whose batch fails while
        another thread starts a new engine waits for it and tries that one. The replaced engine
        is destroyed only once no call runs on it (in-doubt ones included: they read their
        staging memory until they return)."""
        if self._replace_lock.locked():
            with self._replace_lock:  # a replacement under way (an engine start: milliseconds)
                pass
        with self._lock:
            if self._sender.generation != failed_generation:
                return None
            why_not = self._why_not_replace_locked(session, time.monotonic())
            if why_not is not None:
                return why_not
        if cancel.is_set():
            return "the write was cancelled"
        if self._probe(session) != 0:
            with self._lock:
                self._forget_expired_locked(time.monotonic())
                self._probe_not_before[session] = time.monotonic() + _DEAD_PEER_PROBE_S
            return f"{session} does not answer at its RPC port (a dead peer; probed again in {_DEAD_PEER_PROBE_S:.0f} s)"
        with self._replace_lock:
            with self._lock:
                if self._sender.generation != failed_generation:
                    return None
                now = time.monotonic()
                why_not = self._why_not_replace_locked(session, now)
                if why_not is not None:
                    return why_not
                # Taken before the engine starts: a failed start is not tried again at once.
                self._replace_tokens -= 1.0
                self._forget_expired_locked(now)
                self._peer_replaced_at[session] = now
                self._probe_not_before.pop(session, None)
                self._generations += 1
                generation = self._generations
            try:
                fresh = self._start_engine(generation)
                with self._lock:
                    registered = dict(self._registered)
                for addr, length in registered.items():
                    fresh.register(addr, length)
            except Exception as exc:  # noqa: BLE001 - keep writing through the old engine
                _log.error("mooncake_engine_replace_failed", session=session, error=repr(exc)[:500])
                return f"a fresh engine could not start: {exc!r}"[:300]
            with self._lock:
                # Memory registered meanwhile went to the primary and the old sender only.
                try:
                    for addr, length in self._registered.items():
                        if addr not in fresh.registered:
                            fresh.register(addr, length)
                except MooncakeError as exc:
                    _log.error("mooncake_engine_replace_failed", session=session, error=str(exc)[:500])
                    self._retired.append(fresh)  # no call ran on it: destroyed like a replaced one
                    self._reap_idle_locked()
                    return f"a fresh engine could not register memory: {exc}"[:300]
                old, self._sender = self._sender, fresh
                if old is not self._primary:
                    self._retired.append(old)
                self._reap_idle_locked()
                self.engine_replacements += 1
                retired = len(self._retired)
                tokens = self._replace_tokens
        _log.warning(
            "mooncake_engine_replaced", session=session, generation=generation, replaced_generation=old.generation,
            reason="a batch failed fast while the peer answers at its RPC port (a process on a dead peer's port)",
            replacements_left=int(tokens), retired_engines=retired,
        )  # fmt: skip
        return None

    def _why_not_replace_locked(self, session: str, now: float) -> str | None:
        """None if a batch to `session` that failed on the current sender may replace it now."""
        if self._closed:
            return "the endpoint is closed"
        if session not in self._sender.written:
            return (
                f"this engine never wrote {session}, so it holds nothing stale for it (a fresh engine "
                "would fail the same)"
            )
        if now < self._probe_not_before.get(session, 0.0):
            return f"{session} did not answer at its RPC port {_DEAD_PEER_PROBE_S:.0f} s ago or less"
        last = self._peer_replaced_at.get(session)
        if last is not None and now < last + _REPLACE_PEER_INTERVAL_S:
            return (
                f"{session} caused a replacement {now - last:.1f} s ago (one per peer per "
                f"{_REPLACE_PEER_INTERVAL_S:.0f} s)"
            )
        self._replace_tokens = min(
            float(_REPLACE_BURST), self._replace_tokens + (now - self._tokens_at) / _REPLACE_REFILL_S
        )
        self._tokens_at = now
        if self._replace_tokens < 1.0:
            wait = (1.0 - self._replace_tokens) * _REPLACE_REFILL_S
            return (
                f"{_REPLACE_BURST} fresh engines started lately, one more allowed per {_REPLACE_REFILL_S:.0f} s "
                f"(next in {wait:.1f} s)"
            )
        return None

    def _forget_expired_locked(self, now: float) -> None:
        """Keep the per-peer bookkeeping bounded: drop entries that no longer hold anything back."""
        if len(self._peer_replaced_at) + len(self._probe_not_before) < _MAX_PEER_ENTRIES:
            return
        self._peer_replaced_at = {s: t for s, t in self._peer_replaced_at.items() if now < t + _REPLACE_PEER_INTERVAL_S}
        self._probe_not_before = {s: t for s, t in self._probe_not_before.items() if now < t}

    def _reap_idle_locked(self) -> None:
        """Hand the retired engines no call runs on to the reaper (in order, while its queue has
        room). A call picks its engine (`_sender`, never a retired one) and counts itself on it
        under `_lock`, so an engine retired with no call counted can never see another one."""
        for eng in list(self._retired):
            if eng.in_flight == 0:
                if not self._reaper.has_room():
                    return  # kept until a later call or replacement finds room
                self._retired.remove(eng)
                self._reaper.submit(eng.hand_over(self.hostname), force=True)  # room checked

    def _acquire_sender(self) -> _Engine:
        with self._lock:
            eng = self._sender
            eng.in_flight += 1
            return eng

    def _release(self, eng: _Engine, wrote: str | None = None) -> None:
        with self._lock:
            if wrote is not None:
                eng.written.add(wrote)
            eng.in_flight -= 1
            if eng.in_flight == 0 and any(e is eng for e in self._retired):
                self._reap_idle_locked()

    def _probe(self, session: str) -> int:
        """send_probe through the current sending engine, counted as a call on it (the reaper
        never gets an engine that a probe still runs on)."""
        eng = self._acquire_sender()
        try:
            return int(eng.engine.send_probe(session))
        finally:
            self._release(eng)

    def _transfer(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """One batch to one peer through the current sending engine; 0 on completion, negative on
        failure (as the engine reports)."""
        eng = self._acquire_sender()
        rc = -1
        try:
            rc = self._transfer_on(eng.engine, session, srcs, dsts, lengths)
            return rc
        finally:
            self._release(eng, wrote=session if rc == 0 else None)

    def _transfer_on(self, engine: Any, session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        nbytes = sum(lengths)
        rate = self._goodput.get(session)
        nap = self.sleep_fraction * nbytes / rate if rate else 0.0
        t0 = time.perf_counter()
        if nap < _MIN_NAP_S:
            # Short (or first) batches: the sync call is cheaper than submit + status, and a
            # sleep this short would overshoot by a good part of itself.
            rc = int(engine.batch_transfer_sync_write(session, srcs, dsts, lengths))
        else:
            batch_id = engine.batch_transfer_async_write(session, srcs, dsts, lengths)
            if batch_id == 0:
                return -1  # not submitted: the peer's segment could not be opened
            time.sleep(nap)
            rc = int(engine.get_batch_transfer_status([batch_id]))
        elapsed = time.perf_counter() - t0
        if rc == 0 and nbytes >= _MIN_LEARN_BYTES:
            # EWMA of this peer's goodput; small batches measure latency, not bandwidth. An
            # estimate that is too low oversleeps once and then rises by 1/sleep_fraction.
            observed = nbytes / max(elapsed, 1e-6)
            self._goodput[session] = observed if rate is None else 0.7 * rate + 0.3 * observed
        return rc

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister memory and stop the write threads. Only call once no write is in flight and
        no peer may still write here: registered memory must outlive every transfer into it."""
        global _ENDPOINT
        if self._closed:
            return
        with self._lock:
            self._closed = True  # no replacement starts from here on
        with self._replace_lock:  # nor is one still running
            pass
        # Waits for every engine call, in-doubt ones included: registered memory outlives them.
        self._executor.shutdown(wait=True)
        with self._lock:
            # No call runs now. Every engine goes, the primary too: each takes milliseconds on
            # the reaper (about a second each at interpreter exit otherwise, GIL held).
            engines = [*self._retired, *([self._sender] if self._sender is not self._primary else []), self._primary]
            self._retired = []
            for eng in engines:
                if eng.engine is not None:
                    self._reaper.submit(eng.hand_over(self.hostname, replaced=False), force=True)
            self._registered.clear()
        self._reaper.close(timeout_s=_REAPER_CLOSE_S)
        with _ENDPOINT_LOCK:
            if _ENDPOINT is self:
                _ENDPOINT = None


_ENDPOINT: MooncakeEndpoint | None = None
_ENDPOINT_LOCK = threading.Lock()


def _bind_address(hostname: str) -> str:
    """The IP address `hostname` names on this host (Mooncake binds an address, not a name)."""
    import ipaddress
    import socket

    try:
        return str(ipaddress.ip_address(hostname.strip("[]")))
    except ValueError:
        return socket.gethostbyname(hostname)


def endpoint(hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> MooncakeEndpoint:
    """The process's one MooncakeEndpoint, created on first use; a second, different config raises."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None:
            _ENDPOINT = MooncakeEndpoint(hostname, protocol, device_name)
        elif (_ENDPOINT.hostname, _ENDPOINT.protocol, _ENDPOINT.device_name) != (hostname, protocol, device_name):
            raise MooncakeError(
                f"this process already runs a TransferEngine for {_ENDPOINT.session_id} "
                f"({_ENDPOINT.protocol}); one engine per process, asked for {hostname} ({protocol})"
            )
        return _ENDPOINT


def make_sender(hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> MooncakeEndpoint:
    return endpoint(hostname, protocol, device_name)


def make_receiver(hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> MooncakeEndpoint:
    return endpoint(hostname, protocol, device_name)
