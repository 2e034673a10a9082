"""Time to SERVING of `kvrelay up` and the AR/DiT service processes' resident memory then, for this
checkout and a baseline checkout's, side by side.

Each run starts `python -m kvrelay up` (no arguments: configs/single-node.yaml, the demo model;
or `--config FILE`) in a fresh working folder with the tree's code on PYTHONPATH, times it from
the start to its `try:` line (every process SERVING and checked), reads the RSS of ar-0 and dit-0
(the services, not their ranks), then stops it with SIGINT and waits for it to exit. The default
config binds fixed ports (50051, ...): nothing else may hold them.

    git archive <commit> | tar -x -C /tmp/kv-base     # the code before the change
    .venv/bin/python benchmarks/start_time.py --baseline /tmp/kv-base --runs 3

Without `--baseline` only this checkout is measured. Runs alternate baseline / this, so both see
the same neighbours.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("ar-0", "dit-0")


def start_once(
    tree: Path, config: str | None, metrics_port: int | None = None
) -> tuple[float, dict[str, int]]:
    """(seconds to the `try:` line, {service: RSS MiB}) of one `kvrelay up` of `tree`'s code."""
    cwd = tempfile.mkdtemp(prefix="kvrelay-start-")
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "kvrelay", "up", *(["--config", config] if config else [])]
    argv += ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    started = time.monotonic()
    up = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert up.stdout is not None
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("try:"):
                break
        else:
            raise RuntimeError(f"kvrelay up of {tree} exited {up.wait()} before SERVING:\n{''.join(lines)}")
        seconds = time.monotonic() - started
        rss = {}
        for line in lines:
            row = re.match(r"^(\S+)\s+(\d+)\s", line)
            if row and row.group(1) in SERVICES:
                rss[row.group(1)] = psutil.Process(int(row.group(2))).memory_info().rss >> 20
        return seconds, rss
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="a checkout (git archive) to measure beside this one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", help="the config `kvrelay up` gets (default: none, its own default)")
    parser.add_argument("--metrics-port", type=int, help="`kvrelay up --metrics-port` (0: a free one)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between runs (ports, shm freed)")
    args = parser.parse_args()
    trees = {"baseline": args.baseline, "this": REPO} if args.baseline else {"this": REPO}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for run in range(1, args.runs + 1):
        for name, tree in trees.items():
            seconds, rss = start_once(tree, args.config, args.metrics_port)
            times[name].append(seconds)
            load = os.getloadavg()[0]
            print(
                f"run {run} {name}: SERVING in {seconds:.1f} s, service RSS MiB {rss}, load {load:.1f}",
                flush=True,
            )
            time.sleep(args.pause)
    for name, values in times.items():
        print(f"{name}: {' '.join(f'{v:.1f}' for v in values)} s, median {statistics.median(values):.1f} s")


if __name__ == "__main__":
    main()
