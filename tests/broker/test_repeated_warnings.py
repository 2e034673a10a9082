"""Warnings a caller can trigger once per RPC are bounded: a heartbeat, write or load report, or
release naming a stale incarnation is logged at most once a minute per replica id, and the next
line says how many were left out. Found black-box: 300 heartbeats naming made-up incarnations of
`dit-0` (any holder of the shared replica token) wrote 300 `stale_incarnation_heartbeat_ignored`
lines, as fast as the caller sent them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import structlog.testing

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.repeats import REPEAT_WINDOW_S, RepeatedWarnings
from kvrelay.broker.tickets import FailedPrecondition, TicketOutcome, WriteStatus
from tests.broker.helpers import ManualClock, ar_spec, dit_spec

STALE = ("stale_incarnation_heartbeat_ignored", "stale_incarnation_report_ignored")


def _stale_lines(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e["event"] in STALE]


def test_stale_incarnation_calls_log_once_a_minute_per_replica_with_the_count_left_out() -> None:
    clock = ManualClock()
    core = BrokerCore(None, clock=clock, lease_seconds=1e6, journal_synchronous="OFF")
    try:
        ar, dit = ar_spec(), dit_spec()
        core.register_replica(ar)
        core.register_replica(dit)
        created = core.create_ticket("req-1", ar.replica_id, dit.replica_id, [5])
        assert created is not None
        t = core.arm_ticket(created.ticket_id, ar.replica_id, ar.incarnation_id).ticket
        key = t.writes[0].key

        def stale_calls(stale: str) -> list[Callable[[], object]]:
            return [
                lambda: core.heartbeat("dit-0", stale),
                lambda: core.report_write(t.ticket_id, key, replica_id="ar-0", incarnation_id=stale,
                                          status=WriteStatus.OK, checksum=1),
                lambda: core.report_load(t.ticket_id, 0, 0, replica_id="dit-0", incarnation_id=stale, verified={}),
                lambda: core.release_ticket(t.ticket_id, TicketOutcome.OK, replica_id="dit-0", incarnation_id=stale),
            ]  # fmt: skip

        def flood(n: int) -> None:
            for i in range(n):
                for call in stale_calls(f"made-up-{i}"):
                    with pytest.raises(FailedPrecondition) as err:
                        call()
                    assert err.value.reason == "STALE_INCARNATION"

        with structlog.testing.capture_logs() as events:
            flood(300)
        lines = _stale_lines(events)
        # One line per (event, replica id): the heartbeat of dit-0, ar-0's report, dit-0's reports.
        assert sorted((e["event"], e["replica_id"]) for e in lines) == [
            ("stale_incarnation_heartbeat_ignored", "dit-0"),
            ("stale_incarnation_report_ignored", "ar-0"),
            ("stale_incarnation_report_ignored", "dit-0"),
        ], lines
        assert all(e["log_level"] == "warning" and e["suppressed"] == 0 for e in lines)

        # Still within the minute: nothing more. After it: one line each, saying how many were
        # left out (dit-0's reports: 299 loads + 300 releases, its first line was a load).
        clock.advance(REPEAT_WINDOW_S / 2)
        with structlog.testing.capture_logs() as events:
            flood(10)
        assert _stale_lines(events) == []
        clock.advance(REPEAT_WINDOW_S / 2)
        with structlog.testing.capture_logs() as events:
            flood(1)
        again = {(e["event"], e["replica_id"]): e["suppressed"] for e in _stale_lines(events)}
        assert again == {
            ("stale_incarnation_heartbeat_ignored", "dit-0"): 309,
            ("stale_incarnation_report_ignored", "ar-0"): 309,
            ("stale_incarnation_report_ignored", "dit-0"): 619,
        }
        # The live replicas were never fenced and the ticket is untouched.
        assert not core.get_replica("ar-0").fenced and not core.get_replica("dit-0").fenced
        assert core.get_ticket(t.ticket_id).writes[0].status is WriteStatus.PENDING
    finally:
        core.close()


def test_repeated_warnings_forget_the_least_recent_key_past_the_bound() -> None:
    clock = ManualClock()
    repeats = RepeatedWarnings(clock, window_s=60.0, max_keys=2)
    assert repeats.admit("e", "a") == 0
    clock.advance(1)
    assert repeats.admit("e", "b") == 0
    assert repeats.admit("e", "a") is None
    clock.advance(1)
    assert repeats.admit("e", "c") == 0  # "a" (logged first) is forgotten
    assert repeats.admit("e", "b") is None
    assert repeats.admit("e", "a") == 0
