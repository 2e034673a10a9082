"""Replaced Mooncake sending engines are destroyed off the serving path, never under a call.

An engine's destructor holds the GIL about a second unless its listener is woken; the endpoint
hands engines no call runs on to its EngineReaper (own thread, listener woken from a helper
process). How long the process stalls is measured in benchmarks/mooncake/engine_teardown.py;
these tests check the outcomes: which engines go, when, and that the endpoint keeps writing."""

from __future__ import annotations

import socket
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvrelay.transfer.planner import PlannedWrite, Segment
from tests.transfer.test_mooncake_peer_restart import _Receiver, _sum_until

mooncake = pytest.importorskip("kvrelay.transfer.mooncake")

_SRC = np.full(1 << 16, 5, dtype=np.uint8)
_WRITE = [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))]


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A sender that may replace its engine back to back for one peer (the bounds are tested in
    test_mooncake_peer_restart.py)."""
    monkeypatch.setattr(mooncake, "_REPLACE_PEER_INTERVAL_S", 0.0)
    ep = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    ep.register(_SRC)
    yield ep
    ep.close()


def _replace(ep: Any, region: Any, ticket_id: str) -> None:
    """A write through the current engine, then one whose first engine call fails while the peer
    answers: the endpoint writes it through a fresh engine."""
    (out,) = ep.write(_SRC, _WRITE, {0: region}, ticket_id + "-before", 20.0)
    assert out.status == "OK", out.message
    before = ep.engine_replacements
    real = ep._transfer
    calls: list[int] = []

    def transfer(*args: Any) -> int:
        calls.append(0)
        return -1 if len(calls) == 1 else int(real(*args))

    ep._transfer = transfer
    try:
        (out,) = ep.write(_SRC, _WRITE, {0: region}, ticket_id, 20.0)
    finally:
        del ep._transfer
    assert out.status == "OK", out.message
    assert ep.engine_replacements == before + 1


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5.0).close()
    except ConnectionRefusedError:
        return False
    return True


def test_a_replaced_engine_goes_once_the_call_on_it_returns_and_not_before(endpoint: Any) -> None:
    rx = _Receiver()
    try:
        region = rx.region(0, 1 << 16)
        _replace(endpoint, region, "t-replace-1")
        busy = endpoint._acquire_sender()  # a call still running on the second engine
        binding = weakref.ref(busy.engine)
        _replace(endpoint, region, "t-replace-2")
        assert endpoint._sender is not busy
        assert endpoint._reaper.wait_idle(30.0)
        # Still alive and usable by the call that runs on it.
        assert busy.engine is not None and busy.engine.send_probe(region.endpoint) == 0
        assert endpoint._reaper.destroyed == 0 and _listening(busy.rpc_port)

        endpoint._release(busy)  # the call returns
        assert endpoint._reaper.wait_idle(30.0)
        assert endpoint._reaper.destroyed == 1
        assert busy.engine is None and binding() is None, "the reaper held the binding's last reference"
        assert not _listening(busy.rpc_port)
        assert endpoint._retired == []

        # The endpoint writes on, through the third engine.
        (out,) = endpoint.write(_SRC, [PlannedWrite(0, 0, 0, (Segment(0, 4096, 4096),))], {0: region}, "t-on", 20.0)
        assert out.status == "OK", out.message
        assert _sum_until(rx, 0, 5 * 8192) == 5 * 8192
    finally:
        rx.close()


def test_an_engine_replaced_with_no_call_on_it_goes_at_once(endpoint: Any) -> None:
    rx = _Receiver()
    try:
        region = rx.region(0, 1 << 16)
        _replace(endpoint, region, "t-replace-1")
        second = endpoint._sender
        _replace(endpoint, region, "t-replace-2")
        assert endpoint._reaper.wait_idle(30.0)
        assert endpoint._reaper.destroyed == 1 and second.engine is None
        assert not _listening(second.rpc_port)
    finally:
        rx.close()


def test_close_destroys_every_engine_and_returns() -> None:
    """At stop, no engine is left for interpreter exit (about a second each, GIL held), and the
    reaper's thread is gone."""
    ep = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    ep.register(_SRC)
    rx = _Receiver()
    try:
        _replace(ep, rx.region(0, 1 << 16), "t-replace")
        ports = [ep._primary.rpc_port, ep._sender.rpc_port]
        ep.close()
        assert ep._reaper.destroyed == 2
        assert ep._reaper._thread is not None and not ep._reaper._thread.is_alive()
        assert [p for p in ports if _listening(p)] == []
        with pytest.raises(mooncake.MooncakeError):
            ep.register(np.zeros(16, dtype=np.uint8))
    finally:
        rx.close()
        ep.close()  # idempotent
