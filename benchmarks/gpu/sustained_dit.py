"""What one request costs the DiT on a GPU when nothing else runs, and whether the step holds its
speed under sustained load (clocks, power). Usage on the GPU machine:

    python3 benchmarks/gpu/sustained_dit.py [--seconds 20] [--requests 30]

Prints (1) a whole 2-step, guidance-2 denoise of a seed-shaped request as a DiT rank runs it
(prefix copy into the step buffers, noise, 2 graph replays, decode to host pixels), with the
prefix copy timed on its own; (2) graph-replayed steps back to back for ``--seconds``, per block
of 50 steps with the SM clock and power draw that nvidia-smi reports right after the block.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from kvrelay.models.dit import DitRunner, random_prefix


def smi() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
        return out.stdout.strip()
    except OSError as err:
        return f"nvidia-smi: {err}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bagel-7b-shape")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()

    runner = DitRunner(args.preset, device="cuda")
    runner.warm_up()
    kv_dtype = getattr(torch, runner.preset.dtype)
    rows = [random_prefix(runner.preset, n, seed=i, dtype=kv_dtype, device="cuda") for i, n in enumerate((81, 16))]

    def request(seed: int) -> None:
        latents = runner.denoise(rows, width=512, height=512, steps=2, guidance_scale=2.0, seed=seed)
        runner.decode(latents).cpu()

    for seed in range(3):
        request(seed)
    torch.cuda.synchronize()
    walls = []
    for seed in range(args.requests):
        t0 = time.perf_counter()
        request(seed)
        walls.append((time.perf_counter() - t0) * 1e3)
    prep = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.stepper(rows, 64, 64)
        torch.cuda.synchronize()
        prep.append((time.perf_counter() - t0) * 1e3)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {smi()}")
    print(f"whole request (2 steps, guidance 2, prefixes 81+16, decode to host), back to back: "
          f"median {statistics.median(walls):.2f} ms, min {min(walls):.2f}, max {max(walls):.2f} "
          f"over {args.requests} -> {1e3 / statistics.median(walls):.2f} req/s of DiT alone")
    print(f"prefix copy into the step buffers (stepper): median {statistics.median(prep):.2f} ms")

    step = runner.stepper(rows, 64, 64)
    lat = torch.randn(2, 16, 64, 64, device="cuda", dtype=runner.dtype)
    end_at = time.perf_counter() + args.seconds
    block = 0
    while time.perf_counter() < end_at:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            step(lat, 0.5)
        end.record()
        torch.cuda.synchronize()
        print(f"block {block}: {start.elapsed_time(end) / 50:.2f} ms/step; {smi()}")
        block += 1
    print("done")


if __name__ == "__main__":
    main()
