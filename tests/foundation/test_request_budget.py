"""The time a stage request (AR Prefill, DiT Denoise) may take, as both services compute it
(kvrelay.errors.request_budget): a caller's deadline beyond what gRPC can pass on (past 2262: a Go
client's "no deadline", `grpcurl -max-time 8e9`) or infinite is held to MAX_DEADLINE_SECONDS, so
the replica's own calls and waits get a deadline gRPC accepts. The broker's side of the same bug:
tests/orchestrator/test_far_deadline.py; the services end to end: tests/ar_service/test_ar_service.py."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import timestamp_pb2

from kvrelay.errors import MAX_DEADLINE_SECONDS, request_budget, timestamp_problem

NOW = 1_800_000_000.0


class _Context:
    """What request_budget reads of a grpc.aio.ServicerContext."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def _at(seconds_from_now: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int((NOW + seconds_from_now) * 1e9))
    return ts


def _budget(remaining: float | None, default_s: float = 600.0, deadline_time: Any = None) -> float:
    return request_budget(_Context(remaining), default_s, deadline_time, wall_clock=lambda: NOW)  # type: ignore[arg-type]


@pytest.mark.parametrize("remaining", [8e9, 1e15, float("inf")])
def test_a_deadline_past_what_grpc_can_carry_is_held_to_the_longest(remaining: float) -> None:
    assert _budget(remaining) == MAX_DEADLINE_SECONDS


def test_a_request_deadline_time_in_year_9999_is_held_too() -> None:
    far = timestamp_pb2.Timestamp(seconds=253_402_300_799)  # 9999-12-31T23:59:59Z, Timestamp's last second
    assert _budget(8e9, deadline_time=far) == MAX_DEADLINE_SECONDS
    assert _budget(None, default_s=2 * MAX_DEADLINE_SECONDS, deadline_time=far) == MAX_DEADLINE_SECONDS


def test_ordinary_deadlines_pass_unchanged() -> None:
    assert _budget(30.0) == 30.0
    assert _budget(None, default_s=600.0) == 600.0  # no deadline: the stage's request_timeout_seconds
    assert _budget(8e9, deadline_time=_at(45.0)) == pytest.approx(45.0)
    assert _budget(30.0, deadline_time=_at(45.0)) == 30.0
    assert _budget(30.0, deadline_time=_at(-1.0)) == pytest.approx(-1.0)  # already late: the caller ends it


INVALID_TIMESTAMPS = [
    timestamp_pb2.Timestamp(seconds=-(2**62)),
    timestamp_pb2.Timestamp(seconds=2**62),
    timestamp_pb2.Timestamp(seconds=2**63 - 1, nanos=999_999_999),
    timestamp_pb2.Timestamp(seconds=10**10, nanos=2**31 - 1),
    timestamp_pb2.Timestamp(seconds=int(NOW), nanos=-5),
]


@pytest.mark.parametrize("ts", INVALID_TIMESTAMPS, ids=str)
def test_an_invalid_deadline_time_never_raises_here_and_is_named_for_the_refusal(ts: timestamp_pb2.Timestamp) -> None:
    """Found black-box: a Prefill or Denoise (a caller holding the replica token, posing as the
    broker) whose deadline_time lay outside Timestamp's range ended UNKNOWN with a ValueError from
    Timestamp.ToNanoseconds(). The budget is computed without raising; the handlers refuse the
    field INVALID_ARGUMENT with `timestamp_problem` (the AR's and DiT's validation: real processes
    in tests/ar_service/test_plan_authority.py and tests/dit_service/test_service_e2e.py)."""
    budget = _budget(30.0, deadline_time=ts)
    assert budget <= 30.0
    problem = timestamp_problem(ts)
    assert problem is not None and ("seconds" in problem or "nanos" in problem)


def test_valid_timestamps_have_no_problem() -> None:
    for ts in (_at(45.0), _at(-1.0), timestamp_pb2.Timestamp(seconds=253_402_300_799, nanos=999_999_999),
               timestamp_pb2.Timestamp(seconds=-62_135_596_800)):  # fmt: skip
        assert timestamp_problem(ts) is None

