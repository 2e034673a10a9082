"""Local reference computations at a given torch thread count: a CPU matmul may round
differently with another count, so a bit-for-bit check against a rank's output runs the
reference with the rank's count."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def torch_threads(threads: int) -> Iterator[int]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
