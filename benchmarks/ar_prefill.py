"""AR prefill throughput of the built-in AR model (kvrelay/models/ar.py) on rank processes.

Builds the model on each of `--tp` rank processes (the service's worker harness, without the
service) and times prefills there, so the numbers exclude the command channel. Numbers in
docs/models.md.

    .venv/bin/python benchmarks/ar_prefill.py --preset small --tokens 64 256 1024 --tp 1
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrelay.models.ar import build_ar_model  # noqa: E402
from kvrelay.worker import RankContext, WorkerGroup  # noqa: E402


@dataclass(frozen=True, slots=True)
class _TimePrefill:
    tokens: int
    repeat: int


class _BenchRank:
    """Rank handler of the benchmark: builds the model on its rank and times prefills there, so
    the numbers exclude the command channel."""

    def __init__(self, ctx: RankContext, preset: str, seed: int, dtype: str | None):
        self.model = build_ar_model(preset=preset, seed=seed, tp=ctx.tp, device=ctx.device, dtype=dtype)
        self.device = torch.device(ctx.device)

    def handle(self, command: _TimePrefill) -> list[float]:
        ids = torch.randint(0, 256, (command.tokens,), generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(command.repeat + 1):  # the first run warms up kernels and allocators
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.model.prefill(ids)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i:
                times.append(time.perf_counter() - start)
        return times


def bench_prefill(
    preset: str,
    tokens: int,
    *,
    tp: int = 1,
    devices: list[str] | None = None,
    repeat: int = 5,
    seed: int = 0,
    dtype: str | None = None,
) -> dict[str, float]:
    """Median prefill time and tokens/s of one prompt of `tokens` tokens on `tp` rank processes."""
    factory = functools.partial(_BenchRank, preset=preset, seed=seed, dtype=dtype)
    with WorkerGroup(tp, factory, devices=devices) as group:
        per_rank = group.call_all(_TimePrefill(tokens, repeat), timeout_s=600)
    # Ranks finish each prefill together (they all-reduce every layer); take the slowest.
    median = statistics.median(max(times) for times in zip(*per_rank, strict=True))
    return {
        "tokens": tokens,
        "tp": tp,
        "threads_per_rank": group.threads_per_rank,
        "median_s": median,
        "tokens_per_s": tokens / median,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure AR prefill throughput on rank processes.")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--devices", default="cpu", help='"cpu" or comma-separated, e.g. "cuda:0,cuda:1"')
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    devices = [args.devices] * args.tp if "," not in args.devices else args.devices.split(",")
    for tokens in args.tokens:
        result = bench_prefill(
            args.preset, tokens, tp=args.tp, devices=devices, repeat=args.repeat, dtype=args.dtype
        )
        print(json.dumps({"preset": args.preset, "devices": args.devices, **result}))


if __name__ == "__main__":
    # Run the canonically imported module's main, so the rank handler pickles by its real name
    # (benchmarks.ar_prefill._BenchRank), not as __main__._BenchRank.
    from benchmarks.ar_prefill import main as _main

    _main()
