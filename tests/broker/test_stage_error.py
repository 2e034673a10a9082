"""A stage call's gRPC error as the generation's error (broker/pipeline.stage_error)."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.broker.pipeline import stage_error


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
    info = stage_error(_Err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "Denoise", "dit", "dit-1")
    assert info.reason == "DEADLINE_EXCEEDED" and "stopped answering" not in info.message
