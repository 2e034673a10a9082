"""What the per-block abort checks cost a CPU denoise that is never cancelled (TP=1).

A DiT on the CPU checks, before every transformer block and between attention query chunks,
whether every request of its step is cancelled (docs/dit_service.md, "Cancel mid-denoise"). This
times the same denoise (the `small` preset by default, 512x512, 2 steps, guidance 2: the CPU
seed workload's shape) without the check and with a check that never fires, alternating, and
prints the medians and their ratio; the latents must be bit-equal.

    .venv/bin/python benchmarks/abort_check_cost.py [--preset small] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.models.dit import DitRunner, random_prefix  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    runner = DitRunner(args.preset, device="cpu")
    rows = [random_prefix(runner.preset, n, seed=i, dtype=runner.dtype) for i, n in enumerate((81, 16))]
    checks = [0]

    def never() -> bool:
        checks[0] += 1
        return False

    def run(abort: object) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        out = runner.denoise(rows, width=args.size, height=args.size, steps=args.steps, guidance_scale=2.0,
                             seed=0, abort=abort)  # type: ignore[arg-type]
        return time.perf_counter() - t0, out

    _, ref = run(None)  # warm-up
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.rounds):
        for name, abort in (("without", None), ("with", never)):
            dt, out = run(abort)
            if not torch.equal(out, ref):
                raise SystemExit(f"{name} the check: latents differ")
            times[name].append(dt)
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    print(f"{args.preset} {args.size}x{args.size}, {args.steps} steps, guidance 2, torch threads "
          f"{torch.get_num_threads()}, {args.rounds} rounds alternating; latents bit-equal")
    print(f"denoise without the abort check: median {without * 1e3:.1f} ms "
          f"(min {min(times['without']) * 1e3:.1f}, max {max(times['without']) * 1e3:.1f})")
    print(f"denoise with a check that never fires ({checks[0] // args.rounds} checks per denoise): median "
          f"{with_ * 1e3:.1f} ms (min {min(times['with']) * 1e3:.1f}, max {max(times['with']) * 1e3:.1f})")
    print(f"with / without = {with_ / without:.3f}x")


if __name__ == "__main__":
    main()
