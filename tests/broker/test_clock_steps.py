"""The broker's periods are durations: a step of the wall clock changes none of them.

Found by attack (the ownership hand-off against clocks): `BrokerCore` measured leases, the quiet
period and the receiver's settle time on `time.time`. A forward step of the host's wall clock
(NTP stepping a drifted clock, `date -s`, a VM resumed and re-synced) by more than
`receiver_settle_seconds` freed at once the pages of a `FAILED` write, while the receiving DiT
rank, stopped, may still hold bytes of it in its socket: the next ticket got those pages, and the
old bytes would land in them when the rank ran again (docs/broker.md, Clock).

The core is built as `kvrelay broker` builds it (its default clock) in a child process whose
`time.time` is replaced before kvrelay is imported, so that the wall clock can be stepped there
without touching the host's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import time

    _real_time = time.time
    STEP = [0.0]

    def stepped_time() -> float:
        return _real_time() + STEP[0]

    time.time = stepped_time  # before kvrelay is imported: its defaults bind this one

    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.tickets import TicketOutcome, TicketState, WriteStatus
    from tests.broker.helpers import ar_spec, dit_spec

    SETTLE = 60.0
    core = BrokerCore(None, lease_seconds=20.0, drain_quiet_seconds=0.05, receiver_settle_seconds=SETTLE,
                      journal_synchronous="OFF")
    ar, dit = ar_spec(), dit_spec(num_pages=16)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("stepped", ar.replica_id, dit.replica_id, [40])
    t = core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket
    for w in t.writes:  # the engine gave up on a batch a stopped receiver holds part of
        core.report_write(t.ticket_id, w.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                          status=WriteStatus.FAILED, checksum=0, nbytes=0)
    core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING, core.get_ticket(t.ticket_id)

    STEP[0] = 3600.0  # the host's wall clock steps an hour forward; a second of real time passes
    time.sleep(0.2)
    core.heartbeat(dit.replica_id, dit.incarnation_id)
    core.heartbeat(ar.replica_id, ar.incarnation_id)
    core.tick()
    state = core.get_ticket(t.ticket_id).state
    (pool,) = core.pool_status()
    print("after the step:", state.name, "free", pool.free, "draining", pool.draining)
    assert state is TicketState.DRAINING, f"a wall-clock step ended the settle time: {state.name}"
    assert pool.draining == 3 and pool.free == 13, pool
    core.close()
    print("HELD")
    """
)


def test_a_forward_step_of_the_wall_clock_does_not_free_pages_a_stopped_receiver_may_still_write(
    repo_root: Path,
) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "HELD" in done.stdout, done.stdout + done.stderr[-3000:]


def test_the_steady_clock_follows_monotonic_time_from_one_wall_clock_reading() -> None:
    from kvrelay.broker.core import SteadyWallClock

    wall, mono = [1_000_000.0], [50.0]
    clock = SteadyWallClock(wall=lambda: wall[0], monotonic=lambda: mono[0])
    assert clock() == 1_000_000.0
    wall[0] += 3600.0  # a step: not seen
    mono[0] += 2.5  # time passing: seen
    assert clock() == 1_000_002.5
    wall[0] -= 7200.0
    assert clock() == 1_000_002.5


def test_a_step_between_two_broker_processes_does_not_end_a_failed_writes_settle_time(tmp_path: Path) -> None:
    """Journaled times are the previous process's clock readings. A broker restarted after its
    host's clock stepped forward read a FAILED write's last resolution as an hour old and freed its
    pages as soon as the DiT registered again, while the receiving rank may still hold its bytes.
    Now a restart starts that settle time again (it may delay a free, never bring one forward)."""
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.tickets import TicketOutcome, TicketState, WriteStatus
    from tests.broker.helpers import ManualClock, ar_spec, dit_spec

    settle, clock, path = 30.0, ManualClock(), tmp_path / "journal.sqlite"

    def broker() -> BrokerCore:
        return BrokerCore(path, clock=clock, lease_seconds=10.0, drain_quiet_seconds=0.2,
                          receiver_settle_seconds=settle, journal_synchronous="OFF")

    core = broker()
    ar, dit = ar_spec(), dit_spec(num_pages=16)
    core.register_replica(ar)
    core.register_replica(dit)
    t = core.create_ticket("restarted", ar.replica_id, dit.replica_id, [40])
    assert t is not None
    t = core.arm_ticket(t.ticket_id, ar.replica_id, ar.incarnation_id).ticket
    for w in t.writes:
        core.report_write(t.ticket_id, w.key, replica_id=ar.replica_id, incarnation_id=ar.incarnation_id,
                          status=WriteStatus.FAILED, checksum=0)
    core.cancel_ticket(t.ticket_id, TicketOutcome.TIMED_OUT)
    clock.advance(1.0)
    core.tick()
    assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING
    core.close()

    clock.advance(3600.0)  # the wall clock stepped while the broker restarted
    core = broker()
    try:
        core.register_replica(dit)  # the same incarnations, back within a second of the restart
        core.register_replica(ar)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.DRAINING, "the settle time ended at the restart"
        assert core.pool_status()[0].draining == 3
        clock.advance(settle + 1.0)
        core.heartbeat(dit.replica_id, dit.incarnation_id)
        core.tick()
        assert core.get_ticket(t.ticket_id).state is TicketState.RELEASED
        assert core.pool_status()[0].free == 16
    finally:
        core.close()
