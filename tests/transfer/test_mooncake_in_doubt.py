"""The Mooncake sender's three outcomes, on a real TransferEngine writing to itself over TCP:
a call still in the engine when the wait ends is IN_DOUBT (not FAILED), and `collect_finished`
reports its final outcome only once the engine call has really returned."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvrelay.transfer.planner import PlannedWrite, Segment

mooncake = pytest.importorskip("kvrelay.transfer.mooncake")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Any]:
    ep = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    yield ep
    ep.close()


def _gated(ep: Any, rc: int | None = None) -> threading.Event:
    """Hold every engine call of `ep` until the returned event is set (then run it, or return rc)."""
    gate = threading.Event()
    real = ep._transfer

    def transfer(*args: Any) -> int:
        gate.wait(30)
        return real(*args) if rc is None else rc

    ep._transfer = transfer
    return gate


def _wait_finished(ep: Any, timeout: float = 10.0) -> list[Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = ep.collect_finished()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("the engine call never returned")


def test_a_write_still_in_the_engine_is_in_doubt_then_final_ok(endpoint: Any) -> None:
    dst = np.zeros(1 << 16, dtype=np.uint8)
    region = endpoint.register_region(dst, 0)
    src = (np.arange(1 << 16) % 251).astype(np.uint8)
    endpoint.register(src)
    gate = _gated(endpoint)
    try:
        w = PlannedWrite(0, 0, 0, (Segment(0, 0, 4096), Segment(8192, 4096, 4096)))
        (out,) = endpoint.write(src, [w], {0: region}, "t-ok", 0.2)
        assert out.status == "IN_DOUBT" and not out.final and "may still land" in out.message
        assert endpoint.in_doubt_tickets() == ["t-ok"]
        assert endpoint.collect_finished() == [], "the call has not returned: no final outcome"
        gate.set()
        (finished,) = _wait_finished(endpoint)
        assert finished.ticket_id == "t-ok"
        (final,) = finished.outcomes
        assert (final.status, final.checksum) == ("OK", out.checksum)
        assert endpoint.in_doubt_tickets() == [] and endpoint.collect_finished() == []
        assert (dst[:4096] == src[:4096]).all() and (dst[4096:8192] == src[8192:12288]).all()
    finally:
        gate.set()
        del endpoint._transfer


def test_an_in_doubt_write_whose_call_returns_an_error_is_final_failed(endpoint: Any) -> None:
    dst = np.zeros(1 << 16, dtype=np.uint8)
    region = endpoint.register_region(dst, 0)
    src = np.ones(1 << 16, dtype=np.uint8)
    endpoint.register(src)
    gate = _gated(endpoint, rc=-1)
    try:
        w = PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))
        (out,) = endpoint.write(src, [w], {0: region}, "t-fail", 0.1)
        assert out.status == "IN_DOUBT"
        gate.set()
        (finished,) = _wait_finished(endpoint)
        assert [o.status for o in finished.outcomes] == ["FAILED"]
        assert "returned -1" in finished.outcomes[0].message
    finally:
        gate.set()
        del endpoint._transfer


def test_a_session_call_that_raises_is_a_final_outcome_not_an_escape(endpoint: Any) -> None:
    # An exception out of one session's call used to escape `write` while other sessions' calls
    # could still run (and a ValueError reads as "refused before sending" to the AR rank).
    dst = np.zeros(1 << 16, dtype=np.uint8)
    region = endpoint.register_region(dst, 0)
    src = np.ones(1 << 16, dtype=np.uint8)
    endpoint.register(src)

    def transfer(*args: Any) -> int:
        raise ValueError("engine binding broke")

    endpoint._transfer = transfer
    try:
        w = PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))
        (out,) = endpoint.write(src, [w], {0: region}, "t-raise", 5.0)
        assert out.status == "FAILED" and out.final and "engine binding broke" in out.message
        assert endpoint.in_doubt_tickets() == []
    finally:
        del endpoint._transfer
