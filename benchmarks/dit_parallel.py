"""DiT step time of parallel layouts side by side, in one run: expert parallel on/off and
CFG-parallel on/off for a (MoE) preset, each layout in its own rank processes.

``python benchmarks/dit_parallel.py --preset tiny-moe --tp 2`` times, interleaved
round by round (so machine drift hits all alike): TP=tp with EP off, TP=tp with EP on, and
CFG=2 x TP=tp/2 (CFG-parallel on the same number of ranks); prints each layout's median seconds
per denoising step (the slowest rank's, as steps end together) and its ratio to EP off.
Numbers in docs/models.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrelay.models.dit import DitRunner, random_prefix, shard_prefix  # noqa: E402
from kvrelay.worker import RankContext, WorkerGroup  # noqa: E402


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    tp: int
    expert_parallel: bool = False
    cfg_parallel: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cfg_parallel


@dataclass(frozen=True, slots=True)
class _TimeSteps:
    width: int
    height: int
    steps: int
    prefix_tokens: int


@dataclass(frozen=True, slots=True)
class _BenchFactory:
    preset: str
    layout: Layout

    def __call__(self, ctx: RankContext) -> _BenchRank:
        return _BenchRank(ctx, self)


class _BenchRank:
    def __init__(self, ctx: RankContext, spec: _BenchFactory) -> None:
        self.runner = DitRunner(
            spec.preset, rank=ctx.rank, world=ctx.world_size, tp=spec.layout.tp, weight_seed=0,
            device=ctx.device, expert_parallel=spec.layout.expert_parallel, cfg_parallel=spec.layout.cfg_parallel,
        )

    def handle(self, command: _TimeSteps) -> list[float]:
        par = self.runner.parallel
        full = [random_prefix(self.runner.preset, command.prefix_tokens, seed=r) for r in range(2)]
        if par.cfg.world_size > 1:
            full = [full[par.cfg.rank]]
        rows = [shard_prefix(row, par.world, par.rank) for row in full]
        marks: list[float] = []
        start = time.perf_counter()
        self.runner.denoise(
            rows, width=command.width, height=command.height, steps=command.steps, guidance_scale=2.0, seed=0,
            on_step=lambda _s, _t: marks.append(time.perf_counter()),
        )
        return [b - a for a, b in zip([start, *marks], marks, strict=False)]


def measure(
    preset: str, layouts: Sequence[Layout], *, width: int, height: int, steps: int, prefix_tokens: int, rounds: int
) -> list[dict[str, object]]:
    groups = [WorkerGroup(lay.world, _BenchFactory(preset, lay)) for lay in layouts]
    per_layout: list[list[float]] = [[] for _ in layouts]
    command = _TimeSteps(width, height, steps, prefix_tokens)
    try:
        for group in groups:
            group.start()
        for round_idx in range(rounds + 1):  # round 0 warms up
            for i, group in enumerate(groups):
                per_rank = group.call_all(command, timeout_s=600)
                if round_idx:
                    per_layout[i] += [max(ts) for ts in zip(*per_rank, strict=True)]
    finally:
        for group in groups:
            group.stop()
    base = statistics.median(per_layout[0])
    return [
        {
            "layout": lay.name, "ranks": lay.world, "step_s_median": round(statistics.median(times), 4),
            "ratio_to_first": round(statistics.median(times) / base, 3),
        }
        for lay, times in zip(layouts, per_layout, strict=True)
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DiT step time: EP on/off and CFG-parallel on/off, side by side.")
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    layouts = [
        Layout(f"TP={args.tp}, EP off", args.tp),
        Layout(f"TP={args.tp}, EP on", args.tp, expert_parallel=True),
        Layout(f"CFG=2 x TP={args.tp // 2}", max(1, args.tp // 2), cfg_parallel=2),
    ]
    results = measure(
        args.preset, layouts, width=args.width, height=args.height, steps=args.steps,
        prefix_tokens=args.prefix_tokens, rounds=args.rounds,
    )
    for r in results:
        print(json.dumps({"preset": args.preset, "threads": torch.get_num_threads(), **r}))


if __name__ == "__main__":
    # The canonically imported module's main, so the factory pickles by its real name
    # (benchmarks.dit_parallel._BenchFactory), not as __main__._BenchFactory.
    from benchmarks.dit_parallel import main as _main

    _main()
