"""Profile the model steps on one GPU: the DiT denoising step and the AR prefill (bagel-7b-shape).

Prints, per model, the step time (CUDA events, median), the host time of one step (how long Python
takes to issue it: a step whose host time is close to its device time is launch-bound), the
compute floor (the step's matmul FLOPs at the measured bf16 matmul rate) and the torch.profiler
table of the kernels that take the device time. The DiT runs unquantized and with FP8 linears
(``--dit-quantizations``), timed shape by shape side by side. Run on the GPU machine:

    python3 benchmarks/gpu/profile_steps.py --out $OUT

Writes ``profile.txt`` and ``profile.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvrelay.models.ar import build_ar_model
from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.models.presets import get_preset


def _gemm_tflops(mm: Any, n: int, reps: int) -> float:
    """TFLOP/s of ``mm()``, an n^3 GEMM, over ``reps`` back-to-back calls after 3 warm-ups."""
    for _ in range(3):
        mm()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        mm()
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return _gemm_tflops(lambda: a @ b, n, reps)


def fp8_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """The rate of the FP8 GEMM the quantized DiT runs (e4m3, per-row scales, bf16 out)."""
    from kvrelay.models.fp8 import quantize_rows

    a, sa = quantize_rows(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    b, sb = quantize_rows(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    sa = sa.reshape(n, 1).contiguous()
    return _gemm_tflops(
        lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), n, reps
    )


def timed(fn: Any, reps: int) -> tuple[float, float]:
    """(median device ms, median host ms to issue) over ``reps`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        dev.append(start.elapsed_time(end))
    return statistics.median(dev), statistics.median(host)


def kernel_table(fn: Any, rows: int = 25) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table: str = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60
    )
    return table


def dit_flops(preset: str, width: int, height: int, rows: int, prefix: int) -> float:
    p = get_preset(preset)
    c = p.dit
    n = c.num_image_tokens(width, height)
    h, hq, hkv, d, mlp = c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp
    per_token = 2 * h * (hq * d + 2 * hkv * d) + 2 * hq * d * h + 3 * 2 * h * mlp
    attn = 2 * 2 * hq * n * (prefix + n) * d
    return float(c.num_layers * rows * (n * per_token + attn))


def ar_flops(preset: str, tokens: int) -> float:
    c = get_preset(preset).ar
    h, hq, hkv, d, mlp = c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp
    per_token = 2 * h * (hq * d + 2 * hkv * d) + 2 * hq * d * h + 3 * 2 * h * mlp
    return float(c.num_layers * tokens * per_token)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bagel-7b-shape")
    parser.add_argument("--out", default="/tmp/profile")
    parser.add_argument("--prefix-tokens", type=int, default=96)
    parser.add_argument("--ar-tokens", type=int, nargs="+", default=[96, 192, 1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--dit-quantizations", default="none,fp8", help="comma list of none|fp8, timed side by side")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    result: dict[str, Any] = {}

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)
        (out / "profile.txt").write_text("\n".join(lines) + "\n")
        (out / "profile.json").write_text(json.dumps(result, indent=2))

    torch.manual_seed(0)
    rate = matmul_tflops()
    result["matmul_tflops"] = rate
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}: bf16 8192^3 matmul {rate:.0f} TFLOP/s")

    if "ar" not in args.skip:
        model = build_ar_model(preset=args.preset, device="cuda")
        result["ar"] = {}
        weight_ms = sum(p.numel() * p.element_size() for p in model.parameters()) / 4.3e12 * 1e3
        for lengths in [(96, 16), (96, 96), (1024,), (96, 16) * 4]:
            prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
            floor_ms = max(ar_flops(args.preset, sum(lengths)) / (rate * 1e12) * 1e3, weight_ms)
            row: dict[str, Any] = {"floor_ms": floor_ms}
            for graphs in (False, True):
                model.cuda_graphs = graphs
                dev_ms, host_ms = timed(lambda prompts=prompts: model.prefill_batch(prompts), args.reps)
                row["graph" if graphs else "eager"] = {"ms": dev_ms, "host_ms": host_ms}
                say(
                    f"AR prefill_batch {list(lengths)} tokens, {'graph' if graphs else 'eager'}: {dev_ms:.2f} ms "
                    f"device, {host_ms:.2f} ms host; floor {floor_ms:.2f} ms (max of FLOPs, weight read at "
                    f"4.3 TB/s) -> {dev_ms / floor_ms:.2f}x floor"
                )
            result["ar"][str(list(lengths))] = row
        model.cuda_graphs = False
        ids = [torch.randint(1, 256, (96,), generator=torch.Generator().manual_seed(0))] * 2
        say(kernel_table(lambda: model.prefill_batch(ids), rows=20))
        del model
        torch.cuda.empty_cache()

    if "dit" not in args.skip:
        # Unquantized and FP8 (kvrelay.models.fp8) side by side: each shape is timed for every
        # quantization in turn, so both see the same clocks; ratios are printed per shape.
        quantizations: list[str | None] = [None if q == "none" else q for q in args.dit_quantizations.split(",")]
        runners = {q: DitRunner(args.preset, device="cuda", quantization=q) for q in quantizations}
        runner = runners[quantizations[0]]
        kv_dtype = getattr(torch, runner.preset.dtype)
        if "fp8" in runners:
            fp8_rate = fp8_matmul_tflops()
            result["fp8_matmul_tflops"] = fp8_rate
            say(f"fp8 e4m3 8192^3 _scaled_mm (per-row scales) {fp8_rate:.0f} TFLOP/s")

        def prefixes(lengths: tuple[int, ...]) -> list[Any]:
            return [
                random_prefix(runner.preset, n, seed=i, dtype=kv_dtype, device="cuda") for i, n in enumerate(lengths)
            ]

        result["dit"] = {}
        for lengths in [(args.prefix_tokens,) * 2, (81, 16), (81, 16) * 4]:
            rows = prefixes(lengths)
            lat = torch.randn(len(rows), 16, 64, 64, device="cuda", dtype=runner.dtype)
            t = 0.5  # the step's flow time (a host float; its conditioning is cached by the runner)
            floor_ms = dit_flops(args.preset, 512, 512, len(rows), max(lengths)) / (rate * 1e12) * 1e3
            row = {"floor_ms": floor_ms}
            for q, each in runners.items():
                name = q or "unquantized"
                for graphs in (False, True):
                    each.use_graphs = graphs
                    step = each.stepper(rows, 64, 64)
                    dev_ms, host_ms = timed(lambda step=step, lat=lat, t=t: step(lat, t), args.reps)
                    row[f"{name}-{'graph' if graphs else 'eager'}"] = {"ms": dev_ms, "host_ms": host_ms}
                    say(
                        f"DiT step 512x512, prefixes {list(lengths)}, {name}, {'graph' if graphs else 'eager'}: "
                        f"{dev_ms:.2f} ms device, {host_ms:.2f} ms host; bf16 floor {floor_ms:.2f} ms -> "
                        f"{dev_ms / floor_ms:.2f}x floor"
                    )
            if "fp8" in runners and None in runners:
                ratio = row["fp8-graph"]["ms"] / row["unquantized-graph"]["ms"]
                say(f"DiT step prefixes {list(lengths)}: fp8 / unquantized (graph) = {ratio:.3f}")
            result["dit"][str(list(lengths))] = row
        for q, each in runners.items():
            each.use_graphs = False
            rows = prefixes((81, 16))
            step = each.stepper(rows, 64, 64)
            lat = torch.randn(2, 16, 64, 64, device="cuda", dtype=each.dtype)
            t = 0.5
            say(f"kernels of the (81, 16) step, {q or 'unquantized'}, eager:")
            say(kernel_table(lambda step=step, lat=lat, t=t: step(lat, t)))
        runner.use_graphs = False
        step = runner.stepper(prefixes((81, 16)), 64, 64)

        latents = torch.randn(16, 64, 64, device="cuda", dtype=runner.dtype)
        dec_ms, dec_host = timed(lambda: runner.decode(latents), args.reps)
        result["decode_ms"] = dec_ms
        say(f"decode 512x512 (incl. copy to host): {dec_ms:.2f} ms device, {dec_host:.2f} ms host")

        if "compile" not in args.skip:
            # Experiment: the same blocks through torch.compile (inductor fuses the elementwise work).
            try:
                t0 = time.perf_counter()
                for i, block in enumerate(runner.model.blocks):
                    runner.model.blocks[i] = torch.compile(block, dynamic=False)
                step(lat, t)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                dev_ms, host_ms = timed(lambda: step(lat, t), args.reps)
                result["dit_compiled"] = {"step_ms": dev_ms, "host_ms": host_ms, "compile_s": compile_s}
                say(f"DiT step (81, 16), blocks torch.compile'd, eager: {dev_ms:.2f} ms device, {host_ms:.2f} ms "
                    f"host (compile {compile_s:.1f} s)")
                say(kernel_table(lambda: step(lat, t), rows=15))
            except Exception as err:  # noqa: BLE001 - an experiment; report and go on
                say(f"torch.compile experiment failed: {err!r}"[:2000])

    say("done")


if __name__ == "__main__":
    main()
