"""What one request costs the DiT on a GPU when nothing else runs, and whether the step holds its
speed under sustained load (clocks, power). Usage on the GPU machine:

    python3 benchmarks/gpu/sustained_dit.py [--seconds 20] [--requests 30] [--quantization fp8]

Prints (1) a whole 2-step, guidance-2 denoise of a seed-shaped request as a DiT rank runs it
(prefix copy into the step buffers, noise, 2 graph replays, decode to host pixels), with the
prefix copy timed on its own; (2) graph-replayed steps back to back for ``--seconds``, per block
of 50 steps with the SM clock and power draw that nvidia-smi reports right after the block;
(3) bf16 8192^3 matmuls back to back for as long, the same way: what the GPU sustains at its
power limit, and the step against the floor at that rate (the burst rate of a short matmul run,
profile_steps.py's floor, is not sustained once the GPU reaches its power limit).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.suggest import SuggestingArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_steps import dit_flops  # noqa: E402 - a sibling script, not a package


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
    parser = SuggestingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bagel-7b-shape")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="fp8: the DiT's big linears as FP8 GEMMs (kvrelay.models.fp8)")
    args = parser.parse_args()

    runner = DitRunner(args.preset, device="cuda", quantization=None if args.quantization == "none" else args.quantization)
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
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, quantization {args.quantization}: {smi()}")
    print(f"whole request (2 steps, guidance 2, prefixes 81+16, decode to host), back to back: "
          f"median {statistics.median(walls):.2f} ms, min {min(walls):.2f}, max {max(walls):.2f} "
          f"over {args.requests} -> {1e3 / statistics.median(walls):.2f} req/s of DiT alone")
    print(f"prefix copy into the step buffers (stepper): median {statistics.median(prep):.2f} ms")

    step = runner.stepper(rows, 64, 64)
    lat = torch.randn(2, 16, 64, 64, device="cuda", dtype=runner.dtype)
    step_ms = sustained("DiT step 512x512, prefixes 81+16", lambda: step(lat, 0.5), 50, args.seconds)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = sustained("bf16 8192^3 matmul", lambda: a @ b, 20, args.seconds)
    rate = 2 * n**3 / (mm_ms / 1e3) / 1e12
    floor_ms = dit_flops(args.preset, 512, 512, 2, 81) / (rate * 1e12) * 1e3
    print(f"sustained matmul {rate:.0f} TFLOP/s -> DiT step floor {floor_ms:.2f} ms at that rate; "
          f"sustained step {step_ms:.2f} ms = {step_ms / floor_ms:.2f}x that floor")
    print("done")


def sustained(name: str, fn: Callable[[], object], per_block: int, seconds: float) -> float:
    """Run ``fn`` back to back for ``seconds`` in blocks of ``per_block`` calls; print each block's
    ms per call with the clocks and power after it; return the median of the second half."""
    end_at = time.perf_counter() + seconds
    times: list[float] = []
    while time.perf_counter() < end_at:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_block):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per_block)
        print(f"{name} block {len(times) - 1}: {times[-1]:.3f} ms; {smi()}")
    return statistics.median(times[len(times) // 2 :])


if __name__ == "__main__":
    main()
