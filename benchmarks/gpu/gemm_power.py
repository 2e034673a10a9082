"""Is the bf16 DiT step bound by its GEMMs' energy? On one GPU, back to back for a few seconds
each, side by side in one process (two rounds, so drift shows):

1. the graph-captured DiT step (bagel-7b-shape, 512x512, 2 CFG rows, prefixes 81+16);
2. only its GEMMs: per layer qkv, o, gate_up and down at the step's shapes (2 x 1,024 tokens), over
   the model's own weights, fused as the step runs them, 28 layers (inputs: standard normal);
3. the same GEMMs over standard-normal weights (does the data change the power?);
4. a bf16 8192^3 matmul (what profile_steps.py's floor is measured with), run last in each round,
   and the same over inputs of torch's default generator, run first.

Each line gives the ms per call, the TFLOP/s, and the SM clock and power draw nvidia-smi reports
right after the block. Run on the GPU machine:

    python3 benchmarks/gpu/gemm_power.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrelay.models.dit import DitRunner, random_prefix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_steps import dit_flops  # noqa: E402 - a sibling script, not a package
from sustained_dit import smi  # noqa: E402


def run_for(fn: Callable[[], object], per_block: int, seconds: float) -> tuple[float, str]:
    """ms per call (median of the second half of the blocks) and nvidia-smi after the last block."""
    end_at = time.perf_counter() + seconds
    times: list[float] = []
    while time.perf_counter() < end_at or len(times) < 2:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_block):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / per_block)
    return statistics.median(times[len(times) // 2 :]), smi()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bagel-7b-shape")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    runner = DitRunner(args.preset, device="cuda")
    kv_dtype = getattr(torch, runner.preset.dtype)
    rows = [random_prefix(runner.preset, n, seed=i, dtype=kv_dtype, device="cuda") for i, n in enumerate((81, 16))]
    step = runner.stepper(rows, 64, 64)
    lat = torch.randn(2, 16, 64, 64, device="cuda", dtype=runner.dtype)
    tokens = 2 * runner.preset.dit.num_image_tokens(512, 512)

    weights: list[list[torch.Tensor]] = []
    for block in runner.model.blocks:
        at, mlp = block.attn, block.mlp
        weights.append([
            torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
            at.o_proj.weight,
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            mlp.down_proj.weight,
        ])
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], device="cuda", dtype=runner.dtype, generator=g)
              for w in weights[0]}
    normal = [[torch.randn(w.shape, device="cuda", dtype=runner.dtype, generator=g) for w in layer]
              for layer in weights[:2]] * (len(weights) // 2)
    gemm_flops = sum(2 * tokens * w.shape[0] * w.shape[1] for layer in weights for w in layer)

    def gemms(ws: list[list[torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            for layer in ws:
                for w in layer:
                    F.linear(inputs[w.shape[1]], w)
        return run

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    # The same matmul over inputs of the default generator, and run first in each round: the H200
    # gave 666 TFLOP/s at ~690 W for the matmul here (after the step and its GEMMs) and 784 at
    # ~550 W in sustained_dit.py (default generator, after a DiT step), minutes apart.
    c = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    step_flops = dit_flops(args.preset, 512, 512, 2, 81)
    cases: list[tuple[str, Callable[[], object], int, float]] = [
        ("bf16 8192^3 matmul, default generator, first", lambda: c @ d, 40, 2.0 * n**3),
        ("DiT step (graph)", lambda: step(lat, 0.5), 20, step_flops),
        ("its GEMMs only, model weights", gemms(weights), 20, gemm_flops),
        ("its GEMMs only, N(0,1) weights", gemms(normal), 20, gemm_flops),
        ("bf16 8192^3 matmul", lambda: a @ b, 40, 2.0 * n**3),
    ]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; idle: {smi()}", flush=True)
    print(f"step {step_flops / 1e12:.2f} TFLOP, its GEMMs {gemm_flops / 1e12:.2f} TFLOP", flush=True)
    for _ in range(3):  # warm-up: kernels chosen, clocks and temperature settled a little
        for _, fn, _, _ in cases:
            fn()
    torch.cuda.synchronize()
    results: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for round_ in range(2):
        for name, fn, per_block, flops in cases:
            ms, state = run_for(fn, per_block, args.seconds)
            results[name].append(ms)
            print(f"round {round_}: {name}: {ms:.3f} ms, {flops / (ms / 1e3) / 1e12:.0f} TFLOP/s; "
                  f"(SM clock, power, temp) {state}", flush=True)
    step_ms = statistics.mean(results["DiT step (graph)"])
    gemm_ms = statistics.mean(results["its GEMMs only, model weights"])
    mm_ms = statistics.mean(results["bf16 8192^3 matmul"])
    floor_ms = step_flops / (2.0 * n**3 / mm_ms)  # ms: the step's FLOPs at the sustained matmul rate
    print(f"step / its GEMMs alone = {step_ms / gemm_ms:.3f}x; step / floor at the sustained matmul rate = "
          f"{step_ms / floor_ms:.3f}x (floor {floor_ms:.2f} ms); GEMMs alone / that floor = "
          f"{gemm_ms / floor_ms * step_flops / gemm_flops:.3f}x of their own FLOPs' floor", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
