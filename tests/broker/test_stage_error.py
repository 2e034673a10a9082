"""A stage call's gRPC error as the generation's error (broker/pipeline.stage_error)."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.broker.pipeline import stage_error
from kvrelay.broker.stalls import TICK_SECONDS, LoopStalls


class _Err(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_replica_that_stopped_answering_is_named_with_what_to_do(code: grpc.StatusCode) -> None:
    """After kill -9 of an AR, users saw only gRPC's 'recvmsg:Connection reset by peer'."""
    info = stage_error(_Err(code, "recvmsg:Connection reset by peer"), "Prefill", "ar", "ar-0")
    assert (info.code, info.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
    assert info.message.startswith("Prefill on ar replica ar-0: recvmsg:Connection reset by peer")
    assert "stopped answering" in info.message and "can be retried" in info.message


def test_other_errors_keep_their_own_words() -> None:
    info = stage_error(
        _Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "Denoise", "dit", "dit-1"
    )
    assert info.reason == "DEADLINE_EXCEEDED" and "stopped answering" not in info.message


def test_a_connection_lost_while_the_broker_did_not_run_names_the_broker() -> None:
    info = stage_error(
        _Err(grpc.StatusCode.UNAVAILABLE, "ping timeout"), "Denoise", "DiT", "dit-0", own_stall_s=40.2
    )
    assert (info.code, info.reason) == ("UNAVAILABLE", "REPLICA_UNAVAILABLE")
    assert (
        "this broker itself did not run for 40 s" in info.message and "stopped answering" not in info.message
    )


def test_loop_stalls_are_the_gaps_between_ticks_that_overlap_the_call() -> None:
    now = [100.0]
    stalls = LoopStalls(lambda: now[0])
    for _ in range(4):
        now[0] += TICK_SECONDS
        stalls.tick()
    started = now[0]
    assert stalls.longest_since(started) == 0.0
    now[0] += 40.0  # stopped: no tick for 40 s
    stalls.tick()
    assert stalls.longest_since(started) == pytest.approx(40.0)
    assert stalls.longest_since(started + 30.0) == pytest.approx(10.0)  # only the part within the call
    now[0] += 1.0
    assert stalls.longest_since(now[0]) == 0.0  # a call that started after it
