"""The CUDA IPC transport: its device checksum (on the CPU here: the same torch reduction runs on
any device) against an independent pure-Python definition, its descriptors through the broker's
proto, and, on a GPU, a real two-process write into a mapped device pool verified on the device."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from typing import Any

import pytest
import torch

from kvrelay.transfer.convert import region_from_proto, region_to_proto
from kvrelay.transfer.cuda_ipc import IpcRegion, device_checksums
from kvrelay.transfer.planner import PlannedWrite, Segment
from kvrelay.transfer.transport import RegionDescriptor

MASK = (1 << 64) - 1
M1, M2, M3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def reference_checksum(data: bytes, segments: list[Segment], side: str) -> int:
    """The documented definition, in plain Python integers."""
    h, i, total = 0, 0, 0
    for seg in segments:
        start = seg.src_offset if side == "src" else seg.dst_offset
        chunk = data[start : start + seg.length]
        chunk += b"\0" * (-len(chunk) % 8)
        for j in range(0, len(chunk), 8):
            w = int.from_bytes(chunk[j : j + 8], "little", signed=True)
            mixed = (w ^ (w >> 31)) & MASK
            h += (w & MASK) * (((i * M1 + M2) & MASK) | 1) + mixed * (((i * M3 + M1) & MASK) | 1)
            i += 1
        total += seg.length
    return (h + total * M2) & MASK


def _random_segments(rng: random.Random, size: int, count: int) -> list[Segment]:
    out = []
    for _ in range(count):
        length = rng.choice([8, 16, 256, 40, 13, 1])
        start = rng.randrange(0, size - length)
        out.append(Segment(start, rng.randrange(0, size - length), length))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_device_checksum_matches_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(4096))
    memory = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    writes = [_random_segments(rng, len(data), rng.randrange(1, 5)) for _ in range(3)]
    for side in ("src", "dst"):
        got = device_checksums(memory, writes, side=side)
        assert got == [reference_checksum(data, segs, side) for segs in writes]


def test_device_checksum_sees_any_changed_byte_length_and_order() -> None:
    rng = random.Random(7)
    memory = torch.tensor([rng.randrange(256) for _ in range(1024)], dtype=torch.uint8)
    segs = [Segment(0, 0, 256), Segment(512, 512, 256)]
    base = device_checksums(memory, [segs], side="src")[0]
    for pos in [0, 7, 255, 512, 767]:
        flipped = memory.clone()
        flipped[pos] ^= 0x01
        assert device_checksums(flipped, [segs], side="src")[0] != base
    assert device_checksums(memory, [segs[::-1]], side="src")[0] != base
    assert device_checksums(memory, [[Segment(0, 0, 255), segs[1]]], side="src")[0] != base
    with pytest.raises(ValueError, match="outside"):
        device_checksums(memory, [[Segment(1000, 0, 100)]], side="src")


_KERNEL_VS_EAGER = """
import os, random, sys, torch
from kvrelay.transfer import checksum_kernel, cuda_ipc
from kvrelay.transfer.planner import Segment
checksum_kernel.BLOCK_WORDS, checksum_kernel._SUB = int(sys.argv[2]), int(sys.argv[3])
device = sys.argv[1]
os.environ["KVRELAY_DEVICE_CHECKSUM"] = "triton"
cuda_ipc.warm_up(torch.device(device))
assert cuda_ipc._checksum_kernel(), "the self-check disabled the kernel"
rng = random.Random(5)
mem = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device=device)
for _ in range(6):
    writes = [[Segment(8 * rng.randrange(0, 7000), 8 * rng.randrange(0, 7000), 8 * rng.choice([1, 2, 63, 64, 65, 200, 1000]))
               for _ in range(rng.randrange(0, 5))] for _ in range(3)]
    for side in ("src", "dst"):
        assert cuda_ipc._kernel_sums(mem, writes, side) is not None  # the kernel applies
        kernel = cuda_ipc.device_checksums(mem, writes, side=side)
        os.environ["KVRELAY_DEVICE_CHECKSUM"] = "eager"
        assert cuda_ipc._kernel_sums(mem, writes, side) is None
        eager = cuda_ipc.device_checksums(mem, writes, side=side)
        os.environ["KVRELAY_DEVICE_CHECKSUM"] = "triton"
        assert kernel == eager, (kernel, eager)
        assert kernel == [REF(mem.cpu().numpy().tobytes(), segs, side) for segs in writes]
odd = [[Segment(3, 3, 16)], [Segment(0, 0, 13)]]  # not whole aligned words: the eager form
assert cuda_ipc._kernel_sums(mem, odd, "src") is None
print("kernel == eager")
"""


def _run_kernel_check(device: str, block: int, sub: int, env: dict[str, str]) -> None:
    import inspect
    import os
    import subprocess
    import sys

    script = (f"from __future__ import annotations\nMASK = {MASK}\nM1, M2, M3 = {M1}, {M2}, {M3}\n"
              + inspect.getsource(reference_checksum) + "REF = reference_checksum\n" + _KERNEL_VS_EAGER)
    proc = subprocess.run([sys.executable, "-c", script, device, str(block), str(sub)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "kernel == eager" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_checksum_kernel_equals_the_definition_in_tritons_interpreter() -> None:
    """The Triton kernel on the CPU through Triton's interpreter (where Triton is installed;
    CI has no Triton: the GPU test below runs the compiled kernel), with small blocks so that
    segments span several programs and the masks are exercised."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed here")
    _run_kernel_check("cpu", 64, 16, {"TRITON_INTERPRET": "1"})


@pytest.mark.slow
def test_checksum_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """The interpreter runs a kernel as Python, so it cannot see what only the compiler refuses:
    Triton 3.6 on the H200 refused the first kernel's annotated module-level multipliers
    ("Cannot access global variable _M1 from within @jit'ed function") and every endpoint fell
    back to the eager checksum. Compile it for sm_90 here, to the cubin, as the GPU would."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed here")
    import triton
    from triton.backends.compiler import GPUTarget

    from kvrelay.transfer import checksum_kernel

    signature = {name: "*i64" for name in ("words", "starts", "lengths", "positions", "partials")}
    source = triton.compiler.ASTSource(
        fn=checksum_kernel._checksum_blocks, signature={**signature, "BLOCK": "constexpr", "SUB": "constexpr"},
        constexprs={"BLOCK": checksum_kernel.BLOCK_WORDS, "SUB": checksum_kernel._SUB})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # no ptxas here: the front end (where globals are checked) still ran
        if "ptxas" not in str(exc).lower():
            raise
        return
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(("block", "sub"), [(64, 16), (1 << 15, 1024)])
def test_checksum_kernel_equals_the_definition_on_the_gpu(block: int, sub: int) -> None:
    _run_kernel_check("cuda:0", block, sub, {})


@pytest.mark.gpu
def test_checksum_kernel_on_a_large_write_equals_eager_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real block size, a 96 MiB write of 1000 page-sized segments plus a 40 MiB one."""
    from kvrelay.transfer import cuda_ipc

    g = torch.Generator(device="cuda:0").manual_seed(3)
    mem = torch.randint(0, 256, (200 << 20,), dtype=torch.uint8, device="cuda:0", generator=g)
    page = 98304
    writes = [[Segment(k * page, (999 - k) * page, page) for k in range(1000)], [Segment(8, 16, 40 << 20)]]
    monkeypatch.setenv("KVRELAY_DEVICE_CHECKSUM", "triton")
    assert cuda_ipc._kernel_sums(mem, writes, "dst") is not None
    kernel = device_checksums(mem, writes, side="dst")
    monkeypatch.setenv("KVRELAY_DEVICE_CHECKSUM", "eager")
    assert device_checksums(mem, writes, side="dst") == kernel
    mem[12345] ^= 1
    monkeypatch.setenv("KVRELAY_DEVICE_CHECKSUM", "triton")
    assert device_checksums(mem, writes, side="dst") != kernel


class _WrongKernel:
    """A stand-in for `checksum_kernel` whose sums are off by one: what the self-check is for."""

    BLOCK_WORDS = 64

    @staticmethod
    def block_table(starts: Any, lengths: Any, positions: Any, write_of: Any) -> Any:
        return write_of

    @staticmethod
    def word_sums(words: torch.Tensor, table: Any, num_writes: int) -> torch.Tensor:
        return torch.ones(num_writes, dtype=torch.int64)


def test_the_kernel_is_the_default_eager_can_be_forced_and_a_wrong_one_is_disabled_at_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrelay.transfer import cuda_ipc

    fake = _WrongKernel()
    monkeypatch.setattr(cuda_ipc, "_KERNEL", fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the kernel path run on CPU tensors
    memory = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    writes = [[Segment(0, 0, 64)]]
    monkeypatch.setenv("KVRELAY_DEVICE_CHECKSUM", "eager")
    assert cuda_ipc._kernel_sums(memory, writes, "src") is None  # forced off...
    monkeypatch.delenv("KVRELAY_DEVICE_CHECKSUM", raising=False)
    assert cuda_ipc.checksum_mode() == "triton"
    assert cuda_ipc._kernel_sums(memory, writes, "src") is not None  # ...used by default...
    cuda_ipc.warm_up(torch.device("cpu"))
    assert cuda_ipc._KERNEL is False  # ...until the self-check sees other bits than the torch ops'
    assert device_checksums(memory, writes, side="src") == [reference_checksum(bytes(memory.tolist()), writes[0], "src")]
    monkeypatch.setenv("KVRELAY_DEVICE_CHECKSUM", "fast")
    with pytest.raises(cuda_ipc.CudaIpcError, match="one of eager, triton"):
        cuda_ipc.warm_up(torch.device("cpu"))


def test_region_descriptor_carries_the_ipc_handle_through_the_proto() -> None:
    handle = bytes(range(64))
    region = IpcRegion("host/boot", "GPU-1234", handle, 4096, 1 << 20).descriptor(rank=3)
    back = region_from_proto(region_to_proto(region))
    assert back == region and back.ipc_handle == handle
    assert IpcRegion.of(back) == IpcRegion("host/boot", "GPU-1234", handle, 4096, 1 << 20)
    with pytest.raises(ValueError, match="not a CUDA IPC region"):
        IpcRegion.of(RegionDescriptor(0, "mooncake", "127.0.0.1:1234", 0, 10))


# ---------------------------------------------------------------------------------------------
# On a GPU: two processes, a real mapping
# ---------------------------------------------------------------------------------------------


def _receiver(conn: Any, pool_bytes: int) -> None:
    try:
        from kvrelay.transfer.cuda_ipc import CudaIpcEndpoint, verify_writes

        pool = torch.zeros(pool_bytes, dtype=torch.uint8, device="cuda:0")
        endpoint = CudaIpcEndpoint("cuda:0")
        conn.send(("ok", endpoint.register_region(pool, rank=0)))
        while True:
            op, arg = conn.recv()
            if op == "verify":
                conn.send(verify_writes(pool, arg))
            elif op == "dump":
                conn.send(pool.cpu().numpy().tobytes())
            else:
                endpoint.close()
                conn.send("bye")
                return
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.slow
def test_two_process_write_lands_and_verifies_on_the_device() -> None:
    from kvrelay.transfer.cuda_ipc import CudaIpcEndpoint

    pool_bytes = 1 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, pool_bytes), daemon=True)
    proc.start()
    try:
        assert parent.poll(120)
        status, region = parent.recv()
        assert status == "ok", region
        staging = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda:0")
        writes = [
            PlannedWrite(0, 0, 0, (Segment(0, 4096, 8192), Segment(8192, 65536, 4096))),
            PlannedWrite(1, 0, 0, (Segment(20000, 300000, 16384),)),
        ]
        sender = CudaIpcEndpoint("cuda:0")
        outcomes = sender.write(staging, writes, {0: region}, "t-ipc", 10.0)
        assert [o.status for o in outcomes] == ["OK", "OK"]
        parent.send(("verify", writes))
        assert parent.recv() == [o.checksum for o in outcomes]
        parent.send(("dump", None))
        landed = parent.recv()
        host = staging.cpu().numpy().tobytes()
        for w in writes:
            for s in w.segments:
                assert landed[s.dst_offset : s.dst_offset + s.length] == host[s.src_offset : s.src_offset + s.length]
        assert landed[:4096] == bytes(4096)  # nothing outside the segments was written
        sender.close()
        parent.send(("stop", None))
        assert parent.recv() == "bye"
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _fresh_mapper(conn: Any, region: Any, writes: Any) -> None:
    """A process that never touched CUDA before (like the DiT service): maps the region and
    checksums it from a worker thread, as the service does off its event loop."""
    try:
        import threading

        from kvrelay.transfer.cuda_ipc import CudaIpcEndpoint, verify_writes

        pool = CudaIpcEndpoint("cuda:0").map_region(region)
        out: list[Any] = []
        thread = threading.Thread(target=lambda: out.append(verify_writes(pool, writes)))
        thread.start()
        thread.join(60)
        conn.send(("ok", out[0]))
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.slow
def test_a_process_without_a_cuda_context_maps_and_verifies_a_pool() -> None:
    """The DiT service verifies CUDA IPC writes in its own process, which has no CUDA context
    until then: mapping must create one (it failed with driver error 201 and every verify fell
    back to the ranks, behind their running denoise)."""
    from kvrelay.transfer.cuda_ipc import CudaIpcEndpoint

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_receiver, args=(child, 1 << 20), daemon=True)
    owner.start()
    try:
        assert parent.poll(120)
        status, region = parent.recv()
        assert status == "ok", region
        staging = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda:0")
        writes = [PlannedWrite(0, 0, 0, (Segment(0, 4096, 8192), Segment(8192, 65536, 4096)))]
        sender = CudaIpcEndpoint("cuda:0")
        outcomes = sender.write(staging, writes, {0: region}, "t-fresh", 10.0)
        mine, theirs = ctx.Pipe()
        mapper = ctx.Process(target=_fresh_mapper, args=(theirs, region, writes), daemon=True)
        mapper.start()
        assert mine.poll(120)
        status, sums = mine.recv()
        assert status == "ok", sums
        assert sums == [o.checksum for o in outcomes]
        mapper.join(20)
        sender.close()
        parent.send(("stop", None))
        assert parent.recv() == "bye"
    finally:
        owner.join(20)
        if owner.is_alive():
            owner.kill()
