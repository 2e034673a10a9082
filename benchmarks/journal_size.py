"""Journal size for N finished generations (a PNG of B bytes each, default 80 KB), all past
retention: after they are written, after the first access expires them, after one compaction pass.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/journal_size.py 700 [80000]

Run in a checkout without broker/compaction.py (e.g. `git archive 9ce9ff3`) for the before figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from kvrelay.broker.generations import GenerationParams, GenerationStore, GenState, ImageResult
from kvrelay.broker.journal import Journal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="finished generations to write")
    parser.add_argument("png_bytes", type=int, nargs="?", default=80_000, help="PNG bytes each (default: %(default)s)")
    args = parser.parse_args()
    n, png = args.n, args.png_bytes
    path = os.path.join(tempfile.mkdtemp(), "broker.sqlite")
    mono, wall = [0.0], [1e6]
    journal = Journal(path, "FULL")
    store = GenerationStore(result_ttl_seconds=300, max_results=100_000, clock=lambda: mono[0],
                            wall_clock=lambda: wall[0], journal=journal)  # fmt: skip
    for i in range(n):
        record, _ = store.create_or_attach(f"r{i}", GenerationParams("p", "", i, 512, 512, 1, 1.0), True)
        store.update(record, GenState.SUCCEEDED, image=ImageResult(os.urandom(png), 512, 512, i))
        store.persist(record)

    def size() -> float:
        return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p)) / 1e6

    print(f"{n} generations written: {size():.1f} MB (file+WAL)")
    mono[0] += 301
    wall[0] += 301
    started = time.perf_counter()
    store.expire()
    print(f"expired (one access): {size():.1f} MB, {1000 * (time.perf_counter() - started):.1f} ms")
    try:
        from kvrelay.broker.compaction import JournalCompactor
    except ImportError:
        print("no compactor in this tree")
        return
    result = asyncio.run(JournalCompactor(journal, store).compact_once())
    print(f"after one compaction pass: {size():.3f} MB; {result}")


if __name__ == "__main__":
    main()
