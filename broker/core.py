"""BrokerCore: the broker's single authority over DiT pages, tickets and replicas.

Composes the replica registry, the page pools of each DiT replica (one per CFG group), the ticket records and the
journal, and enforces the lifecycle of DESIGN.md section 6 across them: reservation, arming,
reports, draining, fencing, and recovery after a restart. Every change is committed to the
journal before the method that makes it returns, and only then are its waiters woken
(`self.waiters`, waiters.py). With `journal_group_commit` a commit is queued to the journal's
writer thread rather than written in place, so whoever reveals the core's state outside the
process (the servicers' replies, the orchestrator's calls to replicas) first awaits the journal:
nothing leaves the process before the journal record behind it is on disk. The core remembers
which commit made each ticket, replica and pool what it is now (`commit_behind`), so a reply that
changed nothing awaits only the commits behind what it shows, not every commit queued before it.
The stored format of a ticket is codec.py's.
Must never do I/O other than the journal, never import gRPC or torch, and never block: it is
called from one asyncio event loop (the gRPC servicer and the orchestrator) and takes its
clock as a parameter so tests drive time by hand.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import structlog

from kvrelay import LAYOUT_VERSION
from kvrelay.broker.codec import ticket_from_json, ticket_to_json
from kvrelay.broker.journal import Journal, Synchronous
from kvrelay.broker.pool import NeverFits, PageState, ReplicaPages
from kvrelay.broker.registry import (
    MAX_REPLICAS,
    MAX_TOTAL_PAGES,
    MemoryRegionSpec,
    Registration,
    ReplicaRecord,
    ReplicaRegistry,
    ReplicaRole,
    ReplicaSpec,
    ReplicaStatus,
    takeover_needs_probe,
)
from kvrelay.broker.repeats import RepeatedWarnings
from kvrelay.broker.tickets import (
    HOLDING_STATES,
    AlreadyExists,
    BrokenInvariant,
    FailedPrecondition,
    InvalidArgument,
    LoadKey,
    NotFound,
    ReplicaId,
    RowPages,
    Ticket,
    TicketId,
    TicketOutcome,
    TicketRecord,
    TicketState,
    Unauthenticated,
    Unavailable,
    WriteKey,
    WriteStatus,
)
from kvrelay.broker.waiters import ChangeWaiters
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.planner import MAX_CFG_ROWS, PlannedWrite, RowSpec, plan_transfer

log = structlog.get_logger("kvrelay.broker")

# How long placement avoids an AR/DiT pair after a failed transfer, doubling per failure.
LINK_BACKOFF_INITIAL_S = 5.0
LINK_BACKOFF_MAX_S = 120.0

Clock = Callable[[], float]


class SteadyWallClock:
    """The broker's default clock: seconds since the epoch that never step. The wall clock is
    read once, when the clock is made, and from then on only CLOCK_MONOTONIC's progress is added.

    Every period the core measures is a duration: leases, the quiet period, the receiver's settle
    time (`receiver_settle_seconds`), how long a replica has been down. On `time.time` they
    followed the wall clock's steps (NTP stepping a drifted clock, `date -s`, a VM resumed and
    re-synced): a step forward of more than the settle time freed at once the pages of a `FAILED`
    or `WRITER_GONE` write, while the receiving DiT rank, stopped, still held bytes of it in its
    socket, the very case the settle time holds them for (docs/broker.md, Clock). Its readings stay
    close to the wall clock (ticket times are shown as timestamps, and journaled ones are compared
    after a restart, which reads the wall clock afresh)."""

    def __init__(self, wall: Clock = time.time, monotonic: Clock = time.monotonic) -> None:
        self._monotonic = monotonic
        self._offset = wall() - monotonic()

    def __call__(self) -> float:
        return self._offset + self._monotonic()

# How many ids of an unknown listing one log line names (the count is always logged).
_LOGGED_IDS = 8

# Reasons the broker itself gives when it ends a request.
BROKER_RESTARTED = "BROKER_RESTARTED"
DIT_REPLICA_RESTARTED = "DIT_REPLICA_RESTARTED"
# An operator forgot the ticket's DiT (or its unarmed or resolved AR) by force (`forget_replica`).
REPLICA_FORGOTTEN = "REPLICA_FORGOTTEN"

# The journal's meta key of the incarnations forgotten by force: {replica_id: incarnation_id}.
_FORGOTTEN_META = "forgotten_incarnations"
# Forgotten-by-force incarnations kept refused per replica id (each forced forget adds one).
_MAX_FORGOTTEN_PER_ID = 16
# Idle incarnations forgotten by this process that may register again with a free pool (BrokerCore._forgotten_idle).
_MAX_FORGOTTEN_IDLE = 1024
# Probes kept per DiT replica (its heartbeat echoes the last it got; a few cover replies crossing).
_PROBES_KEPT = 8
# The soonest the broker asks a DiT for its next heartbeat while it waits for proof of its receivers.
_PROOF_HEARTBEAT_MIN_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class ReportedWrite:
    """One write's report, as the writer sent it (ReportWrite, alone or in a batch)."""

    key: WriteKey
    status: WriteStatus
    checksum: int = 0
    nbytes: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class Arming:
    """What the AR gets when it arms a ticket: where to write, and exactly which writes."""

    ticket: Ticket
    destinations: tuple[MemoryRegionSpec, ...]
    writes: tuple[PlannedWrite, ...]
    dit_geometry: KvGeometry
    dit_tensor_parallel_size: int
    dit_sequence_parallel_size: int
    dit_num_pages: int
    verify_checksums: bool
    src_shards: int = 1
    dit_cfg_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class RegisterReply:
    lease_seconds: float
    fenced: bool
    registration: Registration


@dataclass(frozen=True, slots=True)
class ReceiverRun:
    """What a DiT heartbeat says of its receiving processes (HeartbeatRequest.receiver_run): each
    rank and the replica's own process had run without a stall for `stall_free_seconds` (their
    minimum, on the replica's clock) when it was sent, after it got the reply carrying `probe`."""

    probe: int
    stall_free_seconds: float
    ranks: int


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    fenced: bool
    fence_reason: str
    lease_seconds: float
    # (ticket_id, write) of DRAINING tickets this replica writes: report them when they resolve.
    poll_writes: tuple[tuple[TicketId, WriteKey], ...]
    # DiT: the number its next heartbeat echoes (ReceiverRun.probe); 0 for an AR, or proofs off.
    probe: int = 0
    # DiT, > 0: a ticket waits for proof that its receivers drained: heartbeat again this soon.
    next_heartbeat_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolStatus:
    replica_id: ReplicaId
    total: int
    free: int
    reserved: int
    draining: int
    fenced: bool
    # Live (registered since this broker started, lease current, not deregistered). A replica the
    # journal kept but that is not live keeps its accounting (in-doubt pages stay held) and is
    # reported, but its free pages are no capacity: placement skips it (placement.py).
    up: bool = True

    @property
    def available(self) -> int:
        """Pages a request could be given now: the free ones of a live, unfenced replica."""
        return self.free if self.up and not self.fenced else 0


class BrokerCore:
    """The broker's state. Single-threaded: call it from one event loop (or one thread)."""

    def __init__(
        self,
        journal_path: str | Path | None,
        *,
        clock: Clock | None = None,
        lease_seconds: float = 10.0,
        drain_quiet_seconds: float = 2.0,
        receiver_settle_seconds: float = 0.0,
        receiver_proof_window_seconds: float | None = None,
        registration_token: str | None = None,
        verify_checksums: bool = True,
        layout_version: int = LAYOUT_VERSION,
        journal_synchronous: Synchronous = "FULL",
        released_history: int = 4096,
        journal_group_commit: bool = False,
        max_replicas: int = MAX_REPLICAS,
        max_total_pages: int = MAX_TOTAL_PAGES,
        forget_down_after_seconds: float | None = None,
    ) -> None:
        # journal_path None = an in-memory SQLite journal: same code path, nothing survives.
        self.journal = Journal(
            ":memory:" if journal_path is None else journal_path, journal_synchronous,
            group_commit=journal_group_commit,
        )  # fmt: skip
        # None: SteadyWallClock (never follows a step of the wall clock; tests pass their own).
        clock = clock if clock is not None else SteadyWallClock()
        self.clock: Clock = clock
        # Warnings a caller can trigger once per RPC (stale incarnations): one line per replica
        # per minute, with how many were left out.
        self._repeats = RepeatedWarnings(clock)
        self.lease_seconds = lease_seconds
        self.drain_quiet_seconds = drain_quiet_seconds
        # Pages of a ticket whose writer was proven gone (not returned) wait this long after the
        # proof, and for the DiT replica to be up: a stopped DiT rank may still hold the dead
        # sender's bytes in its socket buffer (KvRelayConfig.receiver_settle_seconds). 0: off.
        self.receiver_settle_seconds = receiver_settle_seconds
        # ...unless a heartbeat of that DiT, sent this long after the resolution, proves that each
        # of its receiving processes ran without a stall for this long
        # (KvRelayConfig.receiver_proof_window_seconds; `_receiver_proof`). None: never (the whole
        # settle time, always).
        self.receiver_proof_window_seconds = receiver_proof_window_seconds
        # The next probe number (random start: an echo of an earlier broker process's number
        # matches nothing here), and each DiT's recent probes with when they were made, per
        # incarnation. Not journaled: after a restart, nothing echoed before it proves anything.
        self._probe_next = secrets.randbits(52) + 1
        self._probes: dict[ReplicaId, tuple[str, deque[tuple[int, float]]]] = {}
        # Tickets whose receivers were proven drained after the resolution time kept here (a later
        # resolution needs a proof of its own). Tickets restored from the journal get none: a
        # restart keeps the whole settle time.
        self._receiver_drained: dict[TicketId, float] = {}
        self._restored_unsettled: set[TicketId] = set()
        # Tickets with a FAILED or WRITER_GONE write released after proof / after the settle time.
        self.receiver_settled_early_total = 0
        self.receiver_settled_full_total = 0
        # (AR, DiT) pairs whose last transfer failed: (avoid until, backoff) (`note_transfer_failed`).
        self._suspect_links: dict[tuple[ReplicaId, ReplicaId], tuple[float, float]] = {}
        self.registration_token = registration_token or None
        # Every token RegisterReplicaRequest.token may carry: the shared replica token, and during
        # a rotation's grace the one it replaced (broker.main gives its CredentialRotation's).
        self.registration_tokens: Callable[[], Sequence[str]] = (
            lambda: (self.registration_token,) if self.registration_token else ()
        )
        self.verify_checksums = verify_checksums
        # Bounds on what registrations (any holder of the replica token) make the broker hold.
        self.registry = ReplicaRegistry(layout_version, max_replicas, max_total_pages)
        # broker.forget_down_replicas_after_seconds (None: off): `tick` forgets a replica safe to
        # forget once it has been down this long; one restored from the journal that never
        # registers again counts as down from this broker's start (`down_since`).
        self.forget_down_after_seconds = forget_down_after_seconds
        # The incarnation, per replica id, that `forget_down_replicas` last said it keeps (one
        # warning, not one per maintenance pass): only `kvrelay forget --force` can let it go.
        self._kept_down: dict[ReplicaId, str] = {}
        self.start_time = clock()
        self._pools: dict[ReplicaId, ReplicaPages] = {}
        self._tickets: dict[TicketId, TicketRecord] = {}
        self._by_request: dict[str, TicketId] = {}
        self._plans: dict[TicketId, tuple[PlannedWrite, ...]] = {}
        self._released: OrderedDict[TicketId, Ticket] = OrderedDict()
        self._released_history = released_history
        self._sequence = 0
        self.released_total = 0
        # The journal commit (Journal.commit's number) that last changed each object, for
        # `commit_behind`: a ticket (released ones while they are kept), a replica's record, a DiT's
        # pool (its pages and its existence), the tickets an AR writes (its heartbeat's polls), and
        # which replicas exist (a forgotten one is gone from every listing). An object absent from
        # these maps has not changed since the journal was loaded: on disk.
        self._ticket_commit: dict[TicketId, int] = {}
        self._replica_commit: dict[ReplicaId, int] = {}
        self._pool_commit: dict[ReplicaId, int] = {}
        self._ar_tickets_commit: dict[ReplicaId, int] = {}
        self._membership_commit = 0
        # Who waits for a ticket's next version or for freed pages (WatchTicket, the queue).
        self.waiters = ChangeWaiters(self._snapshot)
        # Set by the orchestrator: told when a `CancelTicket` from outside the request's own
        # pipeline (an operator) ended a ticket's request, so that it ends the generation too.
        self.on_request_cancelled: Callable[[Ticket], None] | None = None
        # Set by the orchestrator: told which tickets a forced `forget_replica` ended, so that it
        # fails their generations at once (their stage calls may wait on a replica that is gone).
        self.on_replica_forgotten: Callable[[ReplicaId, Sequence[Ticket]], None] | None = None
        # Incarnations forgotten by force, per replica id (the latest _MAX_FORGOTTEN_PER_ID),
        # journaled (meta): a registration of one is answered fenced and kept nowhere (its process
        # fails stop), so a process that was only cut off never gets a pool again in the memory
        # that old writers may still target. Never lifted by a later incarnation of the id: its
        # lock proves the old process gone only on the same host, and a replica forgotten for
        # good is usually restarted elsewhere (incarnation ids are never reused, so keeping them
        # refuses nothing else).
        self._forgotten: dict[ReplicaId, list[str]] = {}
        # Incarnations this process forgot idle (no ticket named them, no page held): what the
        # broker knew of them was complete, so one registering again (`registered_before`) gets
        # a free pool as before. Not journaled: after a restart they are unknown like any other.
        self._forgotten_idle: OrderedDict[tuple[ReplicaId, str], None] = OrderedDict()
        self._restore()
        # With group commit the replay's own commit is queued: on disk before anyone is served,
        # and a failure to write it raised here, as without (`kvrelay broker` then exits 1).
        self.journal.flush()
        if self.journal.failure is not None:
            raise self.journal.failure

    # ================================================================== replicas

    def listing_bounds(self, spec: ReplicaSpec) -> tuple[int, int]:
        """(writes, tickets): the most `unresolved_writes` and the most `held_ticket_ids` (and,
        separately, `owed_releases`) a replica with this spec can list, derived from what it
        could hold, never a fixed number (docs/broker.md, Bounds on what a replica lists).

        A DiT lists tickets it holds or owes a release for: every such ticket holds a page of its
        pool, except those of calls it still runs (at most `max_num_seqs`) whose ticket the broker
        released before the call noticed, so at most `num_pages` x `cfg_parallel_size` +
        `max_num_seqs` of each; it sends no writes. An AR
        lists writes in flight: each lands in a page of some DiT rank the broker accounts (a rank
        holds each page for one row of one ticket, written by each AR rank at most once), so at
        most `tensor_parallel_size` x the sum over the DiT replicas the broker keeps (journaled
        ones too) of `num_pages` x their rank count; it lists no tickets."""
        if spec.role is ReplicaRole.DIT:
            return 0, spec.num_pages * spec.cfg_parallel_size + spec.max_num_seqs
        dit_writes = sum(
            r.spec.num_pages * r.spec.world_size for r in list(self.registry) if r.spec.role is ReplicaRole.DIT
        )
        return spec.tensor_parallel_size * dit_writes, 0

    def check_listing(self, spec: ReplicaSpec, *, writes: int = 0, held: int = 0, owed: int = 0) -> None:
        """Refuse (INVALID_ARGUMENT TOO_MANY_ENTRIES, naming the field and its bound) a listing
        longer than `listing_bounds(spec)`: bounded only by the 8 MiB request before, one
        RegisterReplica could list ~190k made-up writes, each looked up and logged."""
        if not (writes or held or owed):
            return  # the common heartbeat: no bound to look up (an AR's sums every DiT pool)
        max_writes, max_tickets = self.listing_bounds(spec)
        why = (
            f"{spec.replica_id} is a DiT with {spec.num_pages} pages x {spec.cfg_parallel_size} CFG groups "
            f"and max_num_seqs {spec.max_num_seqs}"
            if spec.role is ReplicaRole.DIT
            else f"{spec.replica_id} is an AR with {spec.tensor_parallel_size} ranks writing into the DiT pages "
            "the broker keeps"
        )
        for field_name, listed, bound in (
            ("unresolved_writes", writes, max_writes),
            ("held_ticket_ids", held, max_tickets),
            ("owed_releases", owed, max_tickets),
        ):
            if listed > bound:
                raise InvalidArgument(
                    "TOO_MANY_ENTRIES",
                    f"{field_name}: {listed} entries, at most {bound} ({why}: it cannot hold more)",
                )

    def register_replica(
        self,
        spec: ReplicaSpec,
        *,
        token: str | None = None,
        unresolved_writes: Iterable[tuple[TicketId, WriteKey]] = (),
        held_ticket_ids: Iterable[TicketId] = (),
        owed_releases: Mapping[TicketId, tuple[TicketOutcome, str]] | None = None,
        alive_incarnation: str = "",
        registered_before: bool = False,
        highest_ticket_sequence: int = 0,
    ) -> RegisterReply:
        """Register (or re-register) a replica. Idempotent for the same incarnation.

        A new incarnation proves the old process gone: its unresolved writes become
        WRITER_GONE (AR), or its tickets lose their memory and are released (DiT).
        `owed_releases` (DiT): the releases it has not had acknowledged, with their outcomes.
        `alive_incarnation`: the incarnation that answered at the registered endpoint when the
        caller asked (`registry.takeover_needs_probe`), "" when none did: while that one is still
        the registered incarnation and may be alive, a new one is refused `REPLICA_ID_IN_USE`.
        `registered_before` (DiT): this incarnation was registered before, by this broker or
        another; one this broker holds no record of is answered fenced (`Registration.UNKNOWN`), as
        is one that claimed pages of a ticket numbered above the journal's last
        (`highest_ticket_sequence`: this journal is older than what the DiT saw).
        """
        accepted = self.registration_tokens()
        # Every one compared, always: timing tells nothing about which matched.
        if accepted and not [t for t in accepted if hmac.compare_digest((token or "").encode(), t.encode())]:
            raise Unauthenticated("BAD_REGISTRATION_TOKEN", "RegisterReplica: the registration token is wrong")
        unresolved_writes = list(unresolved_writes)
        held_ticket_ids = list(held_ticket_ids)
        owed_releases = owed_releases or {}
        self.check_listing(spec, writes=len(unresolved_writes), held=len(held_ticket_ids), owed=len(owed_releases))
        if self.incarnation_forgotten(spec):
            # Forgotten by force while it may have been alive behind a partition: its tickets were
            # ended and its pool dropped, and writes into its memory may still land. Fenced, it
            # fails stop; a new incarnation (new memory, fresh transport ports) may register.
            log.warning("forgotten_incarnation_refused", replica_id=spec.replica_id, incarnation=spec.incarnation_id)
            return RegisterReply(self.lease_seconds, True, Registration.FORGOTTEN)
        now = self.clock()
        old = self.registry.find(spec.replica_id)
        if (registered_before and self._incarnation_unknown(spec, old)) or (
            spec.role is ReplicaRole.DIT and highest_ticket_sequence > self._sequence
        ):
            # Its tickets were lost with the journal (or never in the one this broker holds):
            # an AR's write may still land in any page of its memory, and nobody alive can say
            # which (the writer may be stopped, the DiT never saw the ticket). Taking its pool as
            # free would hand those pages to new tickets. Fenced and kept nowhere, it fails stop;
            # its next incarnation (new memory, new transport ports) registers with a free pool.
            log.error("unknown_incarnation_refused", replica_id=spec.replica_id, incarnation=spec.incarnation_id,
                      journaled_incarnation=old.spec.incarnation_id if old is not None else None,
                      highest_ticket_sequence=highest_ticket_sequence, journal_sequence=self._sequence)  # fmt: skip
            return RegisterReply(self.lease_seconds, True, Registration.UNKNOWN)
        old_was_up = old is not None and old.up(now)
        if (
            old is not None
            and alive_incarnation
            and old.spec.incarnation_id == alive_incarnation
            and takeover_needs_probe(old, spec, now)
        ):
            self._refuse_duplicate(old, spec, now)
        if (old is None and len(self.registry) >= self.registry.max_replicas) or self.registry.exceeds_page_budget(
            spec
        ):
            self._forget_idle_replicas(now, keep=spec.replica_id)
        kind, record = self.registry.register(spec, now, self.lease_seconds)
        changed: list[TicketRecord] = []
        if kind is Registration.NEW_INCARNATION:
            assert old is not None
            old_incarnation = old.spec.incarnation_id
            changed = self._old_incarnation_gone(spec)
            # Every start of a node registers new incarnations over the journal's old ones: after
            # a clean stop or a lapsed lease that is routine. Only replacing a live incarnation,
            # or one that left tickets behind, deserves a warning.
            notice = log.warning if old_was_up or changed else log.info
            notice(
                "replica_new_incarnation",
                replica_id=spec.replica_id,
                old_incarnation=old_incarnation,
                incarnation=spec.incarnation_id,
                old_was_up=old_was_up,
                tickets_changed=len(changed),
            )
        elif kind is Registration.SAME_INCARNATION:
            changed = self._reconcile(spec, unresolved_writes, held_ticket_ids, owed_releases)
        if spec.role is ReplicaRole.DIT and spec.replica_id not in self._pools:
            self._pools[spec.replica_id] = _pages_of(spec)
        self._commit(changed, [record])
        log.info(
            "replica_registered",
            replica_id=spec.replica_id,
            role=spec.role.value,
            incarnation=spec.incarnation_id,
            registration=kind.value,
            fenced=record.fenced,
        )
        self.waiters.notify_change()
        return RegisterReply(self.lease_seconds, record.fenced, kind)

    def _stale_report_ignored(self, rpc: str, ticket_id: TicketId, replica_id: ReplicaId, incarnation_id: str) -> None:
        """A report or release from a stale incarnation: logged at most once per replica per
        minute (RepeatedWarnings: a caller holding the replica token can send one per RPC)."""
        suppressed = self._repeats.admit("stale_incarnation_report_ignored", replica_id)
        if suppressed is not None:
            log.warning("stale_incarnation_report_ignored", rpc=rpc, replica_id=replica_id, incarnation=incarnation_id,
                        suppressed=suppressed, **({"ticket_id": ticket_id} if ticket_id else {}))

    def _refuse_duplicate(self, old: ReplicaRecord, spec: ReplicaSpec, now: float) -> NoReturn:
        """Refuse a second process of a replica id whose registered incarnation answers (never
        naming that incarnation: with a shared token its id is what guards its reports). Logged at
        most once per replica id per minute (RepeatedWarnings: the refused one asks again every
        second, and a holder of the replica token may ask at will)."""
        suppressed = self._repeats.admit("replica_id_in_use_refused", spec.replica_id)
        if suppressed is not None:
            log.warning("replica_id_in_use_refused", replica_id=spec.replica_id, live_endpoint=old.spec.endpoint,
                        refused_endpoint=spec.endpoint, refused_incarnation=spec.incarnation_id,
                        suppressed=suppressed)  # fmt: skip
        lease = (
            f"its lease runs {old.lease_expire_time - now:.1f} s more"
            if old.up(now)
            else "the broker restarted and it has not registered again yet"
        )
        raise AlreadyExists(
            "REPLICA_ID_IN_USE",
            f"replica {spec.replica_id} is in use: its registered process answers at {old.spec.endpoint} "
            f"({lease}); this process ({spec.endpoint}) "
            "is a second one of the same replica id, refused so that the live one keeps serving. Stop one of "
            "them, or start this one with another --replica index (docs/operations.md, Across hosts)",
        )

    def heartbeat(
        self,
        replica_id: ReplicaId,
        incarnation_id: str,
        unresolved_writes: Iterable[tuple[TicketId, WriteKey]] = (),
        receiver_run: ReceiverRun | None = None,
    ) -> HeartbeatReply:
        """Renew the lease; while DRAINING tickets exist, ask the writer about their writes. A DiT's
        `receiver_run` may prove that its receivers drained (`_receiver_proof`)."""
        try:
            record = self.registry.heartbeat(replica_id, incarnation_id, self.clock(), self.lease_seconds)
        except FailedPrecondition as err:
            if err.reason == "STALE_INCARNATION":
                suppressed = self._repeats.admit("stale_incarnation_heartbeat_ignored", replica_id)
                if suppressed is not None:
                    log.warning("stale_incarnation_heartbeat_ignored", replica_id=replica_id,
                                incarnation=incarnation_id, suppressed=suppressed)
            raise
        if record.unreachable:
            # The process is alive again (or was all along, behind a path that failed): placeable.
            record.unreachable = False
            log.info("replica_reachable", replica_id=replica_id, incarnation=incarnation_id)
            self.waiters.notify_change()
        listed = list(unresolved_writes)
        self.check_listing(record.spec, writes=len(listed))
        if listed:
            # Informational only: absence from this list is no proof (a ReserveTicket answer may
            # still be in flight to the writer), so only explicit reports resolve writes.
            log.info("replica_unresolved_writes", replica_id=replica_id, count=len(listed))
        poll: list[tuple[TicketId, WriteKey]] = []
        if record.spec.role is ReplicaRole.AR:
            for t in self._tickets.values():
                if (
                    t.state is TicketState.DRAINING
                    and t.ar_replica_id == replica_id
                    and t.armed_incarnation == incarnation_id
                ):
                    poll.extend((t.ticket_id, k) for k in t.unresolved())
        probe, soon = 0, 0.0
        if record.spec.role is ReplicaRole.DIT and self.receiver_proof_window_seconds is not None:
            probe, soon = self._receiver_proof(record, receiver_run, self.clock())
        return HeartbeatReply(record.fenced, record.fence_reason, self.lease_seconds, tuple(poll), probe, soon)

    def _receiver_proof(self, record: ReplicaRecord, run: ReceiverRun | None, now: float) -> tuple[int, float]:
        """A DiT heartbeat received at `now`: note the tickets of that DiT whose receivers it
        proves drained, make its next probe, and say how soon the next heartbeat could prove more.

        A ticket with a FAILED or WRITER_GONE write resolved (last) at R is proven when the
        heartbeat echoes a probe made at or after R + window (so it was sent then or later,
        whatever the network delayed), covers every rank, and reports each receiving process
        stall-free for at least window: each then ran, since R or since its last stall after R,
        for the drain margin past the longest stop its beat misses (docs/broker.md, Draining).
        Durations only: nothing compares the replica's clock with the broker's."""
        window = self.receiver_proof_window_seconds
        assert window is not None
        replica_id, incarnation = record.spec.replica_id, record.spec.incarnation_id
        kept = self._probes.get(replica_id)
        if kept is None or kept[0] != incarnation:
            kept = self._probes[replica_id] = (incarnation, deque(maxlen=_PROBES_KEPT))
        issued = None
        if run is not None and run.probe:
            issued = next((at for number, at in kept[1] if number == run.probe), None)
        complete = run is not None and run.ranks == record.spec.world_size
        stall_free = run.stall_free_seconds if run is not None and math.isfinite(run.stall_free_seconds) else 0.0
        soonest = math.inf
        for t in self._tickets.values():
            resolved = t.last_resolution_time
            if (
                t.dit_replica_id != replica_id
                or t.dit_incarnation != incarnation
                or resolved is None
                or t.ticket_id in self._restored_unsettled
                or self._receiver_drained.get(t.ticket_id) == resolved
                or t.unresolved()
                or not t.receiver_unsettled_writes()
            ):
                continue
            if complete and issued is not None and issued >= resolved + window and stall_free >= window:
                self._receiver_drained[t.ticket_id] = resolved
                log.info("receiver_drain_proven", ticket_id=t.ticket_id, replica_id=replica_id,
                         after_seconds=round(now - resolved, 3), stall_free_seconds=round(stall_free, 3))  # fmt: skip
            elif complete and now < resolved + self.receiver_settle_seconds:
                # When a probe made now, echoed, could prove it (a stall-free run grows meanwhile).
                soonest = min(soonest, max(resolved + window - now, window - stall_free))
        number = self._probe_next
        self._probe_next += 1
        kept[1].append((number, now))
        return number, 0.0 if soonest == math.inf else max(soonest, _PROOF_HEARTBEAT_MIN_SECONDS)

    def _forget_idle_replicas(self, now: float, keep: ReplicaId) -> None:
        """Make room in a full registry: forget every replica `forget_refusal` allows (not up, not
        fenced, named by no live ticket, no page held). `keep`, the replica registering, is never
        forgotten: its registration decides its record."""
        named = self._named_replicas()
        idle = [
            r.spec.replica_id
            for r in self.registry
            if r.spec.replica_id != keep and self.forget_refusal(r, now, named) is None
        ]
        if idle:
            self._forget(idle, why="registry_full")

    def down_since(self, record: ReplicaRecord) -> float:
        """Since when `record` has been down, as this broker knows (meaningful only while it is not
        up): a record restored from the journal since the broker's start (whatever its lease was
        before the restart), a deregistered one since its deregistration, else since its lease
        expired."""
        if record.needs_registration:
            return self.start_time
        if record.deregistered and record.deregister_time is not None:
            return record.deregister_time
        return record.lease_expire_time

    def forget_down_replicas(self, now: float) -> list[ReplicaId]:
        """broker.forget_down_replicas_after_seconds: forget every replica that has been down that
        long and that `forget_refusal` allows (called by `tick`). Returns the ids forgotten."""
        after = self.forget_down_after_seconds
        if after is None:
            return []
        down = [r for r in self.registry if not r.up(now) and now - self.down_since(r) >= after]
        if not down:
            return []
        named = self._named_replicas()
        gone = []
        for r in down:
            refusal = self.forget_refusal(r, now, named)
            if refusal is None:
                gone.append(r.spec.replica_id)
            elif self._kept_down.get(r.spec.replica_id) != r.spec.incarnation_id:
                # Never forced by the clock (a lease is no proof): say once that only an operator can.
                self._kept_down[r.spec.replica_id] = r.spec.incarnation_id
                log.warning("replica_down_too_long_kept", replica_id=r.spec.replica_id, reason=refusal.reason,
                            down_seconds=round(now - self.down_since(r), 1), message=refusal.message)  # fmt: skip
        if gone:
            self._forget(gone, why="down_too_long")
        return gone

    def forget_replica(self, replica_id: ReplicaId, *, force: bool = False) -> list[Ticket]:
        """Operator (ForgetReplica): forget a replica gone for good (an earlier config's, a retired
        host's), by the rule that makes room in a full registry (`forget_refusal`): its record,
        pool, journal row and metric labels. NOT_FOUND UNKNOWN_REPLICA for an id the broker does
        not hold (one already forgotten too); FAILED_PRECONDITION naming why for one it must keep.

        `force` (the operator says it is gone for good) forgets one that is fenced or that live
        tickets name too, wherever that is safe while its process may still be alive behind a
        partition: its incarnation is refused for good (a registration of it is answered fenced,
        `_forgotten`), so its page ids are only ever handed out again in a new incarnation's
        memory, which no old writer reaches (fresh transport ports: the proof a DiT restart gives).
        A DiT's tickets are released (FAILED, REPLICA_FORGOTTEN: their memory is as good as gone);
        an AR's unarmed tickets roll back and its armed ones whose writes are all final end. Still
        refused: one that is up (REPLICA_UP), and an AR with unresolved writes
        (REPLICA_WRITES_IN_DOUBT: they may land in a live DiT's pages). Returns the tickets it
        ended; `on_replica_forgotten` is told of them once the change is journaled."""
        record = self.registry.find(replica_id)
        if record is None:
            raise NotFound(
                "UNKNOWN_REPLICA", f"replica {replica_id!r}: the broker holds no such replica (never registered, or forgotten)"
            )
        now = self.clock()
        named = self._named_replicas()
        refusal = self.forget_refusal(record, now, named, force=force)
        if refusal is not None:
            raise refusal
        forced = record.fenced or bool(named.get(replica_id))
        ended: list[TicketRecord] = []
        if forced:
            ended = self._end_tickets_of(record, now)
            refused = [i for i in self._forgotten.get(replica_id, []) if i != record.spec.incarnation_id]
            self._forgotten[replica_id] = [*refused, record.spec.incarnation_id][-_MAX_FORGOTTEN_PER_ID:]
            log.warning("replica_forgotten_by_force", replica_id=replica_id, incarnation=record.spec.incarnation_id,
                        fenced=record.fenced, tickets_ended=len(ended),
                        ticket_ids=[t.ticket_id for t in ended[:_LOGGED_IDS]])  # fmt: skip
        self._forget([replica_id], why="operator_force" if forced else "operator", tickets=ended, tombstones=forced)
        snapshots = [t.snapshot() for t in ended]
        if snapshots and self.on_replica_forgotten is not None:
            self.on_replica_forgotten(replica_id, snapshots)
        return snapshots

    def forgotten_incarnations(self) -> list[tuple[ReplicaId, str]]:
        """The incarnations forgotten by force that `register_replica` refuses, as (replica id,
        incarnation id), by id, an id's oldest first (ListReplicas shows them to the operator)."""
        return [(r, i) for r in sorted(self._forgotten) for i in self._forgotten[r]]

    def _incarnation_unknown(self, spec: ReplicaSpec, old: ReplicaRecord | None) -> bool:
        """Whether a DiT incarnation that was registered before is unknown to this broker: no
        record of its id, or one of another incarnation (a journal older than it), and not one
        this process forgot idle (`_forgotten_idle`: nothing of it was in doubt)."""
        if spec.role is not ReplicaRole.DIT:
            return False  # an AR holds no pool: its in-doubt writes land in DiT memory
        if old is not None and old.spec.incarnation_id == spec.incarnation_id:
            return False
        return (spec.replica_id, spec.incarnation_id) not in self._forgotten_idle

    def incarnation_forgotten(self, spec: ReplicaSpec) -> bool:
        """Whether `spec`'s incarnation was forgotten by force: `register_replica` answers it fenced
        and keeps nothing of it (the servicer then neither checks nor dials its endpoint)."""
        return spec.incarnation_id in self._forgotten.get(spec.replica_id, ())

    def forget_refusal(
        self,
        record: ReplicaRecord,
        now: float,
        named: Mapping[ReplicaId, list[TicketId]] | None = None,
        *,
        force: bool = False,
    ) -> FailedPrecondition | None:
        """Why `record` must be kept, or None when nothing needs it: it is not up (deregistered,
        lapsed, or restored and not registered again), not fenced (its process must fail stop: the
        fence is kept until a new incarnation registers), no live ticket names it (no write of its
        can be unresolved) and no page of its pool is held. Its next registration is simply NEW.
        `named`: `_named_replicas()`, when many records are asked about at once.

        `force` (`forget_replica`) lets a fenced one go and one that live tickets name, except an
        AR whose armed tickets have unresolved writes: never one that is up."""
        replica_id = record.spec.replica_id
        if record.up(now):
            return FailedPrecondition(
                "REPLICA_UP",
                f"replica {replica_id} is up (its lease is current): stop it (or deregister it) and let its "
                "lease lapse first" + (" (--force does not forget a live replica)" if force else ""),
            )
        if record.fenced and not force:
            return FailedPrecondition(
                "REPLICA_FENCED",
                f"replica {replica_id} is fenced ({record.fence_reason}): kept until a new incarnation of it "
                "registers, as its process must fail stop; if it is gone for good, forget it with --force "
                "(that incarnation is then refused for good)",
            )
        tickets = (self._named_replicas() if named is None else named).get(replica_id, [])
        if tickets and not force:
            return FailedPrecondition(
                "REPLICA_HOLDS_TICKETS",
                f"replica {replica_id} is named by {len(tickets)} live tickets ({', '.join(tickets[:_LOGGED_IDS])}): "
                "writes of theirs may still land; retry once they are released (kvrelay status lists them), or, "
                "if it is gone for good, forget it with --force (ends them where that is safe)",
            )
        if force and record.spec.role is ReplicaRole.AR and tickets:
            in_doubt = [
                t for t in self._tickets.values() if t.ar_replica_id == replica_id and t.armed and t.unresolved()
            ]
            if in_doubt:
                dits = sorted({t.dit_replica_id for t in in_doubt})
                return FailedPrecondition(
                    "REPLICA_WRITES_IN_DOUBT",
                    f"AR {replica_id} has unresolved writes in {len(in_doubt)} tickets "
                    f"({', '.join(t.ticket_id for t in in_doubt[:_LOGGED_IDS])}) into DiT {', '.join(dits)}: "
                    "its process may be alive behind a partition and still write into those pages. They resolve "
                    f"when it reports them, when a new incarnation of {replica_id} registers, or when their DiT "
                    "restarts or is itself forgotten with --force (if it is gone too); then retry",
                )
        pool = self._pools.get(replica_id)
        if not force and pool is not None and (c := pool.counts()).free != c.total:
            return FailedPrecondition(
                "REPLICA_HOLDS_PAGES",
                f"replica {replica_id} holds {c.total - c.free} pages ({c.reserved} reserved, {c.draining} draining)",
            )
        return None

    def _end_tickets_of(self, record: ReplicaRecord, now: float) -> list[TicketRecord]:
        """A forced forget (`forget_replica`, after `forget_refusal(force=True)` allowed it): end
        what the forgotten replica held. A DiT's tickets lose their memory, as when a new
        incarnation registers (DESTINATION_GONE, REPLICA_FORGOTTEN), and its pool must then hold
        nothing. An AR's unarmed tickets roll back (it never had their map; forgotten, it can no
        longer arm them) and its WRITING ones end (every write of theirs is final: the refusal
        saw to it), draining their quiet period; READY, CONSUMING and DRAINING ones no longer
        need it and follow their DiT."""
        replica_id = record.spec.replica_id
        changed: list[TicketRecord] = []
        for t in list(self._tickets.values()):
            old = t.state
            if t.dit_replica_id == replica_id:
                t.destination_gone(REPLICA_FORGOTTEN, now)
            elif t.ar_replica_id == replica_id and old in (TicketState.RESERVED, TicketState.WRITING):
                assert not (t.armed and t.unresolved()), f"ticket {t.ticket_id}: unresolved writes of a forgotten AR"
                t.end_request(TicketOutcome.FAILED, REPLICA_FORGOTTEN, now, self._quiet_seconds(t, now))
            else:
                continue
            self._settle(t, old, memory_gone=t.dit_replica_id == replica_id)
            changed.append(t)
        pool = self._pools.get(replica_id)
        if pool is not None:
            c = pool.counts()
            assert c.free == c.total, f"pool {replica_id}: pages held after its tickets were released: {c}"
        return changed

    def _named_replicas(self) -> dict[ReplicaId, list[TicketId]]:
        """The live tickets naming each replica (as AR or DiT)."""
        named: dict[ReplicaId, list[TicketId]] = {}
        for t in self._tickets.values():
            for replica_id in {t.ar_replica_id, t.dit_replica_id}:
                named.setdefault(replica_id, []).append(t.ticket_id)
        return named

    def _forget(
        self, replica_ids: Sequence[ReplicaId], why: str, *, tickets: Sequence[TicketRecord] = (),
        tombstones: bool = False,
    ) -> None:
        """Drop these replicas for good, memory and journal (`forget_refusal` allowed each), in one
        commit with the `tickets` a forced forget ended and the forgotten incarnations."""
        for replica_id in replica_ids:
            record = self.registry.find(replica_id)
            if record is not None and not tombstones:
                self._forgotten_idle[(replica_id, record.spec.incarnation_id)] = None
                while len(self._forgotten_idle) > _MAX_FORGOTTEN_IDLE:
                    self._forgotten_idle.popitem(last=False)
            self.registry.forget(replica_id)
            self._pools.pop(replica_id, None)
            self._probes.pop(replica_id, None)
            self._kept_down.pop(replica_id, None)
            for link in [k for k in self._suspect_links if replica_id in k]:
                del self._suspect_links[link]
        self._commit(tickets, forgotten=replica_ids, tombstones=tombstones)
        log.info("replicas_forgotten", why=why, count=len(replica_ids), replica_ids=list(replica_ids[:16]))

    def deregister_replica(self, replica_id: ReplicaId, incarnation_id: str, *, by_replica: bool = True) -> None:
        """The replica is leaving: no new tickets. Not proof that its writes are over.
        `by_replica` False: someone else (an operator) deregistered it; if the process still runs,
        its next heartbeat is told to register again (ReplicaRegistry.heartbeat)."""
        record = self.registry.check_incarnation(replica_id, incarnation_id)
        if record.deregistered:
            return
        record.deregistered = True
        record.deregistered_by_other = not by_replica
        record.deregister_time = self.clock()
        self._commit((), [record])
        log.info("replica_deregistered", replica_id=replica_id, incarnation=incarnation_id)

    def mark_unreachable(self, replica_id: ReplicaId, incarnation_id: str, message: str) -> bool:
        """A call the broker made to this incarnation failed to connect: no new tickets go to it
        until its next heartbeat proves it alive (placement reads `ReplicaStatus.reachable`).

        Without this, a killed replica kept its lease for up to `lease_seconds`, and a placement
        that prefers the least-loaded replica sent it nearly every request (each failed in
        milliseconds, so it always looked idle). Not a fence and not proof of anything: tickets
        and pages are untouched. Returns whether the replica was newly marked."""
        record = self.registry.find(replica_id)
        if record is None or record.spec.incarnation_id != incarnation_id or record.unreachable:
            return False
        record.unreachable = True
        log.warning("replica_unreachable", replica_id=replica_id, incarnation=incarnation_id, message=message)
        return True

    def note_transfer_failed(self, ar_replica_id: ReplicaId, dit_replica_id: ReplicaId) -> float:
        """A request's KV did not get from this AR to this DiT (TRANSFER_TIMEOUT, TRANSFER_FAILED):
        placement prefers other pairs for a while (`link_suspect`), doubling from
        LINK_BACKOFF_INITIAL_S up to LINK_BACKOFF_MAX_S while the pair keeps failing. Returns the
        backoff.

        Each replica reaching the broker says nothing about the AR reaching the DiT's transfer
        port (a firewall, a route, an interface the broker does not use): in a black-box run with
        one DiT's Mooncake ports closed to the ARs, every request placed on it waited
        `transfer_timeout` and failed, for as long as it lasted. Not a fence: the pair is tried
        again once the backoff passes, and used at once when no other pair can take a request."""
        key = (ar_replica_id, dit_replica_id)
        _, last = self._suspect_links.get(key, (0.0, 0.0))
        backoff = min(LINK_BACKOFF_MAX_S, max(LINK_BACKOFF_INITIAL_S, 2 * last))
        self._suspect_links[key] = (self.clock() + backoff, backoff)
        log.warning("transfer_link_suspect", ar_replica_id=ar_replica_id, dit_replica_id=dit_replica_id,
                    avoid_seconds=backoff)
        return backoff

    def note_transfer_ok(self, ar_replica_id: ReplicaId, dit_replica_id: ReplicaId) -> None:
        """A request's KV got from this AR to this DiT: the pair is no longer suspect."""
        if self._suspect_links.pop((ar_replica_id, dit_replica_id), None) is not None:
            log.info("transfer_link_ok", ar_replica_id=ar_replica_id, dit_replica_id=dit_replica_id)

    def link_suspect(self, ar_replica_id: ReplicaId, dit_replica_id: ReplicaId) -> bool:
        """Whether a transfer between this pair failed within its backoff (`note_transfer_failed`)."""
        entry = self._suspect_links.get((ar_replica_id, dit_replica_id))
        return entry is not None and self.clock() < entry[0]

    def fence_replica(self, replica_id: ReplicaId, reason: str) -> None:
        """A broken invariant for this replica: no new tickets; its heartbeats say fenced."""
        record = self.registry.get(replica_id)
        if record.fenced:
            return
        record.fenced = True
        record.fence_reason = reason
        self._commit((), [record])
        log.error("replica_fenced", replica_id=replica_id, incarnation=record.spec.incarnation_id, reason=reason)

    def list_replicas(self, role: ReplicaRole | None = None) -> list[ReplicaStatus]:
        now = self.clock()
        return [
            self.registry.status(r, now)
            for r in sorted(self.registry, key=lambda r: r.spec.replica_id)
            if role is None or r.spec.role is role
        ]

    def get_replica(self, replica_id: ReplicaId) -> ReplicaStatus:
        return self.registry.status(self.registry.get(replica_id), self.clock())

    def pages_needed(self, dit_replica_id: ReplicaId, row_token_counts: Sequence[int]) -> list[int]:
        geometry = self.registry.get(dit_replica_id).spec.geometry
        return [geometry.pages_for(n) for n in row_token_counts]

    def fits_now(self, dit_replica_id: ReplicaId, row_token_counts: Sequence[int]) -> bool:
        """Whether that DiT replica's pool has the free pages for these rows now."""
        return self._pools[dit_replica_id].fits_now(self.pages_needed(dit_replica_id, row_token_counts))

    def ever_fits(self, dit_replica_id: ReplicaId, row_token_counts: Sequence[int]) -> bool:
        """Whether that DiT replica's pool could hold these rows when empty (per CFG group)."""
        return not self._pools[dit_replica_id].never_fits(self.pages_needed(dit_replica_id, row_token_counts))

    def free_pages(self, dit_replica_id: ReplicaId) -> int:
        return self._pools[dit_replica_id].counts().free

    def live_tickets_per_ar(self) -> dict[ReplicaId, int]:
        """How many live (not RELEASED) tickets each AR replica is bound to: its load."""
        load: dict[ReplicaId, int] = {}
        for t in self._tickets.values():
            load[t.ar_replica_id] = load.get(t.ar_replica_id, 0) + 1
        return load

    # =================================================================== tickets

    def create_ticket(
        self,
        request_id: str,
        ar_replica_id: ReplicaId,
        dit_replica_id: ReplicaId,
        row_token_counts: Sequence[int],
        *,
        replaces: TicketId = "",
        by_hand: bool = False,
        beside: TicketId = "",
    ) -> Ticket | None:
        """Reserve pages for every row (all or nothing): RESERVED. None = does not fit now.

        Raises InvalidArgument when it can never fit; idempotent on a live request_id.
        `replaces`: the ticket of this request's earlier attempt (the orchestrator's retry after
        a replica or transfer failure), whose request is over: the new ticket gets pages of its own beside it,
        and the old one keeps its pages until it is released or drained as any ended ticket.
        `by_hand`: made with the operator's BrokerService.CreateTicket. The two kinds never share a
        request id while a request is live (ALREADY_EXISTS REQUEST_ID_REUSED, `_check_id_kind`); a
        generation's ticket is made beside a hand-made one whose request is over (it may drain).
        `beside`: the ticket that holds `request_id` for an EARLIER generation of this id, one the
        orchestrator no longer runs (it ended and was forgotten, or was lost with a broker
        restart), in whatever state (draining while a write may land, or still read by its DiT):
        the new generation's ticket gets pages of its own beside it, as a retry's does, and takes
        the id (`ticket_for_request`); the earlier one keeps every page until it is released or
        drained. Without it a resubmitted id would wait for that ticket at the queue's head.
        """
        counts = [int(n) for n in row_token_counts]
        if not request_id:
            raise InvalidArgument("MISSING_FIELD", "request_id is required")
        if not counts or any(n <= 0 for n in counts):
            raise InvalidArgument("INVALID_ROWS", f"row_token_counts must be non-empty and positive, got {counts}")
        if len(counts) > MAX_CFG_ROWS:
            raise InvalidArgument(
                "INVALID_ROWS",
                f"row_token_counts: {len(counts)} rows; a request has at most {MAX_CFG_ROWS} CFG rows "
                "(row 0 the prompt, row 1 the negative prompt)",
            )
        existing = self._by_request.get(request_id)
        if existing is not None and self._tickets[existing].by_hand != by_hand:
            self._check_id_kind(self._tickets[existing], by_hand)
            replaces = existing  # a generation's, beside a hand-made ticket whose request is over
        if existing is not None and beside and existing == beside and not by_hand and not self._tickets[existing].by_hand:
            existing = None  # an earlier generation's: pages of its own beside it (no page is shared)
        if existing is not None and existing == replaces:
            if not self._tickets[existing].request_over:
                raise FailedPrecondition(
                    "TICKET_LIVE", f"request {request_id}: ticket {existing} is not over, so it cannot be replaced"
                )
            existing = None
        if existing is not None:
            t = self._tickets[existing]
            if (t.ar_replica_id, t.dit_replica_id, [r.num_tokens for r in t.rows]) == (
                ar_replica_id,
                dit_replica_id,
                counts,
            ):
                return t.snapshot()
            raise AlreadyExists(
                "TICKET_EXISTS", f"request {request_id} already holds ticket {existing} with other parameters"
            )
        now = self.clock()
        ar = self._bound_replica(ar_replica_id, ReplicaRole.AR, now)
        dit = self._bound_replica(dit_replica_id, ReplicaRole.DIT, now)
        if ar.spec.max_tokens and max(counts) > ar.spec.max_tokens:
            raise InvalidArgument(
                "TOO_MANY_TOKENS", f"row_token_counts: {max(counts)} tokens > AR max_tokens {ar.spec.max_tokens}"
            )
        geometry = dit.spec.geometry
        pool = self._pools[dit_replica_id]
        try:
            pages = pool.reserve([geometry.pages_for(n) for n in counts])
        except NeverFits as err:
            raise InvalidArgument("NEVER_FITS", str(err)) from None
        if pages is None:
            return None
        rows = tuple(RowPages(i, n, tuple(p)) for i, (n, p) in enumerate(zip(counts, pages, strict=True)))
        try:
            plan = plan_transfer(
                geometry,
                ar.spec.tensor_parallel_size,
                dit.spec.head_shards,
                [RowSpec(r.row, r.num_tokens, r.page_ids) for r in rows],
                cfg_parallel=dit.spec.cfg_parallel_size,
            )
        except ValueError as err:
            pool.free((r.row, r.page_ids) for r in rows)
            raise InvalidArgument("UNPLANNABLE", str(err)) from None
        self._sequence += 1
        ticket_id = uuid.uuid4().hex
        t = TicketRecord(
            ticket_id=ticket_id,
            request_id=request_id,
            ar_replica_id=ar_replica_id,
            dit_replica_id=dit_replica_id,
            rows=rows,
            write_keys=[WriteKey(w.row, w.src_rank, w.dst_rank) for w in plan],
            src_shards=ar.spec.tensor_parallel_size,
            dst_shards=dit.spec.world_size,
            sequence=self._sequence,
            dit_incarnation=dit.spec.incarnation_id,
            now=now,
            by_hand=by_hand,
        )
        self._tickets[ticket_id] = t
        self._by_request[request_id] = ticket_id
        self._plans[ticket_id] = plan
        self._commit([t])
        log.info("ticket_reserved", ticket_id=ticket_id, request_id=request_id, pages=len(t.page_ids))
        return t.snapshot()

    def arm_ticket(self, ticket_id: TicketId, ar_replica_id: ReplicaId, incarnation_id: str) -> Arming:
        """Hand the destination map and expected writes to the AR: WRITING; no rollback after this.

        Idempotent for the arming incarnation, in every later state too, so that a writer whose
        answer was lost learns which writes to report NOT_STARTED.
        """
        t = self._live(ticket_id)
        if ar_replica_id != t.ar_replica_id:
            raise FailedPrecondition(
                "WRONG_REPLICA", f"ticket {ticket_id} is bound to AR {t.ar_replica_id}, not {ar_replica_id}"
            )
        record = self._current(ar_replica_id, incarnation_id, "ReserveTicket")
        if not t.armed and record.fenced:
            raise Unavailable("REPLICA_FENCED", f"AR {ar_replica_id} is fenced: {record.fence_reason}")
        if t.arm(incarnation_id, self.clock()):
            self._commit([t])
            log.info("ticket_armed", ticket_id=ticket_id, request_id=t.request_id, incarnation=incarnation_id)
        return self._arming(t)

    def plan_for(self, ticket_id: TicketId) -> Arming:
        """The ticket's plan (rows, writes, destinations), without arming it: what the orchestrator
        hands down with Prefill and Denoise, so that no replica asks the broker for it again."""
        return self._arming(self._live(ticket_id))

    def _arming(self, t: TicketRecord) -> Arming:
        dit = self.registry.get(t.dit_replica_id).spec
        plan = self._plans.get(t.ticket_id)
        if plan is None:
            plan = self._replan(t)
        return Arming(
            ticket=t.snapshot(),
            destinations=dit.regions,
            writes=plan,
            dit_geometry=dit.geometry,
            dit_tensor_parallel_size=dit.tensor_parallel_size,
            dit_sequence_parallel_size=dit.sequence_parallel_size,
            dit_num_pages=dit.num_pages,
            dit_cfg_parallel_size=dit.cfg_parallel_size,
            verify_checksums=self.verify_checksums,
            src_shards=t.src_shards,
        )

    def check_report_counts(self, ticket_id: TicketId, *, writes: int = 0, loads: int = 0, verified: int = 0) -> None:
        """A report batch is bounded by its ticket's plan (INVALID_ARGUMENT TOO_MANY_ENTRIES): at
        most its planned writes in one ReportWrite, its loads in one ReportLoad, each verifying
        at most its writes. An honest replica reports each once per call; before, a batch was
        bounded only by the 8 MiB request. Cheap, so that the servicer checks it before converting
        a batch. An unknown ticket passes (the report answers NOT_FOUND)."""
        t = self._tickets.get(ticket_id)
        if t is not None:
            n_writes, n_loads = len(t.writes), len(t.loads)
        elif (released := self._released.get(ticket_id)) is not None:
            n_writes, n_loads = len(released.writes), len(released.loads)
        else:
            return
        for field_name, listed, bound in (("writes", writes, n_writes), ("loads", loads, n_loads),
                                          ("loads[].verified", verified, n_writes)):  # fmt: skip
            if listed > bound:
                raise InvalidArgument(
                    "TOO_MANY_ENTRIES",
                    f"{field_name}: {listed} entries, at most {bound} (what ticket {ticket_id} plans)",
                )

    def report_write(
        self,
        ticket_id: TicketId,
        key: WriteKey,
        *,
        replica_id: ReplicaId,
        incarnation_id: str,
        status: WriteStatus,
        checksum: int = 0,
        nbytes: int = 0,
        message: str = "",
    ) -> Ticket:
        """A writer's report of one write. Idempotent.

        OK, FAILED and NOT_STARTED are final; IN_DOUBT (the sender stopped waiting while its
        transport call still runs) keeps the write unresolved, so the ticket drains with its pages
        held until the final report, or until the writer's incarnation is proven gone."""
        return self.report_writes(
            ticket_id, [ReportedWrite(key, status, checksum, nbytes, message)],
            replica_id=replica_id, incarnation_id=incarnation_id,
        )  # fmt: skip

    def report_writes(
        self, ticket_id: TicketId, reports: Sequence[ReportedWrite], *, replica_id: ReplicaId, incarnation_id: str
    ) -> Ticket:
        """Several write reports of one ticket (as `report_write` each, in order) in one journal
        commit: one ReportWrite from the AR per ticket instead of one per write. A report that is
        refused (a broken invariant fences the writer) leaves the ones before it applied and
        committed, as if each had come alone."""
        released = self._released.get(ticket_id)
        if released is not None:
            return released
        t = self._live(ticket_id)
        self._current(replica_id, incarnation_id, "ReportWrite")
        if replica_id != t.ar_replica_id:
            # Not a fence: the report changes nothing, and the id in it is only the caller's word
            # (without credentials anyone may name any replica): fencing it let one caller stop
            # another replica (found by audit). The same answer as the ownership check's.
            raise FailedPrecondition(
                "WRONG_REPLICA", f"ticket {ticket_id} is bound to AR {t.ar_replica_id}, not {replica_id}"
            )
        if t.armed and incarnation_id != t.armed_incarnation:
            self._stale_report_ignored("ReportWrite", ticket_id, replica_id, incarnation_id)
            raise FailedPrecondition(
                "STALE_INCARNATION", f"ticket {ticket_id} was armed by another incarnation of {replica_id}"
            )
        self.check_report_counts(ticket_id, writes=len(reports))
        if not t.armed and all(r.status is WriteStatus.NOT_STARTED for r in reports):
            # Says nothing was written, which is true of an unarmed ticket: refused, recorded
            # nowhere, fences nobody. A report claiming a write (OK, FAILED, IN_DOUBT) before arming
            # still fences the writer below (WRITE_BEFORE_ARM): its write could land after a rollback.
            raise FailedPrecondition(
                "NOT_ARMED", f"ticket {ticket_id} is not armed: report its writes after ReserveTicket answers"
            )
        now = self.clock()
        changed: list[ReportedWrite] = []
        try:
            for r in reports:
                if t.report_write(r.key, r.status, r.checksum, r.nbytes, r.message, now):
                    changed.append(r)
        except BrokenInvariant as err:
            broken: BrokenInvariant | None = err
        else:
            broken = None
        finally:
            # What was applied is journaled before anyone learns of it, a refusal included.
            self._writes_reported(t, changed)
        if broken is not None:
            self._fence_and_raise(replica_id, broken)
        return self._snapshot(ticket_id)

    def _writes_reported(self, t: TicketRecord, changed: Sequence[ReportedWrite]) -> None:
        """Journal what a batch of write reports changed (before anyone can learn of it)."""
        if not changed:
            return
        self._try_drain(t)
        self._commit([t])
        for r in changed:
            if r.status is WriteStatus.IN_DOUBT:
                log.warning("write_in_doubt", ticket_id=t.ticket_id, write=str(r.key), message=r.message)
            elif r.status is not WriteStatus.OK:
                log.warning("write_not_ok", ticket_id=t.ticket_id, write=str(r.key), status=r.status.value,
                            message=r.message)  # fmt: skip

    def report_load(
        self,
        ticket_id: TicketId,
        row: int,
        dst_rank: int,
        *,
        replica_id: ReplicaId,
        incarnation_id: str,
        verified: Mapping[WriteKey, int],
    ) -> Ticket:
        """A DiT rank verified the bytes of (row, dst_rank). Idempotent; READY after the last one."""
        return self.report_loads(
            ticket_id, [(LoadKey(row, dst_rank), verified)], replica_id=replica_id, incarnation_id=incarnation_id
        )

    def report_loads(
        self,
        ticket_id: TicketId,
        loads: Sequence[tuple[LoadKey, Mapping[WriteKey, int]]],
        *,
        replica_id: ReplicaId,
        incarnation_id: str,
    ) -> Ticket:
        """Several verified loads of one ticket (as `report_load` each, in order) in one journal
        commit. A load that is refused (e.g. CHECKSUM_MISMATCH: bytes still landing) raises after
        the ones before it are applied and committed; the DiT re-verifies and reports again
        (a load already taken is a retry)."""
        released = self._released.get(ticket_id)
        if released is not None:
            return released
        t = self._live(ticket_id)
        self._current(replica_id, incarnation_id, "ReportLoad")
        if replica_id != t.dit_replica_id:
            # Not a fence, as for ReportWrite: a report about another replica's ticket changes nothing.
            raise FailedPrecondition(
                "WRONG_REPLICA", f"ticket {ticket_id} is bound to DiT {t.dit_replica_id}, not {replica_id}"
            )
        self.check_report_counts(
            ticket_id, loads=len(loads), verified=max((len(verified) for _, verified in loads), default=0)
        )
        if incarnation_id != t.dit_incarnation:
            self._stale_report_ignored("ReportLoad", ticket_id, replica_id, incarnation_id)
            raise FailedPrecondition("STALE_INCARNATION", f"ticket {ticket_id} belongs to another DiT incarnation")
        now = self.clock()
        changed = False
        try:
            for key, verified in loads:
                changed = t.report_load(key, verified, self.verify_checksums, now) or changed
        except BrokenInvariant as err:
            broken: BrokenInvariant | None = err
        else:
            broken = None
        finally:
            self._loads_reported(t, changed)
        if broken is not None:
            self._fence_and_raise(replica_id, broken)
        return t.snapshot()

    def _loads_reported(self, t: TicketRecord, changed: bool) -> None:
        if changed:
            self._commit([t])
            if t.state is TicketState.READY:
                log.info("ticket_ready", ticket_id=t.ticket_id, request_id=t.request_id)

    def start_consuming(self, ticket_id: TicketId, replica_id: ReplicaId = "", incarnation_id: str = "") -> Ticket:
        """READY -> CONSUMING: the DiT started reading the pages (its own StartConsuming RPC).
        Idempotent. `replica_id`/`incarnation_id`, when given, must be the ticket's DiT."""
        t = self._live(ticket_id)
        if replica_id:
            if replica_id != t.dit_replica_id:
                raise FailedPrecondition(
                    "WRONG_REPLICA", f"ticket {ticket_id} is bound to DiT {t.dit_replica_id}, not {replica_id}"
                )
            self._current(replica_id, incarnation_id, "StartConsuming")
            if incarnation_id != t.dit_incarnation:
                raise FailedPrecondition("STALE_INCARNATION", f"ticket {ticket_id} belongs to another DiT incarnation")
        if t.start_consuming(self.clock()):
            self._commit([t])
        return t.snapshot()

    def release_ticket(
        self,
        ticket_id: TicketId,
        outcome: TicketOutcome,
        reason: str = "",
        replica_id: ReplicaId = "",
        incarnation_id: str = "",
    ) -> Ticket:
        """The DiT is done with the ticket (any outcome). Idempotent. `incarnation_id`, when
        given, must be the DiT incarnation the ticket was reserved on (the servicer requires it):
        a release from another process of that replica id would free pages its ranks may read."""
        released = self._released.get(ticket_id)
        if released is not None:
            return released
        t = self._live(ticket_id)
        if replica_id and replica_id != t.dit_replica_id:
            raise FailedPrecondition(
                "WRONG_REPLICA", f"ticket {ticket_id} is bound to DiT {t.dit_replica_id}, not {replica_id}"
            )
        if incarnation_id and incarnation_id != t.dit_incarnation:
            self._stale_report_ignored("ReleaseTicket", ticket_id, replica_id, incarnation_id)
            raise FailedPrecondition(
                "STALE_INCARNATION", f"ticket {ticket_id} belongs to another incarnation of DiT {t.dit_replica_id}"
            )
        old, now = t.state, self.clock()
        if t.release_by_consumer(outcome, reason, now, self._quiet_seconds(t, now)):
            self._settle(t, old)
            self._commit([t])
        return self._snapshot(ticket_id)

    def cancel_ticket(
        self, ticket_id: TicketId, outcome: TicketOutcome = TicketOutcome.CANCELLED, reason: str = ""
    ) -> Ticket:
        """End the request that owns the ticket. Never interrupts a write: armed pages drain."""
        if outcome is TicketOutcome.OK:
            raise InvalidArgument("INVALID_OUTCOME", "outcome: a cancelled ticket cannot end OK")
        released = self._released.get(ticket_id)
        if released is not None:
            return released
        t = self._live(ticket_id)
        old, now = t.state, self.clock()
        if t.end_request(outcome, reason, now, self._quiet_seconds(t, now)):
            self._settle(t, old)
            self._commit([t])
            log.info("ticket_ended", ticket_id=ticket_id, outcome=outcome.value, state=t.state.value, reason=reason)
        return self._snapshot(ticket_id)

    def get_ticket(self, ticket_id: TicketId) -> Ticket:
        return self._snapshot(ticket_id)

    def ticket_for_request(self, request_id: str) -> Ticket | None:
        tid = self._by_request.get(request_id)
        return None if tid is None else self._tickets[tid].snapshot()

    def check_generation_id(self, request_id: str) -> None:
        """Raise AlreadyExists (REQUEST_ID_REUSED) when a ticket made by hand (the operator's
        BrokerService.CreateTicket) holds `request_id` and its request is live: a generation
        takes an id of its own (Generate's admission asks, synchronously with its record's
        creation, so a CreateTicket cannot slip in between). One whose request is over
        (released, cancelled, expired, failed, or ended by a broker restart) holds the id no
        more: the generation's ticket gets pages of its own beside it while it drains."""
        tid = self._by_request.get(request_id)
        if tid is not None and self._tickets[tid].by_hand:
            self._check_id_kind(self._tickets[tid], by_hand=False)

    @staticmethod
    def _check_id_kind(held: TicketRecord, by_hand: bool) -> None:
        """A ticket of the other kind (`by_hand` or a generation's) holds the request id."""
        if by_hand:
            # The orchestrator made it for a generation the broker no longer holds (forgotten
            # after result_ttl_seconds, or lost with a restart) while its pages drain or wait.
            raise AlreadyExists(
                "REQUEST_ID_REUSED",
                f"request_id {held.request_id!r} holds ticket {held.ticket_id} ({held.state.value}) of a "
                "generation; CreateTicket takes a request id of its own",
            )
        if not held.request_over:
            raise AlreadyExists(
                "REQUEST_ID_REUSED",
                f"request_id {held.request_id!r} is held by ticket {held.ticket_id} ({held.state.value}) made "
                "with BrokerService.CreateTicket; a generation takes a request id of its own (or release "
                "that ticket first: ReleaseTicket or CancelTicket)",
            )

    def list_tickets(
        self, states: Iterable[TicketState] | None = None, replica_id: ReplicaId | None = None
    ) -> list[Ticket]:
        """Tickets in `states` (None = every live one), optionally of one replica, in sequence order."""
        wanted = set(states) if states else None
        out: list[Ticket] = []
        if wanted is not None and TicketState.RELEASED in wanted:
            out.extend(self._released.values())
        for t in self._tickets.values():
            if wanted is None or t.state in wanted:
                out.append(t.snapshot())
        if replica_id:
            out = [t for t in out if replica_id in (t.ar_replica_id, t.dit_replica_id)]
        return sorted(out, key=lambda t: t.sequence)

    def pool_status(self, replica_id: ReplicaId | None = None) -> list[PoolStatus]:
        if replica_id:
            self.registry.get(replica_id)
            if replica_id not in self._pools:
                raise InvalidArgument("NOT_A_DIT", f"replica {replica_id} is not a DiT replica; it has no pool")
        out = []
        # list(): the metrics endpoint reads from its own thread while a registration may forget one.
        now = self.clock()
        for rid, pool in sorted(list(self._pools.items())):
            record = self.registry.find(rid)
            if record is None or (replica_id and rid != replica_id):
                continue
            c = pool.counts()
            out.append(PoolStatus(rid, c.total, c.free, c.reserved, c.draining, record.fenced, record.up(now)))
        return out

    def commit_behind(
        self,
        *,
        tickets: Iterable[TicketId] = (),
        replicas: Iterable[ReplicaId] = (),
        pools: Iterable[ReplicaId] = (),
        polls_of: ReplicaId | None = None,
        membership: bool = False,
    ) -> int:
        """The newest journal commit behind what a reply shows of these objects, now: await
        `journal.durable_through` of it before the reply leaves (0 when nothing named changed since
        the journal was loaded). `tickets`: tickets shown (released ones too, while kept);
        `replicas`: replica records (incarnation, fence, deregistration); `pools`: DiT pools' pages;
        `polls_of`: the tickets an AR writes (Heartbeat's `poll_writes`, an absence included);
        `membership`: which replicas exist (a listing of all of them).

        Only for a reply that changed nothing: a change's own commit is newer than everything
        before it, so a reply that made one awaits it (and so every earlier one) instead."""
        commits = [self._membership_commit if membership else 0]
        commits.extend(self._ticket_commit.get(t, 0) for t in tickets)
        commits.extend(self._replica_commit.get(r, 0) for r in replicas)
        commits.extend(self._pool_commit.get(r, 0) for r in pools)
        if polls_of is not None:
            commits.append(self._ar_tickets_commit.get(polls_of, 0))
        return max(commits)

    def draining_oldest_seconds(self) -> float:
        # list(): the metrics endpoint scrapes from its own thread; copy in one C-level step.
        starts = [
            t.drain_start_time
            for t in list(self._tickets.values())
            if t.state is TicketState.DRAINING and t.drain_start_time is not None
        ]
        return max(0.0, self.clock() - min(starts)) if starts else 0.0

    def ticket_state_counts(self) -> dict[TicketState, int]:
        counts = dict.fromkeys(TicketState, 0)
        for t in list(self._tickets.values()):
            counts[t.state] += 1
        return counts

    def tick(self) -> int:
        """Free DRAINING tickets whose writes are resolved and whose quiet period passed, then
        forget replicas down for longer than `forget_down_after_seconds` (when set).

        Called periodically by `run_maintenance`; returns how many tickets were released.
        """
        now = self.clock()
        done = [t for t in self._tickets.values() if t.state is TicketState.DRAINING]
        changed = [t for t in done if self._try_drain(t, now)]
        if changed:
            self._commit(changed)
        self.forget_down_replicas(now)
        return len(changed)

    def close(self) -> None:
        self.journal.close()

    # ================================================================= internals

    def _live(self, ticket_id: TicketId) -> TicketRecord:
        t = self._tickets.get(ticket_id)
        if t is None:
            if ticket_id in self._released:
                raise FailedPrecondition("TICKET_RELEASED", f"ticket {ticket_id} is RELEASED")
            raise NotFound("UNKNOWN_TICKET", f"ticket {ticket_id!r} not found")
        return t

    def _snapshot(self, ticket_id: TicketId) -> Ticket:
        t = self._tickets.get(ticket_id)
        if t is not None:
            return t.snapshot()
        released = self._released.get(ticket_id)
        if released is None:
            raise NotFound("UNKNOWN_TICKET", f"ticket {ticket_id!r} not found")
        return released

    def _current(self, replica_id: ReplicaId, incarnation_id: str, what: str) -> ReplicaRecord:
        try:
            return self.registry.check_incarnation(replica_id, incarnation_id)
        except FailedPrecondition:
            self._stale_report_ignored(what, "", replica_id, incarnation_id)
            raise

    def _bound_replica(self, replica_id: ReplicaId, role: ReplicaRole, now: float) -> ReplicaRecord:
        record = self.registry.get(replica_id)
        if record.spec.role is not role:
            raise InvalidArgument("WRONG_ROLE", f"replica {replica_id} is {record.spec.role.value}, not {role.value}")
        if record.fenced:
            raise Unavailable("REPLICA_FENCED", f"replica {replica_id} is fenced: {record.fence_reason}")
        if not record.up(now):
            raise Unavailable("REPLICA_DOWN", f"replica {replica_id} is down (lease expired or deregistered)")
        return record

    def _fence_and_raise(self, replica_id: ReplicaId, err: BrokenInvariant) -> NoReturn:
        self.fence_replica(replica_id, f"{err.reason}: {err.message}")
        raise err

    def _try_drain(self, t: TicketRecord, now: float | None = None) -> bool:
        old = t.state
        now = self.clock() if now is None else now
        if t.try_drain(now, self._quiet_seconds(t, now)):
            self._settle(t, old)
            return True
        return False

    def _quiet_seconds(self, t: TicketRecord, now: float) -> float:
        """How long after its last resolved write a ticket's pages wait before they are freed.
        The quiet period, unless a write was resolved without its bytes being known to have
        landed (`receiver_unsettled_writes`: its sender gone, or its transport call failed): no
        more is sent, but the receiving rank may be stopped with bytes of it in its socket. Then
        wait out its watchdog's limit, and never free while the DiT is down (stopped as a whole,
        it runs no watchdog; its ranks drain as soon as it runs again): infinity."""
        quiet = self.drain_quiet_seconds
        if self.receiver_settle_seconds > 0 and t.receiver_unsettled_writes():
            dit = self.registry.find(t.dit_replica_id)
            if dit is not None and not dit.up(now):
                return math.inf
            if not self._receiver_proven(t):
                quiet = max(quiet, self.receiver_settle_seconds)
        return quiet

    def _receiver_proven(self, t: TicketRecord) -> bool:
        """Whether a heartbeat of the ticket's DiT proved its receivers drained after its last
        resolution (`_receiver_proof`): then its pages wait only the plain quiet period."""
        resolved = t.last_resolution_time
        return resolved is not None and self._receiver_drained.get(t.ticket_id) == resolved

    def _settle(self, t: TicketRecord, old: TicketState, *, memory_gone: bool = False) -> None:
        """Move the ticket's pages to match its new state. `memory_gone`: released because its
        DiT's memory is gone (a new incarnation, a forget by force), not by its quiet period."""
        new = t.state
        if old is new:
            return
        pool = self._pools[t.dit_replica_id]
        if new is TicketState.DRAINING:
            assert old in HOLDING_STATES, f"ticket {t.ticket_id}: {old} -> DRAINING"
            pool.mark_draining(_row_pages(t))
        elif new is TicketState.RELEASED:
            pool.free(_row_pages(t))
            if not memory_gone and self.receiver_settle_seconds > 0 and t.receiver_unsettled_writes():
                early = self._receiver_proven(t)
                if early:
                    self.receiver_settled_early_total += 1
                else:
                    self.receiver_settled_full_total += 1
                resolved = t.last_resolution_time
                log.info("receiver_settle_ended", ticket_id=t.ticket_id, replica_id=t.dit_replica_id,
                         how="proven_drained" if early else "settle_time",
                         after_seconds=None if resolved is None else round(self.clock() - resolved, 3))  # fmt: skip

    def _replan(self, t: TicketRecord) -> tuple[PlannedWrite, ...]:
        dit = self.registry.get(t.dit_replica_id).spec
        plan = plan_transfer(
            dit.geometry,
            t.src_shards,
            dit.head_shards,
            [RowSpec(r.row, r.num_tokens, r.page_ids) for r in t.rows],
            cfg_parallel=dit.cfg_parallel_size,
        )
        self._plans[t.ticket_id] = plan
        return plan

    def _commit(
        self,
        tickets: Iterable[TicketRecord],
        replicas: Iterable[ReplicaRecord] = (),
        *,
        forgotten: Sequence[ReplicaId] = (),
        tombstones: bool = False,
    ) -> None:
        """Journal, then publish: callers learn of a change only after it is durable.
        `forgotten`: replica rows to delete; `tombstones`: `_forgotten` changed (rewritten whole)."""
        tickets = list({t.ticket_id: t for t in tickets}.values())
        replicas = list(replicas)
        rows: dict[str, dict[str, object] | None] = {r.spec.replica_id: r.to_json() for r in replicas}
        rows.update(dict.fromkeys(forgotten))
        meta = {"sequence": str(self._sequence)}
        if tombstones:
            meta[_FORGOTTEN_META] = json.dumps(self._forgotten, sort_keys=True)
        seq = self.journal.commit(
            replicas=rows,
            # Released tickets leave the journal: nothing can write their pages any more.
            tickets={
                t.ticket_id: None if t.state is TicketState.RELEASED else ticket_to_json(t) for t in tickets
            },
            meta=meta,
        )
        for r in replicas:
            self._replica_commit[r.spec.replica_id] = seq
            if r.spec.role is ReplicaRole.DIT:
                self._pool_commit[r.spec.replica_id] = seq  # a new incarnation's pool is new
        for t in tickets:
            # Every change of a pool's pages is a change of one of its tickets, committed here.
            self._ticket_commit[t.ticket_id] = seq
            self._pool_commit[t.dit_replica_id] = seq
            self._ar_tickets_commit[t.ar_replica_id] = seq
        for replica_id in forgotten:
            for commits in (self._replica_commit, self._pool_commit, self._ar_tickets_commit):
                commits.pop(replica_id, None)
        if forgotten:
            self._membership_commit = seq
        freed = False
        for t in tickets:
            if t.state is TicketState.RELEASED and t.ticket_id in self._tickets:
                self._retire(t)
                freed = True
            self.waiters.notify_ticket(t.ticket_id)
        if freed:
            self.waiters.notify_change()

    def _retire(self, t: TicketRecord) -> None:
        del self._tickets[t.ticket_id]
        self._receiver_drained.pop(t.ticket_id, None)
        self._restored_unsettled.discard(t.ticket_id)
        self._plans.pop(t.ticket_id, None)
        if self._by_request.get(t.request_id) == t.ticket_id:
            del self._by_request[t.request_id]
            # An earlier ticket of this id still held (an earlier attempt's or generation's,
            # draining): the id names the newest held one again, as a journal replay does (it
            # restores tickets in sequence order), so that what holds an id never depends on
            # whether the broker restarted in between.
            held = [o for o in self._tickets.values() if o.request_id == t.request_id]
            if held:
                self._by_request[t.request_id] = max(held, key=lambda o: o.sequence).ticket_id
        self._released[t.ticket_id] = t.snapshot()
        self.released_total += 1
        while len(self._released) > self._released_history:
            forgotten, _ = self._released.popitem(last=False)
            self._ticket_commit.pop(forgotten, None)
        log.info(
            "ticket_released",
            ticket_id=t.ticket_id,
            request_id=t.request_id,
            outcome=t.outcome.value if t.outcome else None,
            reason=t.reason,
        )

    def _old_incarnation_gone(self, spec: ReplicaSpec) -> list[TicketRecord]:
        now = self.clock()
        changed: list[TicketRecord] = []
        if spec.role is ReplicaRole.AR:
            for t in self._tickets.values():
                if t.ar_replica_id == spec.replica_id and t.armed and t.armed_incarnation != spec.incarnation_id:
                    if t.writer_gone(now):
                        self._try_drain(t, now)
                        changed.append(t)
        else:
            for t in list(self._tickets.values()):
                if t.dit_replica_id == spec.replica_id:
                    old = t.state
                    t.destination_gone(DIT_REPLICA_RESTARTED, now)
                    self._settle(t, old, memory_gone=True)
                    changed.append(t)
            pool = self._pools.get(spec.replica_id)
            if pool is not None:
                c = pool.counts()
                assert c.free == c.total, f"pool {spec.replica_id}: pages held after its DiT restarted: {c}"
            # The new incarnation's memory is new: its pool may have another size.
            self._pools[spec.replica_id] = _pages_of(spec)
        return changed

    def _reconcile(
        self,
        spec: ReplicaSpec,
        unresolved_writes: Iterable[tuple[TicketId, WriteKey]],
        held_ticket_ids: Iterable[TicketId],
        owed_releases: Mapping[TicketId, tuple[TicketOutcome, str]],
    ) -> list[TicketRecord]:
        """Same incarnation registering again (after a broker restart): compare what it holds.
        A DiT's owed release is applied as the ReleaseTicket it stands for (its outcome recorded;
        the retried ReleaseTicket that follows finds the ticket released and changes nothing)."""
        now = self.clock()
        changed: list[TicketRecord] = []
        # What names no write of a live ticket of this replica (unknown, released, another
        # replica's) changes nothing: one line with a count and a few of them, not a line each.
        unknown = [
            f"{ticket_id}/{key}"
            for ticket_id, key in unresolved_writes
            if (t := self._tickets.get(ticket_id)) is None or t.ar_replica_id != spec.replica_id or key not in t.writes
        ]
        if unknown:
            log.warning("reconcile_unknown_writes", replica_id=spec.replica_id, count=len(unknown),
                        writes=unknown[:_LOGGED_IDS])  # fmt: skip
        if spec.role is ReplicaRole.DIT:
            held = set(held_ticket_ids)
            unknown = sorted(
                ticket_id for ticket_id in held
                if (t := self._tickets.get(ticket_id)) is None or t.dit_replica_id != spec.replica_id
            )  # fmt: skip
            if unknown:
                log.warning("reconcile_unknown_held_tickets", replica_id=spec.replica_id, count=len(unknown),
                            ticket_ids=unknown[:_LOGGED_IDS])  # fmt: skip
            for ticket_id, (outcome, reason) in owed_releases.items():
                t = self._tickets.get(ticket_id)
                if t is None or t.dit_replica_id != spec.replica_id or ticket_id in held:
                    # Released already (or never ours): nothing to apply. Listed as held too: a
                    # DiT never does that, so the listing (pages kept) wins.
                    continue
                old = t.state
                if t.release_by_consumer(outcome, reason, now, self._quiet_seconds(t, now)):
                    self._settle(t, old)
                    changed.append(t)
            for t in list(self._tickets.values()):
                if (
                    t.dit_replica_id == spec.replica_id
                    and t.request_over
                    and t.state in (TicketState.READY, TicketState.CONSUMING)
                    and t.ticket_id not in held
                    and t.ticket_id not in owed_releases
                ):
                    # Orphaned by the broker restart and the DiT does not read it: every write
                    # was verified before READY, so nothing can land any more.
                    old = t.state
                    t.release_by_consumer(TicketOutcome.FAILED, BROKER_RESTARTED, now, self._quiet_seconds(t, now))
                    self._settle(t, old)
                    changed.append(t)
        return changed

    def _restore(self) -> None:
        contents = self.journal.load()
        if "sequence" not in contents.meta:
            # A new journal (or one lost): number tickets from the clock (microseconds), above any
            # sequence an earlier journal handed out. DiT replicas that outlive the journal keep
            # page fences ordered by sequence (a page only goes to later tickets): numbering
            # from 1 again would have them refuse every new ticket of a page an old one claimed.
            self._sequence = int(self.clock() * 1_000_000)
        # Before the early return: every replica may be forgotten while the incarnations stay refused.
        self._forgotten = {
            # A journal of before kept one incarnation per id, as a string.
            rid: [incs] if isinstance(incs, str) else list(incs)
            for rid, incs in json.loads(contents.meta.get(_FORGOTTEN_META, "{}")).items()
        }
        if not contents.replicas and not contents.tickets:
            return
        now = self.clock()
        for data in contents.replicas.values():
            record = ReplicaRecord.from_json(data)
            self.registry.restore(record)
            if record.spec.role is ReplicaRole.DIT:
                self._pools[record.spec.replica_id] = _pages_of(record.spec)
        self._sequence = int(contents.meta.get("sequence", str(self._sequence)))
        restored: list[TicketRecord] = []
        for data in sorted(contents.tickets.values(), key=lambda d: d["sequence"]):
            t = ticket_from_json(data)
            state = PageState.DRAINING if t.state is TicketState.DRAINING else PageState.RESERVED
            self._pools[t.dit_replica_id].claim(_row_pages(t), state)
            self._tickets[t.ticket_id] = t
            self._by_request[t.request_id] = t.ticket_id
            restored.append(t)
        for t in restored:
            # Journaled times are the previous process's clock readings: a step of the wall clock
            # between the two runs shifts them by its size. A write whose bytes may still sit in a
            # stopped receiver's socket (FAILED, WRITER_GONE) waits its whole settle time again from
            # now: a restart may delay a free, never bring one forward (docs/broker.md, Clock).
            if t.last_resolution_time is not None and t.receiver_unsettled_writes():
                t.last_resolution_time = now
                # No proof of its receivers counts either (none was journaled, and one made now
                # could not tell whether they ran before the restart): the whole settle time.
                self._restored_unsettled.add(t.ticket_id)
        for t in restored:
            # The orchestrator that owned these requests died with the broker: end them. An armed
            # ticket drains until its writes are resolved; it is never silently freed.
            old = t.state
            if t.state is TicketState.DRAINING:
                self._try_drain(t, now)
            else:
                t.orphan(BROKER_RESTARTED, now, self._quiet_seconds(t, now))
                self._settle(t, old)
        self._commit(restored)
        log.info("broker_restored", replicas=len(contents.replicas), tickets=len(restored))


def _pages_of(spec: ReplicaSpec) -> ReplicaPages:
    """A DiT replica's page pools: `num_pages` per rank, one pool per CFG group."""
    return ReplicaPages(spec.replica_id, spec.num_pages, spec.cfg_parallel_size)


def _row_pages(t: TicketRecord) -> list[tuple[int, tuple[int, ...]]]:
    return [(r.row, r.page_ids) for r in t.rows]
