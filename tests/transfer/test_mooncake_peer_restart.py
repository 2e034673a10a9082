"""A Mooncake sender keeps writing to peers that restart on a dead one's port.

A receiver's ports come from ~2,000, so a restarted DiT sooner or later takes a port a dead one
had; a long-lived sender's first write to it then failed (its engine still held the dead peer's
connection), which failed a CI run. The sender now sends a failed batch once more (tested here
with an engine that fails on cue; `benchmarks/mooncake/port_reuse.py` reproduces the real thing,
which needs a minute for a port to come round) and runs its engine without the segment
descriptor cache (tested as set, and memory a peer registers after a first write is writable)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
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


def test_the_endpoint_turns_the_descriptor_cache_off_unless_told() -> None:
    code = (
        "import os; from kvrelay.transfer.mooncake import MooncakeEndpoint; "
        "ep = MooncakeEndpoint('127.0.0.1', 'tcp'); print(os.environ['MC_DISABLE_METACACHE']); ep.close()"
    )
    env = {k: v for k, v in os.environ.items() if k != "MC_DISABLE_METACACHE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-1:] == ["1"], out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MC_DISABLE_METACACHE": "0"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-1:] == ["0"], "an explicit setting wins"


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
