"""A replica's wait for its broker at start (kvrelay/broker_wait.py), on a clock the test moves:
the AR and the DiT give up after the same `broker.register_wait_seconds` (they waited 120 s and
30 s), back off between tries, and log what they wait for every few seconds, not on every try."""

from __future__ import annotations

from structlog.testing import capture_logs

from kvrelay.broker_wait import DEFAULT_REGISTER_WAIT_SECONDS, PROGRESS_INTERVAL_S, BrokerWait
from kvrelay.config import BrokerConfig


def _run(wait: BrokerWait, now: list[float], try_s: float) -> list[float]:
    """Tries that each take `try_s` and are never answered, until the wait gives up; the delays."""
    delays: list[float] = []
    while True:
        now[0] += try_s
        delay = wait.unanswered("UNAVAILABLE", "connection refused")
        if delay is None:
            return delays
        delays.append(delay)
        now[0] += delay


def test_the_wait_gives_up_once_the_next_try_would_pass_the_bound_and_backs_off() -> None:
    now = [100.0]
    wait = BrokerWait("10.0.0.1:50051", 30.0, clock=lambda: now[0])
    delays = _run(wait, now, try_s=0.0)
    assert delays[:5] == [0.2, 0.4, 0.8, 1.6, 2.0] and set(delays[5:]) == {2.0}
    assert 28.0 < now[0] - 100.0 <= 30.0  # given up within the bound, not a try early
    assert wait.tries == len(delays) + 1


def test_progress_says_what_it_waits_for_every_few_seconds_not_every_try() -> None:
    now = [0.0]
    wait = BrokerWait("10.0.0.1:50051", 60.0, first_delay_s=0.1, max_delay_s=1.0, clock=lambda: now[0])
    with capture_logs() as logs:
        delays = _run(wait, now, try_s=0.1)
    progress = [e for e in logs if e["event"] == "broker_not_reachable_yet"]
    assert len(delays) > 50  # about one try a second
    assert 11 <= len(progress) <= 13, [e["waited_s"] for e in progress]  # one per 5 s of 60
    first = progress[0]
    assert first["waiting_for"] == "the broker at 10.0.0.1:50051 to answer RegisterReplica"
    assert (first["code"], first["message"], first["tries"]) == ("UNAVAILABLE", "connection refused", 1)
    assert first["waited_s"] == 0.1 and first["gives_up_in_s"] == 59.9
    gaps = [b["waited_s"] - a["waited_s"] for a, b in zip(progress, progress[1:], strict=False)]
    assert all(PROGRESS_INTERVAL_S <= g < PROGRESS_INTERVAL_S + 1.5 for g in gaps), gaps


def test_one_default_for_both_replicas() -> None:
    assert BrokerConfig().register_wait_seconds == DEFAULT_REGISTER_WAIT_SECONDS == 120.0
