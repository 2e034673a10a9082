"""Per-write checksums (DESIGN.md section 5): xxh3_64 over a write's bytes in segment order.

The sender hashes its staging bytes; the receiver hashes the destination bytes of the same
segments. A write counts as loaded only when the receiver's hash matches the sender's, because
Mooncake's TCP transport may report completion before the bytes have landed. This module never
imports torch: memory comes in as anything exporting the buffer protocol (or a CPU tensor).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvrelay.transfer.planner import PlannedWrite, Segment


def as_memoryview(memory: Any) -> memoryview:
    """A flat byte view of `memory` without copying: bytes-like, numpy array or CPU torch tensor."""
    if hasattr(memory, "data_ptr") and hasattr(memory, "numpy"):
        # torch.Tensor: .numpy() shares storage for CPU tensors; a device tensor raises here,
        # which is right: hashing device memory needs an explicit copy the caller pays for.
        if not memory.is_contiguous():
            raise ValueError("memory tensor must be contiguous")
        memory = memory.detach().numpy()
    view = memoryview(memory)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def checksum_bytes(data: Any) -> int:
    """xxh3_64 of a whole buffer."""
    return int(xxhash.xxh3_64_intdigest(as_memoryview(data)))


def checksum_segments(memory: Any, segments: Sequence[Segment], *, side: str) -> int:
    """xxh3_64 over `segments` of `memory` in order; side "src" reads staging, "dst" the pool."""
    if side not in ("src", "dst"):
        raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
    view = as_memoryview(memory)
    h = xxhash.xxh3_64()
    for seg in segments:
        start = seg.src_offset if side == "src" else seg.dst_offset
        if start < 0 or start + seg.length > len(view):
            raise ValueError(
                f"segment [{start}, {start + seg.length}) lies outside the {len(view)}-byte {side} memory"
            )
        h.update(view[start : start + seg.length])
    return int(h.intdigest())


def write_checksum(staging: Any, write: PlannedWrite) -> int:
    """The sender's checksum of one write: its staging bytes in segment order."""
    return checksum_segments(staging, write.segments, side="src")


def verify_write(region_memory: Any, write: PlannedWrite, expected_checksum: int) -> bool:
    """True when the destination bytes of `write` hash to the sender's checksum.

    Called by a receiving rank, repeatedly until its transfer timeout, before it reports a load.
    """
    return checksum_segments(region_memory, write.segments, side="dst") == expected_checksum


def verify_write_until(
    region_memory: Any,
    write: PlannedWrite,
    expected_checksum: int,
    timeout_s: float,
    *,
    interval_s: float = 0.005,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Re-check `verify_write` until it holds or `timeout_s` passes (the receiver's transfer_timeout).

    Mooncake's TCP transport may report completion while bytes are still in flight, so a first
    mismatch right after the sender's OK is not yet a failure."""
    deadline = clock() + timeout_s
    while True:
        if verify_write(region_memory, write, expected_checksum):
            return True
        if clock() >= deadline:
            return False
        sleep(interval_s)
