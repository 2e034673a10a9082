"""A Mooncake sender keeps writing to peers that restart on a dead one's port.

A receiver's ports come from ~2,000, so a restarted DiT sooner or later takes a port a dead one
had. A long-lived sender engine keeps what it learnt of a peer under its session name
"host:rpc_port" (the dead peer's data port, its segment handle) and wrote none of those writes;
the sender now writes them through a fresh engine once the peer answers at its RPC port (tested
here with the restart staged behind a forwarder that keeps the session's port, since a real port
comes round only after TIME_WAIT, a minute; `benchmarks/mooncake/port_reuse.py` does the real
thing). It sends a failed batch once more (tested with an engine that fails on cue), leaves the
engine's segment descriptor cache to the environment (tested), and memory a peer registers after a
first write is writable (tested)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvrelay.transfer.planner import PlannedWrite, Segment

mooncake = pytest.importorskip("kvrelay.transfer.mooncake")

_RECEIVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvrelay.transfer.mooncake import MooncakeEndpoint

    ep = MooncakeEndpoint("127.0.0.1", "tcp")
    bufs = []
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "region":
            bufs.append(np.zeros(int(cmd[1]), dtype=np.uint8))
            r = ep.register_region(bufs[-1], len(bufs) - 1)
            print(r.endpoint, r.base_address, r.length, flush=True)
        elif cmd[0] == "sum":
            print(int(bufs[int(cmd[1])].astype(np.int64).sum()), flush=True)
        elif cmd[0] == "exit":
            break
    """
)


class _Receiver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply, f"receiver gave no answer to {line!r} (exit {self.proc.poll()})"
        return reply

    def region(self, rank: int, nbytes: int) -> Any:
        session, base, length = self.ask(f"region {nbytes}").split()
        return mooncake.RegionDescriptor(rank, "mooncake", session, int(base), int(length))

    def kill(self) -> None:
        """Gone at once, as with kill -9: its sockets are closed by the kernel."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def sender() -> Iterator[Any]:
    ep = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    ep.register(_SRC)  # once: a fresh array per test could overlap a dead one's registration
    yield ep
    ep.close()


_SRC = np.full(1 << 16, 3, dtype=np.uint8)


def test_the_endpoint_leaves_the_descriptor_cache_setting_to_the_environment() -> None:
    """An endpoint writes no MC_DISABLE_METACACHE into its process's environment. It used to
    default it to 1 after the engine had read it (at import): no engine of its own process saw
    it, every process started later did, and a test process's endpoint so turned the cache off
    in the nodes of every later test (a stopped receiver then held a batch ~60 s, past
    MC_TRANSFER_TIMEOUT: tests/e2e/test_in_doubt_write.py)."""
    code = (
        "import os; from kvrelay.transfer.mooncake import MooncakeEndpoint; "
        "ep = MooncakeEndpoint('127.0.0.1', 'tcp'); print(os.environ.get('MC_DISABLE_METACACHE', 'unset')); ep.close()"
    )
    env = {k: v for k, v in os.environ.items() if k != "MC_DISABLE_METACACHE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-1:] == ["unset"], (out.stdout[-500:], out.stderr[-2000:])
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MC_DISABLE_METACACHE": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-1:] == ["1"], "an explicit setting is the engine's, kept"


def _sum_until(rx: _Receiver, index: int, expected: int) -> int:
    # Mooncake's TCP transport may report completion just before the bytes land.
    end = time.monotonic() + 5.0
    got = int(rx.ask(f"sum {index}"))
    while got != expected and time.monotonic() < end:
        time.sleep(0.02)
        got = int(rx.ask(f"sum {index}"))
    return got


def test_a_region_the_peer_registers_after_the_first_write_is_writable(sender: Any) -> None:
    rx = _Receiver()
    try:
        src = _SRC
        first = rx.region(0, 1 << 16)
        w = PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))
        (out,) = sender.write(src, [w], {0: first}, "t-first", 10.0)
        assert out.status == "OK", out.message
        assert _sum_until(rx, 0, 3 * 4096) == 3 * 4096
        # The peer's segment changes under the same session name.
        second = rx.region(1, 1 << 16)
        assert second.endpoint == first.endpoint
        w2 = PlannedWrite(0, 0, 1, (Segment(0, 0, 8192),))
        (out2,) = sender.write(src, [w2], {1: second}, "t-second", 10.0)
        assert out2.status == "OK", out2.message
        assert _sum_until(rx, 1, 3 * 8192) == 3 * 8192
    finally:
        rx.close()


def _flaky(ep: Any, failures: int, delay: float = 0.0) -> list[int]:
    """The first `failures` engine calls of `ep` return -1 (each after `delay` seconds); returns
    the list of call results."""
    real = ep._transfer
    calls: list[int] = []

    def transfer(*args: Any) -> int:
        if len(calls) < failures:
            time.sleep(delay)
            rc = -1
        else:
            rc = real(*args)
        calls.append(rc)
        return rc

    ep._transfer = transfer
    return calls


def _write_with_failures(
    sender: Any, rx: _Receiver, failures: int, ticket_id: str, delay: float = 0.0
) -> tuple[list[int], Any]:
    """One 4 KiB write into a fresh region of `rx` while the first `failures` engine calls fail:
    (every engine call's result, the write's outcome)."""
    region = rx.region(0, 1 << 16)
    calls = _flaky(sender, failures, delay)
    try:
        (out,) = sender.write(_SRC, [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))], {0: region}, ticket_id, 10.0)
    finally:
        del sender._transfer
    return calls, out


def test_a_batch_that_fails_once_is_sent_again_and_lands(sender: Any) -> None:
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(sender, rx, 1, "t-once")
        assert calls == [-1, 0]
        assert out.status == "OK" and out.final, out.message
        assert _sum_until(rx, 0, 3 * 4096) == 3 * 4096
    finally:
        rx.close()


def test_fast_failures_are_retried_until_a_stale_connection_pool_is_used_up(sender: Any) -> None:
    """Seen on CI: a sender that wrote to a dead peer from several threads held two stale
    connections to its port, and the one retry hit the second. Quick failures are tried again
    (up to five tries in all)."""
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(sender, rx, 3, "t-thrice")
        assert calls == [-1, -1, -1, 0]
        assert out.status == "OK" and out.final, out.message
        assert _sum_until(rx, 0, 3 * 4096) == 3 * 4096
    finally:
        rx.close()


def test_a_batch_that_keeps_failing_is_final_failed_after_five_tries(sender: Any) -> None:
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(sender, rx, 9, "t-always")
        assert calls == [-1] * 5, "five tries, not more"
        assert out.status == "FAILED" and out.final
        assert "returned -1" in out.message and "5 tries" in out.message
    finally:
        rx.close()


def test_a_slow_failure_is_not_retried(sender: Any) -> None:
    """A failure that took a connect timeout's time is an unreachable peer, not a stale
    connection: retrying would only wait it out again."""
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(sender, rx, 2, "t-slow", delay=1.2)
        assert calls == [-1]
        assert out.status == "FAILED" and out.final
        assert "1 try)" in out.message
    finally:
        rx.close()


class _SessionPort:
    """A fixed port in front of whichever receiver is current: each connection to it is piped
    to the current receiver's RPC port. A receiver started behind it after another died is, to
    a sender, a peer restarted on the dead one's port (same session name, new process, new data
    port), without waiting for the port to come round. Data connections go to the receiver's
    own data port, as they do from the descriptor it hands out."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.backend = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def session(self) -> str:
        return f"127.0.0.1:{self.port}"

    def behind(self, region: Any) -> Any:
        """`region` (of the receiver now current) as a sender addresses it: by this port."""
        self.backend = int(region.endpoint.rsplit(":", 1)[1])
        return replace(region, endpoint=self.session())

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.backend), timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                client.close()  # nothing listens there: the sender sees its connection dropped
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(10)
        assert not self._thread.is_alive()
        with self._lock:
            for sock in self._sockets:
                sock.close()


@pytest.fixture
def own_sender() -> Iterator[Any]:
    """A sender of the test's own: engine replacements are bounded per endpoint."""
    ep = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    ep.register(_SRC)
    yield ep
    ep.close()


def _write_4k(sender: Any, region: Any, ticket_id: str) -> Any:
    (out,) = sender.write(_SRC, [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))], {0: region}, ticket_id, 20.0)
    return out


def test_a_peer_restarted_on_a_dead_ones_port_is_written_by_the_same_sender(own_sender: Any) -> None:
    """The product bug: after a DiT's kill -9 and a restart on a port an earlier receiver had,
    its long-lived AR wrote none of its writes (every try went to the dead one's data port)."""
    front = _SessionPort()
    first = _Receiver()
    second = None
    try:
        (out,) = [_write_4k(own_sender, front.behind(first.region(0, 1 << 16)), "t-before")]
        assert out.status == "OK", out.message
        assert _sum_until(first, 0, 3 * 4096) == 3 * 4096
        first.kill()

        second = _Receiver()
        region = front.behind(second.region(0, 1 << 16))
        out = _write_4k(own_sender, region, "t-after-restart")
        assert out.status == "OK" and out.final, out.message
        assert _sum_until(second, 0, 3 * 4096) == 3 * 4096
        assert own_sender.engine_replacements == 1
        # Written through the new engine from now on, with no further replacement.
        out = _write_4k(own_sender, replace(region, base_address=region.base_address + 4096), "t-again")
        assert out.status == "OK", out.message
        assert _sum_until(second, 0, 3 * 8192) == 3 * 8192
        assert own_sender.engine_replacements == 1
    finally:
        for rx in (first, second):
            if rx is not None:
                rx.close()
        front.close()


def test_a_dead_peer_does_not_replace_the_engine(own_sender: Any) -> None:
    """Nothing answers at the dead peer's RPC port: a fresh engine would fail the same, so the
    write fails as before (five quick tries) and the engine stays."""
    front = _SessionPort()
    rx = _Receiver()
    try:
        region = front.behind(rx.region(0, 1 << 16))
        assert _write_4k(own_sender, region, "t-alive").status == "OK"
        rx.kill()
        out = _write_4k(own_sender, region, "t-dead")
        assert out.status == "FAILED" and out.final, out.message
        assert own_sender.engine_replacements == 0
    finally:
        rx.close()
        front.close()


def test_a_peer_that_keeps_failing_replaces_the_engine_once(own_sender: Any) -> None:
    """No engine churn: a live peer whose writes keep failing (here an engine that fails on cue)
    causes one replacement; the fresh engine never wrote it, so it holds nothing stale for it and
    another would fail the same."""
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(own_sender, rx, 0, "t-ok-first")
        assert out.status == "OK" and calls == [0], out.message
        calls, out = _write_with_failures(own_sender, rx, 99, "t-fails")
        assert out.status == "FAILED" and calls == [-1] * 5
        assert own_sender.engine_replacements == 1
        calls, out = _write_with_failures(own_sender, rx, 99, "t-fails-again")
        assert out.status == "FAILED" and calls == [-1] * 5
        assert own_sender.engine_replacements == 1
        assert "never wrote" in out.message, out.message
        calls, out = _write_with_failures(own_sender, rx, 0, "t-ok")
        assert out.status == "OK" and calls == [0], out.message
        assert _sum_until(rx, 3, 3 * 4096) == 3 * 4096  # the fourth region it made
    finally:
        rx.close()


def test_a_peer_the_engine_never_wrote_does_not_replace_it(own_sender: Any) -> None:
    """A first write that fails fast to a live peer: the engine holds nothing stale for a name
    it never wrote, so a fresh one would fail the same; five tries on this one, no new engine."""
    rx = _Receiver()
    try:
        calls, out = _write_with_failures(own_sender, rx, 99, "t-first-contact")
        assert out.status == "FAILED" and out.final and calls == [-1] * 5
        assert own_sender.engine_replacements == 0
        assert "never wrote" in out.message, out.message
    finally:
        rx.close()


def test_a_second_stale_peer_right_after_a_replacement_is_written_at_once(own_sender: Any) -> None:
    """Found after the fix: one new engine per 10 s per endpoint failed every other stale peer
    of that window, the fresh engine included in what went stale (it wrote the second peer's
    predecessor after it started). Each stale peer is now written on its first failing request."""
    fronts = [_SessionPort(), _SessionPort()]
    receivers: list[_Receiver] = []

    def start_behind(front: _SessionPort) -> Any:
        receivers.append(_Receiver())
        return front.behind(receivers[-1].region(0, 1 << 16))

    try:
        a, b = fronts
        assert _write_4k(own_sender, start_behind(a), "t-a1").status == "OK"
        receivers[-1].kill()
        out = _write_4k(own_sender, start_behind(a), "t-a2")  # stale on the first engine
        assert out.status == "OK", out.message
        assert own_sender.engine_replacements == 1
        assert _sum_until(receivers[-1], 0, 3 * 4096) == 3 * 4096

        assert _write_4k(own_sender, start_behind(b), "t-b1").status == "OK"  # through the fresh engine
        receivers[-1].kill()
        out = _write_4k(own_sender, start_behind(b), "t-b2")  # stale on the fresh engine, seconds later
        assert out.status == "OK" and out.final, out.message
        assert own_sender.engine_replacements == 2
        assert _sum_until(receivers[-1], 0, 3 * 4096) == 3 * 4096
    finally:
        for rx in receivers:
            rx.close()
        for front in fronts:
            front.close()


def test_engine_replacements_are_bounded_per_endpoint_and_per_peer(
    own_sender: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of stale peers starts at most the burst of new engines (then one per refill
    period), and a peer that goes stale again on the fresh engine made for it causes no other
    replacement within the per-peer interval."""
    monkeypatch.setattr(mooncake, "_REPLACE_REFILL_S", 3600.0)
    own_sender._replace_tokens = 3.0  # as if _REPLACE_BURST were 3 and nothing refilled
    receivers = [_Receiver() for _ in range(4)]
    first, second, third, fourth = receivers

    def goes_stale(rx: _Receiver, ticket: str, failures: int = 1) -> tuple[list[int], Any]:
        """Written through the current engine, then a write whose first `failures` calls fail."""
        assert _write_with_failures(own_sender, rx, 0, ticket + "-ok")[1].status == "OK"
        return _write_with_failures(own_sender, rx, failures, ticket)

    try:
        for rx, ticket in ((first, "t-1"), (second, "t-2")):
            calls, out = goes_stale(rx, ticket)
            assert out.status == "OK" and calls == [-1, 0], out.message
        assert own_sender.engine_replacements == 2

        # The same peer goes stale again on the engine made for it: within the per-peer interval,
        # no new engine (a token is left); the batch is sent again through this one.
        calls, out = goes_stale(second, "t-2-again")
        assert out.status == "OK" and calls == [-1, 0], out.message
        assert own_sender.engine_replacements == 2

        calls, out = goes_stale(third, "t-3")
        assert out.status == "OK" and own_sender.engine_replacements == 3, out.message
        # No tokens left: a fourth stale peer is not sent through a fresh engine, and says why.
        calls, out = goes_stale(fourth, "t-4", failures=99)
        assert out.status == "FAILED" and calls == [-1] * 5
        assert own_sender.engine_replacements == 3
        assert "fresh engines started lately" in out.message, out.message
    finally:
        for rx in receivers:
            rx.close()
