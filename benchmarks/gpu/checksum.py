"""The CUDA IPC device checksum, eager torch ops vs the Triton kernel, side by side on one GPU.

Interleaved repetitions over the same writes: a transfer-workload-sized request (2 writes of
200 MiB in 1 MiB page runs) and a fragmented one (page-sized 64 KiB segments). Prints ms per call,
GB/s of checksummed bytes and kernel/eager, and checks that both give the same sums.

    python3 benchmarks/gpu/checksum.py [--mib 400] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvrelay.transfer.cuda_ipc import _kernel_sums, device_checksums, warm_up
from kvrelay.transfer.planner import Segment


def timed(memory: torch.Tensor, writes: list[list[Segment]], mode: str) -> tuple[float, list[int]]:
    os.environ["KVRELAY_DEVICE_CHECKSUM"] = mode
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sums = device_checksums(memory, writes, side="src")  # ends with a host sync (.tolist())
    return (time.perf_counter() - t0) * 1e3, sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=400)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib << 20
    memory = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for seg_bytes in (1 << 20, 64 << 10):
        per_write = nbytes // 2 // seg_bytes
        writes = [[Segment((k * per_write + s) * seg_bytes, 0, seg_bytes) for s in range(per_write)] for k in range(2)]
        os.environ["KVRELAY_DEVICE_CHECKSUM"] = "triton"
        warm_up(memory.device)  # builds the kernel and checks it against the torch ops
        assert _kernel_sums(memory, writes, "src") is not None, "the kernel does not apply (or was disabled)"
        timed(memory, writes, "eager")
        timed(memory, writes, "triton")  # warm: build the kernel
        eager_ms, kernel_ms = [], []
        for _ in range(args.reps):
            ms, eager = timed(memory, writes, "eager")
            eager_ms.append(ms)
            ms, kernel = timed(memory, writes, "triton")
            kernel_ms.append(ms)
            assert kernel == eager, (kernel, eager)
        e, k = statistics.median(eager_ms), statistics.median(kernel_ms)
        print(f"{args.mib} MiB as 2 writes of {per_write} x {seg_bytes >> 10} KiB segments: "
              f"eager {e:.2f} ms ({nbytes / e / 1e6:.1f} GB/s), kernel {k:.2f} ms ({nbytes / k / 1e6:.1f} GB/s), "
              f"kernel/eager {k / e:.3f}, sums equal")


if __name__ == "__main__":
    main()
