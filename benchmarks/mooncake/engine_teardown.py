"""How long does the process stop when a replaced Mooncake sending engine is destroyed?

A MooncakeEndpoint replaces its sending engine when a peer on a dead one's port cannot be
written (docs/transfer.md). Destroying a TransferEngine holds the GIL while its handshake
listener waits out a 1 s accept timeout, so every Python thread of the process (an AR's event
loop, its gRPC threads) stops meanwhile. This script makes one sender replace its engine again
and again against one live receiver (each replacement caused on cue: the write's first engine
call fails, the peer answers its probe), and measures per replacement:

- write ms: how long the write that caused it took (the serving path);
- stall ms: the longest gap of a thread that wakes every millisecond, from the write's start
  until 1.5 s after it returned (the pause every other thread of the process saw, including a
  teardown that runs in the background after the write).

Rate limits are lifted (module constants) so that the replacements come back to back.

    python benchmarks/mooncake/engine_teardown.py                      # this tree only
    git archive 449a527 | tar -x -C /tmp/kvrelay-before
    python benchmarks/mooncake/engine_teardown.py --before /tmp/kvrelay-before   # side by side
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_RECEIVER = """
import ctypes, sys
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = ctypes.create_string_buffer(1 << 16)
assert engine.register_memory(ctypes.addressof(buf), 1 << 16) == 0
print(engine.get_rpc_port(), ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""

# Lifted so that replacements come back to back (whichever of them the tree under test has).
_UNLIMITED = {
    "_MIN_REPLACE_INTERVAL_S": 0.0, "_REPLACE_BACKOFF_S": 0.0, "_REPLACE_BACKOFF_MAX_S": 0.0,
    "_REPLACE_BURST": 1000, "_REPLACE_REFILL_S": 0.001, "_REPLACE_PEER_INTERVAL_S": 0.0,
}  # fmt: skip


class _Heartbeat:
    """A thread that sleeps 1 ms at a time and remembers its longest gap since `reset()`."""

    def __init__(self) -> None:
        self._max = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            with self._lock:
                self._max = max(self._max, now - last)
            last = now

    def reset(self) -> None:
        with self._lock:
            self._max = 0.0

    def longest_ms(self) -> float:
        with self._lock:
            return 1000 * self._max

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(replacements: int) -> dict[str, Any]:
    """Runs in the tree on PYTHONPATH: one row per replacement."""
    import numpy as np

    from kvrelay.transfer import mooncake
    from kvrelay.transfer.planner import PlannedWrite, Segment
    from kvrelay.transfer.transport import RegionDescriptor

    for name, value in _UNLIMITED.items():
        if hasattr(mooncake, name):
            setattr(mooncake, name, value)
    rx = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert rx.stdout is not None and rx.stdin is not None
    port, addr = (int(x) for x in rx.stdout.readline().split())
    region = RegionDescriptor(0, "mooncake", f"127.0.0.1:{port}", addr, 1 << 16)
    sender = mooncake.MooncakeEndpoint("127.0.0.1", "tcp")
    src = np.full(1 << 16, 1, dtype=np.uint8)
    sender.register(src)
    write = [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))]
    real = sender._transfer
    fail_next = [False]

    def transfer(*args: Any) -> int:
        if fail_next[0]:
            fail_next[0] = False
            return -1
        return int(real(*args))

    sender._transfer = transfer  # type: ignore[method-assign]
    beat = _Heartbeat()
    rows = []
    try:
        for i in range(replacements):
            (ok,) = sender.write(src, write, {0: region}, f"t{i}-ok", 10.0)  # the engine writes the peer
            assert ok.status == "OK", ok.message
            before = sender.engine_replacements
            fail_next[0] = True
            beat.reset()
            t0 = time.perf_counter()
            (out,) = sender.write(src, write, {0: region}, f"t{i}", 10.0)
            write_ms = 1000 * (time.perf_counter() - t0)
            time.sleep(1.5)  # a teardown in the background happens meanwhile
            rows.append({
                "write_ms": write_ms, "stall_ms": beat.longest_ms(), "status": out.status,
                "replaced": sender.engine_replacements - before,
            })  # fmt: skip
    finally:
        beat.stop()
        rx.stdin.close()
        rx.wait(10)
    t0 = time.perf_counter()
    sender.close()
    return {"rows": rows, "close_ms": 1000 * (time.perf_counter() - t0)}


def run_in(tree: Path, replacements: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "MC_LOG_LEVEL": "ERROR"}
    out = subprocess.run(
        [sys.executable, __file__, "--measure", str(replacements)], env=env, capture_output=True, text=True,
        timeout=300, cwd=tree,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"measuring in {tree} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replacements", type=int, default=8)
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare with (e.g. git archive of main)")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)), flush=True)
        return 0
    here = Path(__file__).resolve().parents[2]
    runs = {"after": run_in(here, args.replacements)}
    if args.before:
        runs = {"before": run_in(args.before.resolve(), args.replacements), **runs}
    names = list(runs)
    print("replacement  " + "  ".join(f"{n + ' write ms':>16} {n + ' stall ms':>16}" for n in names))
    for i in range(args.replacements):
        cells = []
        for n in names:
            row = runs[n]["rows"][i]
            flag = "" if row["status"] == "OK" and row["replaced"] == 1 else f" ({row['status']}, {row['replaced']} repl.)"
            cells.append(f"{row['write_ms']:>16.1f} {row['stall_ms']:>16.1f}{flag}")
        print(f"{i + 1:>11}  " + "  ".join(cells))
    for n in names:
        rows = runs[n]["rows"]
        print(f"{n}: max write {max(r['write_ms'] for r in rows):.0f} ms, max stall {max(r['stall_ms'] for r in rows):.0f} ms "
              f"over {len(rows)} replacements; close() {runs[n]['close_ms']:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
