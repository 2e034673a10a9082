"""The SDK core (kvrelay.client._core) in-process: the follow / re-attach / cancel and retry rules
that both faces (sync and asyncio) run, driven by events on a fake clock, no server."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.client import GenerationState, KvRelayError, RetryPolicy, _core
from kvrelay.client._common import Deadline
from kvrelay.client.types import ErrorStatus, Generation
from kvrelay.v1 import common_pb2, generation_pb2

PB = generation_pb2.GenerationState
POLICY = RetryPolicy(
    max_attempts=3, initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, reattach_seconds=5.0
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def core_for(request_id: str = "", timeout: float | None = 60.0) -> tuple[_core.GenerationCore, FakeClock]:
    clock = FakeClock()
    request = generation_pb2.GenerateRequest(request_id=request_id, prompt="a fox")
    core = _core.GenerationCore(
        request, Deadline(timeout, clock=clock), POLICY, clock=clock, rng=random.Random(0)
    )
    core.start_following()
    return core, clock


def message(state: int, request_id: str = "r-1", **fields: object) -> generation_pb2.GenerationEvent:
    return generation_pb2.GenerationEvent(request_id=request_id, state=state, **fields)  # type: ignore[arg-type]


def unavailable(reason: str = "REPLICA_DOWN") -> KvRelayError:
    return KvRelayError("UNAVAILABLE", reason, "try again")


def test_messages_become_events_and_the_terminal_one_ends_the_generation() -> None:
    core, _ = core_for()
    assert core.on_message(message(PB.GENERATION_STATE_QUEUED)).state is GenerationState.QUEUED
    assert core.request_id == "r-1" and not core.done
    image = common_pb2.Image(png=b"png", width=64, height=64, seed=3)
    event = core.on_message(message(PB.GENERATION_STATE_SUCCEEDED, image=image))
    assert core.done and core.last is event
    result = core.result()
    assert (result.png, result.width, result.seed, result.request_id) == (b"png", 64, 3, "r-1")


def test_a_failed_generation_is_an_event_whose_result_raises_its_reason() -> None:
    core, _ = core_for()
    error = common_pb2.ErrorStatus(code="DEADLINE_EXCEEDED", reason="TRANSFER_TIMEOUT", message="late")
    core.on_message(message(PB.GENERATION_STATE_FAILED, error=error))
    with pytest.raises(KvRelayError) as info:
        core.result()
    assert (info.value.code, info.value.reason, info.value.request_id) == (
        "DEADLINE_EXCEEDED",
        "TRANSFER_TIMEOUT",
        "r-1",
    )


def test_without_a_request_id_a_broken_stream_is_never_reopened() -> None:
    core, _ = core_for()
    error = unavailable()
    assert core.on_stream_end(error) == _core.Fail(error)
    assert core.failure is error
    # A clean end of the stream before the terminal event is an error too.
    decision = core.on_stream_end(None)
    assert isinstance(decision, _core.Fail) and decision.error.reason == "STREAM_ENDED"


def test_with_a_request_id_a_broken_stream_is_reopened_within_the_window_then_given_up() -> None:
    core, clock = core_for("mine")
    core.on_message(message(PB.GENERATION_STATE_DENOISING, "mine"))
    waits = []
    while isinstance(decision := core.on_stream_end(unavailable()), _core.Wait):
        waits.append(decision.seconds)
        clock.now += decision.seconds
        assert core.wait_over() == _core.Reopen()
    assert isinstance(decision, _core.Fail) and decision.error.reason == "REPLICA_DOWN"
    # Exponential backoff with jitter, capped at max_backoff, for reattach_seconds without progress.
    assert waits[0] <= 0.1 and max(waits) <= 1.0
    assert POLICY.reattach_seconds <= sum(waits) < POLICY.reattach_seconds + 1.0


def test_progress_starts_a_fresh_window() -> None:
    core, clock = core_for("mine")
    core.on_message(message(PB.GENERATION_STATE_QUEUED, "mine"))
    for _ in range(3):
        decision = core.on_stream_end(unavailable())
        assert isinstance(decision, _core.Wait)
        clock.now += 4.0  # each outage alone is within the 5 s window
        assert core.wait_over() == _core.Reopen()
        core.on_message(message(PB.GENERATION_STATE_DENOISING, "mine"))
    assert not core.done


def test_a_broker_stopping_gracefully_is_ridden_out_as_a_crash_is() -> None:
    # A stopping broker fails its live generations FAILED / UNAVAILABLE / BROKER_SHUTTING_DOWN and
    # keeps none of them: a re-attach with the request_id after its restart starts afresh. Found
    # black-box: 8 of 8 request_id generations of a load survived `kill -9` of the broker (the
    # stream broke: re-attached) but 8 of 8 failed on SIGTERM (the FAILED event ended them).
    stopping = common_pb2.ErrorStatus(code="UNAVAILABLE", reason="BROKER_SHUTTING_DOWN", message="bye")
    core, clock = core_for("mine")
    core.on_message(message(PB.GENERATION_STATE_DENOISING, "mine"))
    assert core.on_message(message(PB.GENERATION_STATE_FAILED, "mine", error=stopping)) is None
    assert not core.done
    decision = core.on_stream_end(None)  # the broker then ends the stream
    assert isinstance(decision, _core.Wait)
    clock.now += decision.seconds
    assert core.wait_over() == _core.Reopen()
    core.on_message(message(PB.GENERATION_STATE_QUEUED, "mine"))
    assert core.on_message(message(PB.GENERATION_STATE_SUCCEEDED, "mine")).state is GenerationState.SUCCEEDED
    assert core.done
    # A broker that does not come back within the window: its own reason is raised.
    core, clock = core_for("mine")
    core.on_message(message(PB.GENERATION_STATE_FAILED, "mine", error=stopping))
    while isinstance(decision := core.on_stream_end(None), _core.Wait):
        clock.now += decision.seconds
        core.wait_over()
    assert isinstance(decision, _core.Fail) and decision.error.reason == "BROKER_SHUTTING_DOWN"
    # Without a request_id nothing can be re-attached: the FAILED event ends the generation.
    core, _ = core_for()
    event = core.on_message(message(PB.GENERATION_STATE_FAILED, error=stopping))
    assert event is not None and event.state is GenerationState.FAILED and core.done


def test_a_target_that_never_answered_gets_max_attempts_not_the_window() -> None:
    core, clock = core_for("mine")
    transport = KvRelayError("UNAVAILABLE", "UNAVAILABLE", "connection refused")
    decisions = []
    while isinstance(decision := core.on_stream_end(transport), _core.Wait):
        decisions.append(decision)
        clock.now += decision.seconds
        core.wait_over()
    assert len(decisions) == POLICY.max_attempts - 1


def test_a_deadline_that_passed_is_the_error_and_is_not_reattached() -> None:
    core, clock = core_for("mine", timeout=2.0)
    core.on_message(message(PB.GENERATION_STATE_QUEUED, "mine"))
    clock.now += 2.5
    decision = core.on_stream_end(unavailable())
    assert isinstance(decision, _core.Fail) and decision.error.code == "DEADLINE_EXCEEDED"


def test_cancel_calls_cancel_generation_once_and_ends_the_follow_with_cancelled() -> None:
    core, _ = core_for("mine")
    plan = core.begin_cancel()
    assert plan is not None and plan.call is not None
    assert (plan.call.method, plan.call.request.request_id) == ("CancelGeneration", "mine")
    assert core.begin_cancel() is None  # idempotent
    decision = core.on_stream_end(KvRelayError("CANCELLED", "CANCELLED", "cancelled locally"))
    assert isinstance(decision, _core.Finish)
    assert decision.event.state is GenerationState.CANCELLED
    assert decision.event.error == ErrorStatus(
        "CANCELLED", "CANCELLED_BY_CLIENT", "the generation was cancelled by this client"
    )
    assert core.done and core.begin_cancel() is None


def test_the_servers_answer_to_a_cancel_is_the_outcome_even_when_it_finished_first() -> None:
    core, _ = core_for("mine")
    core.begin_cancel()
    finished = Generation("mine", GenerationState.SUCCEEDED, None, 2, 2, None, None, None, "", None, None)
    core.cancel_answered(finished)
    decision = core.on_stream_end(None)
    assert isinstance(decision, _core.Finish) and decision.event.state is GenerationState.SUCCEEDED


def test_a_cancel_during_the_backoff_stops_the_reopen() -> None:
    core, _ = core_for("mine")
    core.on_message(message(PB.GENERATION_STATE_QUEUED, "mine"))
    assert isinstance(core.on_stream_end(unavailable()), _core.Wait)
    core.begin_cancel()
    decision = core.wait_over()
    assert isinstance(decision, _core.Finish) and decision.event.state is GenerationState.CANCELLED


def test_without_an_id_cancel_only_drops_the_stream_and_nothing_to_cancel_is_not_an_error() -> None:
    core, _ = core_for()
    plan = core.begin_cancel()
    assert plan is not None and plan.call is None
    assert core.cancel_failed(KvRelayError("NOT_FOUND", "GENERATION_NOT_FOUND", "")) is None
    assert core.cancel_failed(KvRelayError("FAILED_PRECONDITION", "ALREADY_FINISHED", "")) is None
    down = unavailable()
    assert core.cancel_failed(down) is down


def test_unary_attempts_retry_only_idempotent_calls_on_unavailable() -> None:
    clock = FakeClock()
    attempts = _core.UnaryAttempts(POLICY, Deadline(30, clock=clock), True, rng=random.Random(1))
    delays = [attempts.failed(unavailable()) for _ in range(POLICY.max_attempts - 1)]
    assert all(0 < d <= POLICY.max_backoff for d in delays)
    with pytest.raises(KvRelayError):
        attempts.failed(unavailable())  # attempts spent
    once = _core.UnaryAttempts(POLICY, Deadline(30, clock=clock), False)
    with pytest.raises(KvRelayError):
        once.failed(unavailable())
    final = _core.UnaryAttempts(POLICY, Deadline(30, clock=clock), True)
    with pytest.raises(KvRelayError):
        final.failed(KvRelayError("NOT_FOUND", "GENERATION_NOT_FOUND", ""))
    late = _core.UnaryAttempts(POLICY, Deadline(0.05, clock=clock), True, rng=random.Random(1))
    with pytest.raises(KvRelayError):
        late.failed(unavailable())  # the backoff would pass the deadline


def test_new_generation_refuses_values_the_wire_cannot_carry() -> None:
    with pytest.raises(KvRelayError) as info:
        _core.new_generation("a fox", "", -1, 64, 64, 2, 2.0, None, None, POLICY)
    assert info.value.details.get("field") == "seed"
    core = _core.new_generation("a fox", "", 7, 128, 96, 3, 2.0, "mine", 5.0, POLICY)
    r = core.request
    assert (r.seed, r.width, r.height, r.num_inference_steps, r.request_id) == (7, 128, 96, 3, "mine")


# A follow is a sequence of these; the core must keep its promises for any order.
STEP = st.sampled_from(["event", "terminal", "unavailable", "other_error", "eof", "cancel", "tick"])


@given(steps=st.lists(STEP, max_size=40), with_id=st.booleans())
def test_any_sequence_keeps_the_follow_rules(steps: list[str], with_id: bool) -> None:
    core, clock = core_for("mine" if with_id else "")
    rid = "mine" if with_id else "server-id"
    failing_for = 0.0
    for step in steps:
        if core.done:
            # Nothing changes an ended generation; cancel is a no-op.
            assert core.begin_cancel() is None
            break
        if step == "event":
            core.on_message(message(PB.GENERATION_STATE_DENOISING, rid))
            failing_for = 0.0
        elif step == "terminal":
            core.on_message(message(PB.GENERATION_STATE_SUCCEEDED, rid))
            assert core.done
        elif step == "cancel":
            core.begin_cancel()
        elif step == "tick":
            clock.now += 0.5
        else:
            error = {
                "unavailable": unavailable(),
                "other_error": KvRelayError("INTERNAL", "X", ""),
                "eof": None,
            }[step]
            decision = core.on_stream_end(error)
            if core.cancel_requested:
                # A requested cancel always ends the follow with a CANCELLED (or the server's) event.
                assert isinstance(decision, _core.Finish)
                assert decision.event.state is GenerationState.CANCELLED
            elif isinstance(decision, _core.Wait):
                # Only a caller's id is re-attached, only after a retryable error, within the window.
                assert with_id and step in ("unavailable", "eof")  # a clean early end is UNAVAILABLE
                assert 0 < decision.seconds <= POLICY.max_backoff
                assert failing_for < POLICY.reattach_seconds
                clock.now += decision.seconds
                failing_for += decision.seconds
                after = core.wait_over()
                assert isinstance(after, _core.Reopen) or core.cancel_requested
            else:
                assert isinstance(decision, _core.Fail)
                assert core.failure is decision.error
                core.start_following()  # a later events() tries again
                failing_for = 0.0


def test_a_status_cancelled_this_client_did_not_ask_for_is_a_dropped_stream_and_is_reattached() -> None:
    """A broker that stops drops the Generate streams opened in its last milliseconds with a bare
    status CANCELLED (seen: 6 of 24 requests of a load whose broker got SIGTERM ended
    'CANCELLED: CANCELLED' in 10 ms, never reaching the broker; with a request_id they now
    re-attach to the restarted broker)."""
    dropped = KvRelayError("CANCELLED", "CANCELLED", "CANCELLED")
    core, clock = core_for("mine")
    decision = core.on_stream_end(dropped)
    assert isinstance(decision, _core.Wait)
    clock.now += decision.seconds
    assert core.wait_over() == _core.Reopen()
    # Without a request_id it cannot re-attach: the error says what happened, and is retryable.
    core, _ = core_for()
    decision = core.on_stream_end(dropped)
    assert isinstance(decision, _core.Fail)
    assert (decision.error.code, decision.error.reason) == ("UNAVAILABLE", "STREAM_DROPPED")
    assert decision.error.retryable and "dropped the Generate stream" in decision.error.message
    # The client's own close is still CLIENT_CLOSED, not a dropped stream.
    closed = _core.client_closed_error()
    assert core_for()[0].on_stream_end(closed) == _core.Fail(closed)


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"initial_backoff": -0.1}, ValueError, "initial_backoff"),
        ({"initial_backoff": float("nan")}, ValueError, "initial_backoff"),
        ({"max_backoff": float("inf")}, ValueError, "max_backoff"),
        ({"multiplier": 0.0}, ValueError, "multiplier"),
        ({"reattach_seconds": -1.0}, ValueError, "reattach_seconds"),
        ({"max_attempts": 0}, ValueError, "max_attempts"),
        ({"max_attempts": 2.5}, TypeError, "max_attempts"),
        ({"max_attempts": True}, TypeError, "max_attempts"),
        ({"initial_backoff": "0.1"}, TypeError, "initial_backoff"),
        ({"initial_backoff": 1.0, "max_backoff": 0.5}, ValueError, "max_backoff"),
    ],
)
def test_retry_policy_refuses_values_that_would_break_a_retry_naming_the_field(
    kwargs: dict[str, object], error: type[Exception], names: str
) -> None:
    # Before: RetryPolicy(initial_backoff=-0.1) was accepted and the first retry raised
    # `ValueError: sleep length must be non-negative`; a NaN backoff slept nothing at all.
    with pytest.raises(error, match=f"RetryPolicy.{names}"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_retry_policy_accepts_the_edges() -> None:
    RetryPolicy(max_attempts=1, initial_backoff=0.0, max_backoff=0.0, multiplier=1.0, reattach_seconds=0.0)
    assert list(RetryPolicy(max_attempts=1).backoffs()) == []
