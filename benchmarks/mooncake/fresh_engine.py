"""Does a fresh TransferEngine write where a long-lived one fails (a receiver on a reused port)?

The evidence for the fix of docs/transfer.md's reused-port failure (`MooncakeEndpoint` now writes
through a fresh engine, `_replace_sender`): a long-lived sender engine cannot write to a receiver
that took a port an earlier receiver had. This starts receivers one after another in a 12-port
range (so ports come round), writes 4 KiB into each from one long-lived bare engine, and when that
fails, from a fresh engine created in the same process, which then becomes the long-lived one (the
old one is kept alive, not closed). Prints one line per reused port and the counts. Ports come
round only after TIME_WAIT (a minute), so 40 receivers take ~5 minutes. In so narrow a range a
receiver that reuses an RPC port mostly gets the old data port back too, which the long-lived
engine still holds for that name: that is why it writes most of them (docs/transfer.md, "Why").

    python benchmarks/mooncake/fresh_engine.py --receivers 40
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_DISABLE_METACACHE", "1")

from mooncake.engine import TransferEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from port_reuse import start_receiver  # noqa: E402


def _engine() -> tuple[Any, Any]:
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(1 << 16)
    ctypes.memset(buf, 1, 1 << 16)
    assert engine.register_memory(ctypes.addressof(buf), 1 << 16) == 0
    return engine, buf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, default=40)
    parser.add_argument("--ports", default="25000:25011", metavar="LO:HI")
    args = parser.parse_args()
    lo, hi = args.ports.split(":")
    env = dict(os.environ, MC_MIN_RPC_PORT=lo, MC_MAX_RPC_PORT=hi)
    kept: list[tuple[Any, Any]] = []  # engines replaced, kept alive
    sender, src = _engine()
    seen: set[int] = set()
    reused = old_ok = fresh_ok = 0
    for i in range(args.receivers):
        proc, port, addr = start_receiver(i, env)
        assert proc.stdin is not None
        session = f"127.0.0.1:{port}"
        rc = sender.batch_transfer_sync_write(session, [ctypes.addressof(src)], [addr], [4096])
        if port in seen:
            reused += 1
            old_ok += rc == 0
            fresh_rc = None
            if rc != 0:
                kept.append((sender, src))
                sender, src = _engine()
                fresh_rc = sender.batch_transfer_sync_write(session, [ctypes.addressof(src)], [addr], [4096])
                fresh_ok += fresh_rc == 0
            print(f"receiver {i}: port {port} reused: long-lived engine rc={rc}, fresh engine rc={fresh_rc}",
                  flush=True)
        seen.add(port)
        proc.stdin.close()
        proc.wait(10)
    failed = reused - old_ok
    print(f"{args.receivers} receivers: {reused} reused a port; the long-lived engine wrote {old_ok}; "
          f"a fresh engine wrote {fresh_ok} of the {failed} it failed", flush=True)
    return 0 if fresh_ok == failed else 1


if __name__ == "__main__":
    sys.exit(main())
