"""Seconds per denoising step of the built-in DiT (kvrelay/models/dit.py) in one process (TP=1,
SP=1), plus model build and decode time. Numbers in docs/dit.md.

    .venv/bin/python benchmarks/dit_step.py --preset small --width 512 --height 512 --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrelay.models.dit import DitRunner, random_prefix  # noqa: E402
from kvrelay.models.sampler import cfg_rows  # noqa: E402


def measure(
    preset: str,
    *,
    width: int,
    height: int,
    steps: int,
    guidance_scale: float,
    prefix_tokens: int,
    device: str,
    repeats: int,
) -> dict[str, Any]:
    """Seconds per denoising step (median over ``repeats`` timed runs after one warm-up), model
    build and decode time for one process (TP=1, SP=1)."""
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    start = time.perf_counter()
    runner = DitRunner(preset, weight_seed=0, device=dev)
    sync()
    build_s = time.perf_counter() - start
    kv_dtype = getattr(torch, runner.preset.dtype)
    rows = [
        random_prefix(runner.preset, prefix_tokens, seed=r, dtype=kv_dtype, device=dev)
        for r in range(cfg_rows(guidance_scale))
    ]
    step_s: list[float] = []
    decode_s: list[float] = []
    for run in range(repeats + 1):
        marks: list[float] = []

        def on_step(_step: int, _total: int, marks: list[float] = marks) -> None:
            sync()
            marks.append(time.perf_counter())

        sync()
        t0 = time.perf_counter()
        latents = runner.denoise(
            rows,
            width=width,
            height=height,
            steps=steps,
            guidance_scale=guidance_scale,
            seed=run,
            on_step=on_step,
        )
        t1 = time.perf_counter()
        image = runner.decode(latents)
        t2 = time.perf_counter()
        if run:  # run 0 warms up kernels and allocators
            step_s += [b - a for a, b in zip([t0, *marks], marks, strict=False)]
            decode_s.append(t2 - t1)
    return {
        "preset": preset,
        "device": str(dev),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "width": width,
        "height": height,
        "image_tokens": runner.cfg.num_image_tokens(width, height),
        "cfg_rows": len(rows),
        "prefix_tokens": prefix_tokens,
        "steps": steps,
        "build_s": round(build_s, 3),
        "step_s_median": round(statistics.median(step_s), 4),
        "step_s_min": round(min(step_s), 4),
        "decode_s_median": round(statistics.median(decode_s), 4),
        "image_shape": list(image.shape),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the built-in DiT's seconds per denoising step.")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--guidance-scale", type=float, default=2.0)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        json.dumps(
            measure(
                args.preset,
                width=args.width,
                height=args.height,
                steps=args.steps,
                guidance_scale=args.guidance_scale,
                prefix_tokens=args.prefix_tokens,
                device=args.device,
                repeats=args.repeats,
            )
        )
    )


if __name__ == "__main__":
    main()
