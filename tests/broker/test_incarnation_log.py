"""A node's routine start (new incarnations over a journal's stopped or lapsed ones) logs at info;
only replacing a live incarnation is a warning."""

from __future__ import annotations

import structlog.testing

from kvrelay.broker.core import BrokerCore
from tests.broker.helpers import ManualClock, ar_spec, new_incarnation


def _levels(events: list[dict[str, object]]) -> list[object]:
    return [e["log_level"] for e in events if e["event"] == "replica_new_incarnation"]


def test_new_incarnation_is_news_only_when_the_old_one_was_live() -> None:
    clock = ManualClock()
    core = BrokerCore(None, clock=clock, lease_seconds=10.0, journal_synchronous="OFF")
    try:
        first = ar_spec()
        core.register_replica(first)
        core.deregister_replica(first.replica_id, first.incarnation_id)
        with structlog.testing.capture_logs() as events:
            second = new_incarnation(first)
            core.register_replica(second)  # after a clean stop: routine
        assert _levels(events) == ["info"]
        clock.advance(30)
        with structlog.testing.capture_logs() as events:
            third = new_incarnation(second)
            core.register_replica(third)  # after the lease lapsed: routine
        assert _levels(events) == ["info"]
        with structlog.testing.capture_logs() as events:
            core.register_replica(new_incarnation(third))  # the live one replaced: news
        assert _levels(events) == ["warning"]
    finally:
        core.close()
