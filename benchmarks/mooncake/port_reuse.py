"""Does a Mooncake sender keep writing to receivers that restart on a port a dead one had?

Starts receiver processes one after another (each a TransferEngine with one registered buffer,
as a DiT rank is), writes 4 KiB into each through kvrelay's `MooncakeEndpoint` (one long-lived
sender, as an AR is), checks the bytes landed, and stops the receiver. RPC ports come from
MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000-17000 by default), so sooner or later a receiver takes
a port an earlier one had: the line for it says REUSED and whether the write landed. A port
comes round again only a minute after its last connection closed (TIME_WAIT), so a run needs
more than a minute before any reuse can show.

    python benchmarks/mooncake/port_reuse.py --receivers 150 --ports 24000:24200
    MC_DISABLE_METACACHE=0 python benchmarks/mooncake/port_reuse.py --receivers 150 --ports 24000:24200  # cache on

Takes about a second per receiver. docs/transfer.md (Mooncake) has what it showed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from kvrelay.transfer.mooncake import MooncakeEndpoint
from kvrelay.transfer.planner import PlannedWrite, Segment
from kvrelay.transfer.transport import RegionDescriptor

_RECEIVER = """
import ctypes, sys, time
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
pad = ctypes.create_string_buffer(int(sys.argv[1]) * 4096 + 1)  # vary the buffer's address
buf = ctypes.create_string_buffer(1 << 16)
assert engine.register_memory(ctypes.addressof(buf), 1 << 16) == 0
print(engine.get_rpc_port(), ctypes.addressof(buf), flush=True)
for line in sys.stdin:
    print(sum(buf.raw[:4096]), flush=True)
"""


def start_receiver(i: int, env: dict[str, str]) -> tuple[subprocess.Popen[str], int, int]:
    """Receiver `i` (a process with one registered 64 KiB buffer): (process, RPC port, buffer
    address). Waits for a free port when the range is full (a closed port stays in TIME_WAIT for
    a minute). Write a line to its stdin to read back the sum of the buffer's first 4 KiB."""
    for _attempt in range(120):
        proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(i % 7)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        line = proc.stdout.readline().split()
        if line:
            return proc, int(line[0]), int(line[1])
        proc.wait()
        time.sleep(1.0)
    raise SystemExit("no receiver could start: the port range stayed full for two minutes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, default=150)
    parser.add_argument("--ports", default="", metavar="LO:HI",
                        help="the receivers' RPC port range (MC_MIN/MAX_RPC_PORT; a narrow one makes reuse "
                             "come sooner; each receiver takes two ports from it)")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.ports:
        lo, hi = args.ports.split(":")
        env.update(MC_MIN_RPC_PORT=lo, MC_MAX_RPC_PORT=hi)
    sender = MooncakeEndpoint("127.0.0.1", "tcp")
    print(f"MC_DISABLE_METACACHE={os.environ.get('MC_DISABLE_METACACHE')}", flush=True)
    src = np.full(1 << 16, 1, dtype=np.uint8)
    sender.register(src)
    # Count the engine calls that fail: the sender sends a failed batch once more, which hides
    # a first failure from the write's outcome.
    failed_calls: list[str] = []
    engine_call = sender._transfer

    def counted(session: str, *batch: list[int]) -> int:
        rc = engine_call(session, *batch)
        if rc != 0:
            failed_calls.append(session)
        return rc

    sender._transfer = counted  # type: ignore[method-assign,assignment]
    seen: set[int] = set()
    reused = reused_ok = fresh_failed = retries = 0
    t0 = time.monotonic()
    for i in range(args.receivers):
        proc, port, addr = start_receiver(i, env)
        assert proc.stdin is not None and proc.stdout is not None
        region = RegionDescriptor(0, "mooncake", f"127.0.0.1:{port}", addr, 1 << 16)
        (out,) = sender.write(src, [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))], {0: region}, f"t{i}", 10.0)
        landed = 0
        for _ in range(50):  # TCP may report completion just before the bytes land
            proc.stdin.write("\n")
            proc.stdin.flush()
            landed = int(proc.stdout.readline())
            if landed == 4096 or out.status != "OK":
                break
            time.sleep(0.02)
        proc.stdin.close()
        proc.wait(10)
        ok = out.status == "OK" and landed == 4096
        retried = failed_calls.count(region.endpoint)
        failed_calls.clear()
        if port in seen:
            reused += 1
            reused_ok += ok
        elif not ok:
            fresh_failed += 1
        retries += retried
        if port in seen or not ok or retried:
            tag = "REUSED" if port in seen else "fresh"
            print(f"receiver {i}: port {port} {tag}: {out.status} landed={landed == 4096}, "
                  f"{retried} failed engine calls {out.message[:90]}", flush=True)
        seen.add(port)
    print(f"{args.receivers} receivers in {time.monotonic() - t0:.0f}s: {reused} reused a port, "
          f"{reused_ok} of them written; {fresh_failed} fresh ones failed; {retries} engine calls failed "
          f"(each sent once more); {sender.engine_replacements} engine replacements", flush=True)
    sender.close()
    return 0 if reused_ok == reused and fresh_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
