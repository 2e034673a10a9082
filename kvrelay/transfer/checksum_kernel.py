"""The CUDA IPC device checksum as one Triton kernel (imported only where Triton and a GPU are).

`kvrelay.transfer.cuda_ipc.device_checksums` defines the checksum; its eager torch form makes a
dozen word-sized int64 temporaries per segment, about 25 passes over the written bytes on each
side of every write. This kernel reads each word once: every program sums the terms of one block
of up to `BLOCK_WORDS` words of one segment into one int64 partial, and the partials are added per
write. int64 arithmetic wraps modulo 2**64 in Triton as in torch, and addition is associative
modulo 2**64, so the bits are the definition's whatever the block order (tests/transfer/
test_cuda_ipc.py compares the two on a GPU, and with Triton's interpreter on the CPU).

It takes segments whose device address and length are multiples of 8 (a whole number of words:
no zero padding); the caller keeps the eager form for any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

# The definition's odd multipliers as signed int64 (see cuda_ipc.py). A jitted kernel may read a
# global only when it is a `tl.constexpr` instance: an annotation alone passes Triton's CPU
# interpreter but not the compiler (Triton 3.6 on the H200: "Cannot access global variable").
_M1 = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
_M2 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
_M3 = tl.constexpr(0x94D049BB133111EB - (1 << 64))

BLOCK_WORDS = 1 << 15  # 256 KiB of a segment per program
_SUB = 1024  # words per inner iteration


@triton.jit  # type: ignore[untyped-decorator,unused-ignore]
def _checksum_blocks(words, starts, lengths, positions, partials, BLOCK: tl.constexpr, SUB: tl.constexpr):  # type: ignore[no-untyped-def,unused-ignore]
    pid = tl.program_id(0)
    start = tl.load(starts + pid)
    n = tl.load(lengths + pid)
    pos = tl.load(positions + pid)
    acc = tl.zeros([SUB], dtype=tl.int64)
    m1 = tl.full([SUB], _M1, tl.int64)
    m2 = tl.full([SUB], _M2, tl.int64)
    m3 = tl.full([SUB], _M3, tl.int64)
    for off in range(0, BLOCK, SUB):
        j = off + tl.arange(0, SUB).to(tl.int64)
        inside = j < n
        w = tl.load(words + start + j, mask=inside, other=0)
        i = pos + j
        c1 = (i * m1 + m2) | 1
        c2 = (i * m3 + m1) | 1
        mixed = w ^ (w >> 31)
        acc += tl.where(inside, w * c1 + mixed * c2, 0)
    tl.store(partials + pid, tl.sum(acc, axis=0))


def block_table(starts: Sequence[int], lengths: Sequence[int], positions: Sequence[int],
                write_of: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Split segments (word start, word length, first word position in its write, write index)
    into blocks of at most `BLOCK_WORDS` words: the per-program (start, length, position, write)."""
    seg_start = np.asarray(starts, dtype=np.int64)
    seg_len = np.asarray(lengths, dtype=np.int64)
    seg_pos = np.asarray(positions, dtype=np.int64)
    seg_write = np.asarray(write_of, dtype=np.int64)
    blocks = np.maximum(-(-seg_len // BLOCK_WORDS), 0)
    owner = np.repeat(np.arange(len(seg_len)), blocks)
    first = np.cumsum(blocks) - blocks
    offset = (np.arange(len(owner), dtype=np.int64) - first[owner]) * BLOCK_WORDS
    return (
        seg_start[owner] + offset,
        np.minimum(seg_len[owner] - offset, BLOCK_WORDS),
        seg_pos[owner] + offset,
        seg_write[owner],
    )


def word_sums(words: torch.Tensor, table: tuple[np.ndarray, ...], num_writes: int) -> torch.Tensor:
    """Per write, the sum (mod 2**64) of the definition's terms over its blocks of ``words`` (a
    flat int64 tensor): an int64 tensor of ``num_writes`` on ``words``' device, not yet synced."""
    starts, lengths, positions, write_of = (torch.from_numpy(a).to(words.device) for a in table)
    partials = torch.empty(len(table[0]), dtype=torch.int64, device=words.device)
    if len(table[0]):
        _checksum_blocks[(len(table[0]),)](words, starts, lengths, positions, partials,
                                           BLOCK=BLOCK_WORDS, SUB=_SUB)
    sums = torch.zeros(num_writes, dtype=torch.int64, device=words.device)
    return sums.index_add_(0, write_of, partials)
