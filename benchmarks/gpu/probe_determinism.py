"""Probe whether a GPU DiT's bits depend on the runner's history or the process: the small DiT
(graphs + torch.compile'd blocks) denoises one request as the first shape a runner sees, after a
batch of another shape, and on a fresh runner, in fresh processes with inductor's caches off
(what a new container gets). Each variant runs in its own process (in parallel); a line per
variant with the output's sha256, then which agree. Run on the GPU machine:

    python3 benchmarks/gpu/probe_determinism.py [--variants default,deterministic] [--repeats 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

ARGS = dict(width=512, height=512, steps=6, guidance_scale=2.0, seed=4)


def digest(t: object) -> str:
    import torch

    assert isinstance(t, torch.Tensor)
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:12]


def one(warm: bool) -> None:
    """In this process: the sequence of tests/dit_model/test_gpu_cancel.py, each output's digest."""
    import torch

    from kvrelay.models.dit import BatchRequest, DitRunner, random_prefix

    def rows(runner: DitRunner, lengths: tuple[int, ...], seed: int) -> list:
        dtype = getattr(torch, runner.preset.dtype)
        return [random_prefix(runner.preset, n, seed=seed + i, dtype=dtype, device="cuda") for i, n in enumerate(lengths)]

    runner = DitRunner("small", weight_seed=0, device="cuda")
    if warm:
        runner.warm_up()
    x = rows(runner, (77, 12), seed=9)
    first = digest(runner.denoise(x, **ARGS))
    a = BatchRequest(rows(runner, (40, 9), seed=1), 2.0, seed=1)
    c = BatchRequest(rows(runner, (100, 30), seed=3), 3.0, seed=3)
    out = runner.denoise_batch([a, c], on_step=lambda s, t, act: {0} if s == 2 and 0 in act else set(),
                               width=512, height=512, steps=5)
    batch = digest(out[1])
    after = digest(runner.denoise(x, **ARGS))
    fresh = DitRunner("small", weight_seed=0, device="cuda")
    if warm:
        fresh.warm_up()
    fresh_out = digest(fresh.denoise(x, **ARGS))
    print(f"first={first} batch={batch} after_batch={after} fresh_runner={fresh_out}", flush=True)


VARIANTS = {
    "default": {},
    "deterministic": {"TORCHINDUCTOR_DETERMINISTIC": "1"},
    "nocompile": {"KVRELAY_COMPILE": "0"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per variant and warm-up choice")
    args = parser.parse_args()
    if args.one:
        one(args.warm)
        return
    procs = []
    for name in args.variants.split(","):
        for warm in (False, True):
            for r in range(args.repeats):
                env = {**os.environ, **VARIANTS[name], "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
                       "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind-")}
                cmd = [sys.executable, __file__, "--one"] + (["--warm"] if warm else [])
                procs.append(((name, warm, r), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                                 stderr=subprocess.PIPE, text=True)))
    seen: dict[tuple[str, bool], list[str]] = defaultdict(list)
    for (name, warm, r), p in procs:
        out, err = p.communicate(timeout=600)
        line = out.strip().splitlines()[-1] if out.strip() else f"rc={p.returncode} {err[-400:]}"
        print(f"{name:13s} warm_up={warm!s:5s} process {r}: {line}", flush=True)
        seen[(name, warm)].append(line)
    for (name, warm), lines in seen.items():
        fields = [dict(kv.split("=", 1) for kv in ln.split()) for ln in lines if "first=" in ln]
        inside = all(f["first"] == f["after_batch"] == f["fresh_runner"] for f in fields)
        across = len({f["first"] for f in fields}) == 1 and len({f["batch"] for f in fields}) == 1
        print(f"{name} warm_up={warm}: same bits within a process (first/after batch/fresh runner): {inside}; "
              f"across {len(fields)} processes: {across}", flush=True)


if __name__ == "__main__":
    main()
