"""The pages of a FAILED or WRITER_GONE write come back before `receiver_settle_seconds` only on
proof that every receiving process of their DiT drained (docs/broker.md, Draining).

The settle time is for a DiT rank stopped with bytes of the write in its socket. Paid always, it
held the pages ~12 s (default config) after every failed write, also when every receiver ran the
whole time. Now a DiT heartbeat that echoes a probe the broker made at least the proof window after
the resolution (so it was sent after that, whatever the network delayed), covering every rank, and
reporting every receiver stall-free for the window, frees them after the plain quiet period. No
proof, a stale one, one of another replica or incomplete, after a broker restart, or while the DiT
is down: the whole settle time, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from kvrelay.broker.core import BrokerCore, HeartbeatReply, ReceiverRun
from kvrelay.broker.registry import ReplicaSpec
from kvrelay.broker.service import add_broker_servicer
from kvrelay.broker.tickets import Ticket, TicketOutcome, TicketState, WriteStatus
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, new_incarnation

SETTLE = 30.0
WINDOW = 2.5
QUIET = 0.2
LONG_RUN = 1000.0  # a receiver that ran the whole time


def _core(clock: ManualClock, path: object = None) -> BrokerCore:
    return BrokerCore(
        path, clock=clock, lease_seconds=10.0, drain_quiet_seconds=QUIET, receiver_settle_seconds=SETTLE,
        receiver_proof_window_seconds=WINDOW, journal_synchronous="OFF",
    )  # fmt: skip


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def core(clock: ManualClock) -> Iterator[BrokerCore]:
    c = _core(clock)
    yield c
    c.close()


def _setup(core: BrokerCore, replica_id: str = "dit-0") -> tuple[ReplicaSpec, ReplicaSpec]:
    ar, dit = ar_spec(), dit_spec(replica_id, tp=2, num_pages=16)
    core.register_replica(ar)
    core.register_replica(dit)
    return ar, dit


def _failed(core: BrokerCore, ar: ReplicaSpec, dit: ReplicaSpec, request_id: str = "req-1") -> Ticket:
    """A ticket whose writes all FAILED (resolved now), its request over: DRAINING."""
    t = core.create_ticket(request_id, ar.replica_id, dit.replica_id, [40])
    assert t is not None
    t = core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket
    for w in t.writes:
        core.report_write(t.ticket_id, w.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                          status=WriteStatus.FAILED)  # fmt: skip
    core.cancel_ticket(t.ticket_id, TicketOutcome.FAILED)
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    return t


def _beat(core: BrokerCore, dit: ReplicaSpec, probe: int, stall_free: float = LONG_RUN,
          ranks: int | None = None) -> HeartbeatReply:  # fmt: skip
    run = ReceiverRun(probe, stall_free, dit.world_size if ranks is None else ranks)
    return core.heartbeat(dit.replica_id, dit.incarnation_id, receiver_run=run)


def _state(core: BrokerCore, t: Ticket) -> TicketState:
    core.tick()
    return core.get_ticket(t.ticket_id).state


def _free(core: BrokerCore, replica_id: str = "dit-0") -> int:
    return core.pool_status(replica_id)[0].free


def test_a_heartbeat_sent_after_the_window_with_every_receiver_running_frees_the_pages_early(
    core: BrokerCore, clock: ManualClock
) -> None:
    ar, dit = _setup(core)
    reply = _beat(core, dit, 0)
    assert reply.probe and reply.next_heartbeat_seconds == 0.0  # nothing waits for proof
    t = _failed(core, ar, dit)
    clock.advance(0.1)
    early = _beat(core, dit, reply.probe)
    # Made before R + window: echoed, it proves nothing; the broker asks for a heartbeat then.
    assert early.next_heartbeat_seconds == pytest.approx(WINDOW - 0.1)
    clock.advance(early.next_heartbeat_seconds)
    assert _state(core, t) is TicketState.DRAINING
    at_window = _beat(core, dit, early.probe)
    assert _state(core, t) is TicketState.DRAINING, "a probe made before R + window proved it"
    assert at_window.next_heartbeat_seconds == pytest.approx(0.2)  # soon: its own probe can prove it
    clock.advance(at_window.next_heartbeat_seconds)
    _beat(core, dit, at_window.probe)
    assert _state(core, t) is TicketState.RELEASED  # ~2.9 s after the resolution, not 30 s
    assert _free(core) == 16
    assert (core.receiver_settled_early_total, core.receiver_settled_full_total) == (1, 0)


def test_stale_or_unknown_probe_echoes_prove_nothing(core: BrokerCore, clock: ManualClock) -> None:
    """A heartbeat may sit in the network: receipt after R + window says nothing of when it was
    sent. Only the echo of a probe made after R + window does."""
    ar, dit = _setup(core)
    stale = _beat(core, dit, 0).probe
    t = _failed(core, ar, dit)
    for _ in range(5):
        clock.advance(5.0)
        _beat(core, dit, stale)  # sent before the resolution, received ever later
        _beat(core, dit, 0)
        _beat(core, dit, stale + 10_000)  # a number this broker never made
        assert _state(core, t) is TicketState.DRAINING
    clock.advance(SETTLE - 25.0)
    assert _state(core, t) is TicketState.RELEASED  # the whole settle time, as before
    assert (core.receiver_settled_early_total, core.receiver_settled_full_total) == (0, 1)


def test_a_stall_after_the_resolution_holds_the_pages_until_the_receiver_ran_the_window(
    core: BrokerCore, clock: ManualClock
) -> None:
    """A receiver stalled after R (or stopped at R and continued since) has run stall-free for less
    than the window: not yet proof that it drained. Once it has run the window, it has."""
    ar, dit = _setup(core)
    _beat(core, dit, 0)
    t = _failed(core, ar, dit)
    clock.advance(WINDOW)
    probe = _beat(core, dit, 0).probe  # made at R + window
    clock.advance(0.5)
    reply = _beat(core, dit, probe, stall_free=0.0)  # a rank is stopped now
    assert _state(core, t) is TicketState.DRAINING
    clock.advance(0.5)
    reply = _beat(core, dit, reply.probe, stall_free=0.4)  # it ran again 0.4 s ago
    assert _state(core, t) is TicketState.DRAINING
    assert reply.next_heartbeat_seconds == pytest.approx(WINDOW - 0.4)  # when its run could prove it
    clock.advance(1.0)
    reply = _beat(core, dit, reply.probe, stall_free=WINDOW - 0.1)
    assert _state(core, t) is TicketState.DRAINING
    clock.advance(0.2)
    _beat(core, dit, reply.probe, stall_free=WINDOW + 0.1)
    assert _state(core, t) is TicketState.RELEASED


def test_a_proof_of_another_replica_or_of_some_ranks_only_frees_nothing(
    core: BrokerCore, clock: ManualClock
) -> None:
    ar, dit = _setup(core)
    other = dit_spec("dit-1", tp=2, num_pages=16)
    core.register_replica(other)
    mine = _beat(core, dit, 0).probe
    theirs = _beat(core, other, 0).probe
    t = _failed(core, ar, dit)
    clock.advance(WINDOW)
    mine, theirs = _beat(core, dit, mine, ranks=1).probe, _beat(core, other, theirs).probe
    for _ in range(3):
        clock.advance(0.5)
        _beat(core, other, theirs)  # dit-1 proves its own receivers ran, not dit-0's
        _beat(core, other, mine)  # nor does it with dit-0's probe
        reply = _beat(core, dit, mine, ranks=1)  # one of dit-0's two ranks is not covered
        assert reply.next_heartbeat_seconds == 0.0  # incomplete: no hurry, it cannot prove
        mine = reply.probe
        assert _state(core, t) is TicketState.DRAINING
    reply = _beat(core, dit, mine)
    clock.advance(0.2)
    _beat(core, dit, reply.probe)
    assert _state(core, t) is TicketState.RELEASED


def test_no_early_free_while_the_dit_is_down(core: BrokerCore, clock: ManualClock) -> None:
    """A DiT stopped as a whole sends nothing; one whose lease lapsed after a proof is not freed
    while down either (the rule of the settle time)."""
    ar, dit = _setup(core)
    probe = _beat(core, dit, 0).probe
    t = _failed(core, ar, dit)
    clock.advance(WINDOW)
    probe = _beat(core, dit, probe).probe
    clock.advance(0.1)
    _beat(core, dit, probe)  # proven, but the maintenance pass has not run yet
    clock.advance(11.0)  # the lease lapsed
    assert _state(core, t) is TicketState.DRAINING
    assert _free(core) < 16


def test_a_broker_restart_keeps_the_whole_settle_time(tmp_path, clock: ManualClock) -> None:
    """Proofs are not journaled, and a proof made after the restart cannot tell whether the
    receivers ran before it: a ticket resolved before the restart waits the whole settle time."""
    path = tmp_path / "journal.sqlite"
    core = _core(clock, path)
    ar, dit = _setup(core)
    t = _failed(core, ar, dit)
    core.close()
    clock.advance(1.0)
    core = _core(clock, path)
    try:
        core.register_replica(ar)
        core.register_replica(dit)
        probe = _beat(core, dit, 0).probe
        for _ in range(5):
            clock.advance(WINDOW)
            reply = _beat(core, dit, probe)
            assert reply.next_heartbeat_seconds == 0.0
            probe = reply.probe
            assert _state(core, t) is TicketState.DRAINING
        clock.advance(SETTLE - 5 * WINDOW)
        _beat(core, dit, probe)
        assert _state(core, t) is TicketState.RELEASED
    finally:
        core.close()


def test_a_later_resolution_needs_a_proof_of_its_own(core: BrokerCore, clock: ManualClock) -> None:
    """A gone writer's write resolved after a proof for the ticket's earlier FAILED writes: the
    proof covers the earlier resolution only."""
    ar, dit = ar_spec(tp=2), dit_spec(tp=2, num_pages=16)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("req-1", ar.replica_id, dit.replica_id, [40])
    assert t is not None
    t = core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket
    first, *rest = t.writes
    core.report_write(t.ticket_id, first.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                      status=WriteStatus.FAILED)  # fmt: skip
    for w in rest:
        core.report_write(t.ticket_id, w.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                          status=WriteStatus.IN_DOUBT)  # fmt: skip
    core.cancel_ticket(t.ticket_id, TicketOutcome.FAILED)
    probe = _beat(core, dit, 0).probe
    clock.advance(WINDOW)
    probe = _beat(core, dit, probe).probe
    clock.advance(0.2)
    probe = _beat(core, dit, probe).probe  # proves nothing: writes are unresolved
    core.register_replica(new_incarnation(ar))  # the writer is gone: WRITER_GONE, resolved now
    assert _state(core, t) is TicketState.DRAINING
    clock.advance(0.2)
    probe = _beat(core, dit, probe).probe  # made before the new resolution + window
    assert _state(core, t) is TicketState.DRAINING
    clock.advance(WINDOW)
    probe = _beat(core, dit, probe).probe
    clock.advance(0.2)
    _beat(core, dit, probe)
    assert _state(core, t) is TicketState.RELEASED


def test_a_dit_without_the_field_and_a_broker_without_proofs_keep_the_settle_time(clock: ManualClock) -> None:
    """An older DiT sends no receiver run: no hurry asked, the whole settle time. A core without a
    proof window (the default) makes no probes."""
    core = _core(clock)
    try:
        ar, dit = _setup(core)
        t = _failed(core, ar, dit)
        for _ in range(5):
            clock.advance(WINDOW)
            reply = core.heartbeat(dit.replica_id, dit.incarnation_id)
            assert reply.probe and reply.next_heartbeat_seconds == 0.0
            assert _state(core, t) is TicketState.DRAINING
    finally:
        core.close()
    plain = BrokerCore(None, clock=clock, receiver_settle_seconds=SETTLE, journal_synchronous="OFF")
    try:
        _, dit = _setup(plain)
        assert _beat(plain, dit, 0).probe == 0
    finally:
        plain.close()


def test_the_proof_over_grpc(clock: ManualClock) -> None:
    """HeartbeatRequest.receiver_run reaches the core, HeartbeatResponse carries the probe and the
    hurry; a DiT that sends no receiver_run (an older binary) proves nothing."""

    async def scenario() -> None:
        core = _core(clock)
        server = grpc.aio.server()
        add_broker_servicer(core, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            ar, dit = _setup(core)
            t = _failed(core, ar, dit)

            async def beat(probe: int | None) -> broker_pb2.HeartbeatResponse:
                request = broker_pb2.HeartbeatRequest(
                    replica_id=dit.replica_id, incarnation_id=dit.incarnation_id
                )
                if probe is not None:
                    request.receiver_run.CopyFrom(
                        broker_pb2.ReceiverRun(probe=probe, stall_free_seconds=LONG_RUN, ranks=dit.world_size)
                    )
                return await stub.Heartbeat(request, timeout=10)

            first = await beat(0)
            assert first.probe and first.next_heartbeat_seconds == pytest.approx(WINDOW)
            clock.advance(WINDOW)
            old = await beat(None)  # an older DiT: no receiver_run, nothing asked of it
            assert old.probe and old.next_heartbeat_seconds == 0.0
            clock.advance(0.2)
            assert (await beat(old.probe)).probe > old.probe
            assert _state(core, t) is TicketState.RELEASED
        finally:
            await channel.close()
            await server.stop(None)
            core.close()

    asyncio.run(scenario())
