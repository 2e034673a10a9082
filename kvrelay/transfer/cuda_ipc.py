"""The CUDA IPC transport (`kv_connector: CudaIpcConnector`, DESIGN.md section 5): same host,
device memory end to end.

The receiving DiT rank exports its device page pool once (a CUDA IPC handle of the allocation,
plus the pool's offset in it) and describes it with a `RegionDescriptor` whose `endpoint` carries
the handle; the descriptor reaches senders through the broker's replica registration like any
other. The sending AR rank maps each destination pool once per replica pair (cached by endpoint)
and executes a plan's writes as device-to-device copies from its device staging buffer.

Checksums are computed on the device (`device_checksum`: a torch reduction over the written
bytes, never a host copy) by the sender over its staging bytes and by the receiver over its pool;
they are what the ticket rules compare, exactly as xxh3 is for the host transports. A sender's
OK still only means the copies completed on its stream: the receiver's checksum decides.

Only the CUDA driver API is used (libcuda, which every CUDA process already loads), through
ctypes: no extra package. Importing this module needs torch but no GPU; using it needs one.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.logging import get_logger
from kvrelay.transfer.planner import PlannedWrite, Segment
from kvrelay.transfer.transport import RegionDescriptor, WriteOutcome, check_writes_fit

_log = get_logger(__name__)

ENDPOINT_PREFIX = "cudaipc"
_IPC_HANDLE_BYTES = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    """A CUDA driver call of the IPC transport failed, or a region cannot be mapped here."""


# ---------------------------------------------------------------------------------------------
# Device checksum
# ---------------------------------------------------------------------------------------------

# Odd 64-bit multipliers (golden ratio, splitmix64) as signed int64: torch integer arithmetic
# wraps modulo 2**64, which is the arithmetic this checksum is defined in.
_M1 = 0x9E3779B97F4A7C15 - (1 << 64)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)
_MASK64 = (1 << 64) - 1


def _words(memory: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The bytes [start, start + length) of a flat uint8 tensor as int64 words (zero-padded to a
    multiple of 8; copied only when the range is not 8-byte aligned)."""
    part = memory[start : start + length]
    if length % 8 or (memory.data_ptr() + start) % 8:
        padded = torch.zeros(-(-length // 8) * 8, dtype=torch.uint8, device=memory.device)
        padded[:length] = part
        part = padded
    return part.view(torch.int64)


def device_checksums(memory: torch.Tensor, writes: Sequence[Sequence[Segment]], *, side: str) -> list[int]:
    """One 64-bit checksum per write: over its segments' bytes of ``memory`` in segment order
    (``side`` "src": the segments' staging offsets, "dst": their destination offsets), computed
    where ``memory`` lives. One host synchronisation for all writes together.

    Definition (the same on every device): with the bytes as little-endian 64-bit words w_i
    (zero-padded per segment) and i counted across the write's segments,
    ``h = sum(w_i * (i * M1 + M2 | 1)) + sum(mix(w_i) * (i * M3 + M1 | 1)) + nbytes * M2`` mod 2**64,
    ``mix(w) = w ^ (w >> 31)`` (w as a signed int64, arithmetic shift). Each term is a bijection of w_i, so any single changed word, and
    any changed length, changes h.

    On a GPU with Triton, when every segment is whole 8-byte words at 8-byte-aligned addresses
    (kvrelay's pages always are), the sums come from one kernel that reads each word once
    (`kvrelay.transfer.checksum_kernel`), which `warm_up` checks against the torch ops before it
    is used. Otherwise, or with ``KVRELAY_DEVICE_CHECKSUM=eager``, they come from torch ops, one
    segment at a time (about 25 passes over the bytes; see docs/transfer.md).
    """
    if side not in ("src", "dst"):
        raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
    if memory.dtype != torch.uint8 or memory.dim() != 1 or not memory.is_contiguous():
        raise ValueError("memory must be a flat contiguous uint8 tensor")
    nbytes = []
    for segments in writes:
        total = 0
        for seg in segments:
            start = seg.src_offset if side == "src" else seg.dst_offset
            if start < 0 or start + seg.length > memory.numel():
                raise ValueError(
                    f"segment [{start}, {start + seg.length}) lies outside the {memory.numel()}-byte {side} memory"
                )
            total += seg.length
        nbytes.append(total)
    sums = _kernel_sums(memory, writes, side)
    if sums is None:
        sums = _eager_sums(memory, writes, side)
    return [(int(s) + n * _M2) & _MASK64 for s, n in zip(sums.tolist(), nbytes, strict=True)]


def _eager_sums(memory: torch.Tensor, writes: Sequence[Sequence[Segment]], side: str) -> torch.Tensor:
    sums = torch.zeros(len(writes), dtype=torch.int64, device=memory.device)
    for k, segments in enumerate(writes):
        pos = 0
        for seg in segments:
            start = seg.src_offset if side == "src" else seg.dst_offset
            w = _words(memory, start, seg.length)
            i = torch.arange(pos, pos + w.numel(), dtype=torch.int64, device=memory.device)
            mixed = torch.bitwise_xor(w, torch.bitwise_right_shift(w, 31))
            term = w * torch.bitwise_or(i * _M1 + _M2, 1) + mixed * torch.bitwise_or(i * _M3 + _M1, 1)
            sums[k] += term.sum()
            pos += w.numel()
    return sums


_KERNEL: Any = None
_KERNEL_LOCK = threading.Lock()


def _checksum_kernel() -> Any:
    """`kvrelay.transfer.checksum_kernel`, or False where Triton cannot be imported."""
    global _KERNEL
    with _KERNEL_LOCK:
        if _KERNEL is None:
            try:
                from kvrelay.transfer import checksum_kernel

                _KERNEL = checksum_kernel
            except ImportError:
                _KERNEL = False
        return _KERNEL


def _kernel_sums(memory: torch.Tensor, writes: Sequence[Sequence[Segment]], side: str) -> torch.Tensor | None:
    """The per-write sums from the Triton kernel, or None where it does not apply (no GPU or no
    Triton, the eager form forced, or a segment that is not whole aligned words)."""
    if checksum_mode() != "triton" or memory.data_ptr() % 8:
        return None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)
    if memory.device.type != "cuda" and not interpreted:
        return None
    starts, lengths, positions, write_of = [], [], [], []
    for k, segments in enumerate(writes):
        pos = 0
        for seg in segments:
            start = seg.src_offset if side == "src" else seg.dst_offset
            if start % 8 or seg.length % 8:
                return None
            starts.append(start // 8)
            lengths.append(seg.length // 8)
            positions.append(pos)
            write_of.append(k)
            pos += seg.length // 8
    kernel = _checksum_kernel()
    if not kernel:
        return None
    words = memory[: memory.numel() - memory.numel() % 8].view(torch.int64)
    table = kernel.block_table(starts, lengths, positions, write_of)
    try:
        return kernel.word_sums(words, table, len(writes))  # type: ignore[no-any-return]
    except Exception as err:  # noqa: BLE001 - a kernel that does not build here: the eager form
        _disable_kernel(f"the kernel failed: {err}")
        return None


CHECKSUM_MODES = ("eager", "triton")


def checksum_mode() -> str:
    """``KVRELAY_DEVICE_CHECKSUM``: "triton" (one kernel where it applies, the default) or
    "eager" (torch ops always)."""
    mode = os.environ.get("KVRELAY_DEVICE_CHECKSUM", "") or "triton"
    if mode not in CHECKSUM_MODES:
        raise CudaIpcError(f"KVRELAY_DEVICE_CHECKSUM must be one of {', '.join(CHECKSUM_MODES)}, got {mode!r}")
    return mode


def _disable_kernel(reason: str) -> None:
    global _KERNEL
    with _KERNEL_LOCK:
        _KERNEL = False
    _log.warning("device_checksum_kernel_disabled", reason=reason[:500], using="eager torch ops")


def warm_up(device: torch.device) -> None:
    """Check the checksum mode, and with "triton" build the kernel for ``device`` now (Triton
    compiles at first launch) and check it against the torch ops on writes that span several of
    its blocks: a kernel that fails to build or gives other bits is disabled (logged), so every
    checksum stays the definition's."""
    if checksum_mode() != "triton":
        return
    kernel = _checksum_kernel()
    if not kernel:
        _log.warning("device_checksum_kernel_unavailable", reason="Triton cannot be imported", using="eager torch ops")
        return
    g = torch.Generator(device=device).manual_seed(0x5EED)
    span = kernel.BLOCK_WORDS * 8
    memory = torch.randint(0, 256, (3 * span,), dtype=torch.uint8, device=device, generator=g)
    writes = [[Segment(8, 0, span + 64), Segment(2 * span, 0, span // 2)], [Segment(span + 96, 0, 808)], []]
    got = _kernel_sums(memory, writes, "src")  # None: the kernel failed (disabled and logged)
    if got is None:
        return
    want = _eager_sums(memory, writes, "src")
    if not torch.equal(got, want):
        _disable_kernel(f"the kernel's sums {got.tolist()} differ from the torch ops' {want.tolist()}")


def write_checksum(staging: torch.Tensor, write: PlannedWrite) -> int:
    """The sender's device checksum of one write (its staging bytes in segment order)."""
    return device_checksums(staging, [write.segments], side="src")[0]


def verify_writes(pool: torch.Tensor, writes: Sequence[PlannedWrite]) -> list[int]:
    """The receiver's device checksums of ``writes`` over its pool (compare with the sender's)."""
    return device_checksums(pool, [w.segments for w in writes], side="dst")


# ---------------------------------------------------------------------------------------------
# CUDA driver calls
# ---------------------------------------------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _IPC_HANDLE_BYTES)]


_DRIVER: Any = None
_DRIVER_LOCK = threading.Lock()


def _driver() -> Any:
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as err:
                raise CudaIpcError(f"the CUDA driver library is not loadable here: {err}") from None
            lib.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64
            ]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
            lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
            lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            _DRIVER = lib
        return _DRIVER


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaIpcError(f"{what} failed with CUDA driver error {rc}")


def host_id() -> str:
    """This host's identity for IPC: a handle opens only on the host (and boot) that made it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class IpcRegion:
    """An exported region: host, device, the allocation's IPC handle, and the region's offset and
    length inside that allocation. Travels as a RegionDescriptor (endpoint "cudaipc:<host>:<device>",
    ipc_handle, base_address = offset, length) through the broker's replica registration."""

    host: str
    device_uuid: str
    handle: bytes
    offset: int
    length: int

    def descriptor(self, rank: int) -> RegionDescriptor:
        return RegionDescriptor(rank=rank, transport="cuda_ipc", endpoint=f"{ENDPOINT_PREFIX}:{self.host}:{self.device_uuid}",
                                base_address=self.offset, length=self.length, ipc_handle=self.handle)

    @classmethod
    def of(cls, region: RegionDescriptor) -> IpcRegion:
        parts = region.endpoint.split(":")
        if region.transport != "cuda_ipc" or len(parts) != 3 or parts[0] != ENDPOINT_PREFIX:
            raise ValueError(f"not a CUDA IPC region: {region.transport} {region.endpoint[:80]!r}")
        if len(region.ipc_handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"CUDA IPC handle of {len(region.ipc_handle)} bytes, expected {_IPC_HANDLE_BYTES}")
        return cls(parts[1], parts[2], bytes(region.ipc_handle), region.base_address, region.length)


def _device_uuid(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", device.index)).replace(":", "-")


class _CudaArray:
    """A raw device range exposed through __cuda_array_interface__, so torch.as_tensor wraps it."""

    def __init__(self, ptr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }


def export_region(memory: torch.Tensor) -> IpcRegion:
    """The IPC description of a flat contiguous uint8 device tensor (the DiT rank's pool)."""
    if memory.device.type != "cuda" or memory.dtype != torch.uint8 or not memory.is_contiguous():
        raise ValueError("a CUDA IPC region must be a contiguous uint8 tensor on a GPU")
    lib = _driver()
    with torch.cuda.device(memory.device):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), memory.data_ptr()),
               "cuMemGetAddressRange")
        handle = _IpcHandle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    return IpcRegion(host_id(), _device_uuid(memory.device), bytes(handle),
                     memory.data_ptr() - base.value, memory.numel())


def _ensure_context(lib: Any, device: torch.device) -> None:
    """Bind the device's primary context to this thread before a driver call. torch creates it
    lazily (first allocation or kernel): a process that only maps another's memory, such as the
    DiT service that verifies its ranks' pools, has none yet, and cuIpcOpenMemHandle then fails
    with CUDA_ERROR_INVALID_CONTEXT (201)."""
    current = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(current)) != 0 or not current.value:
        torch.cuda.synchronize(device)  # a runtime call: creates and binds the primary context


class _Mapping:
    """An opened remote allocation in this process; ``tensor`` is the region's bytes."""

    def __init__(self, region: IpcRegion, device: torch.device) -> None:
        if region.host != host_id():
            raise CudaIpcError(
                f"the region lives on host {region.host}, this is {host_id()}: CUDA IPC is same-host "
                "only (use MooncakeConnector across hosts)"
            )
        lib = _driver()
        handle = _IpcHandle.from_buffer_copy(region.handle)
        ptr = ctypes.c_uint64()
        with torch.cuda.device(device):
            _ensure_context(lib, device)
            _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        self.base = ptr.value
        self.tensor = torch.as_tensor(_CudaArray(self.base + region.offset, region.length), device=device)

    def close(self) -> None:
        if self.base:
            _driver().cuIpcCloseMemHandle(self.base)
            self.base = 0


# ---------------------------------------------------------------------------------------------
# Endpoint: receiver and sender
# ---------------------------------------------------------------------------------------------


class CudaIpcEndpoint:
    """Both sides of the CUDA IPC transport for one process (a KvReceiver and a KvSender).

    Receiver: ``register_region(device_pool, rank)`` exports the pool once. Sender: ``write``
    maps each destination once (cached by endpoint, so once per replica pair and process) and
    copies on its own stream; the source is a flat uint8 staging tensor on this process's GPU.
    """

    name = "cuda_ipc"

    def __init__(self, device: str | torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise CudaIpcError("the cuda_ipc transport needs a CUDA device (same-host GPU to GPU copies)")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._regions: dict[int, torch.Tensor] = {}  # keeps exported pools alive
        self._mappings: dict[tuple[str, bytes, int, int], _Mapping] = {}
        self._lock = threading.Lock()
        self._stream: Any = None
        self._closed = False
        warm_up(self.device)

    # -- receiving side ---------------------------------------------------------------------------

    def register_region(self, memory: Any, rank: int) -> RegionDescriptor:
        region = export_region(memory)
        self._regions[rank] = memory
        return region.descriptor(rank)

    # -- sending side ---------------------------------------------------------------------------

    def map_region(self, region: RegionDescriptor) -> torch.Tensor:
        """The region's bytes in this process (a uint8 device tensor), mapped once."""
        return self._mapped(region)

    def _mapped(self, region: RegionDescriptor) -> torch.Tensor:
        key = (region.endpoint, region.ipc_handle, region.base_address, region.length)
        with self._lock:
            mapping = self._mappings.get(key)
            if mapping is None:
                mapping = _Mapping(IpcRegion.of(region), self.device)
                self._mappings[key] = mapping
            return mapping.tensor

    def write(
        self,
        staging: Any,
        writes: Sequence[PlannedWrite],
        destinations: Mapping[int, RegionDescriptor],
        ticket_id: str,
        timeout_s: float,
        *,
        write_token: str = "",
    ) -> list[WriteOutcome]:
        """Copy ``writes`` from ``staging`` (a flat uint8 device tensor) into their destination
        pools; one outcome per write, in order. Bad input raises ValueError before any copy; a
        failure while copying waits for every copy already queued, then reports the writes that
        began FAILED (final: they may have landed in part, but nothing more will; the receiver's
        checksum decides) and the others NOT_STARTED."""
        del write_token  # a device-to-device copy on this host: no gRPC credential
        if self._closed:
            raise CudaIpcError("write on a closed CudaIpcEndpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not isinstance(staging, torch.Tensor) or staging.device.type != "cuda" or staging.dtype != torch.uint8:
            raise ValueError("CUDA IPC writes from a uint8 staging tensor on the GPU")
        check_writes_fit(writes, destinations, staging.numel())
        for w in writes:
            if destinations[w.dst_rank].transport != "cuda_ipc":
                raise ValueError(f"destination rank {w.dst_rank} is not a cuda_ipc region")
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        started: set[int] = set()
        failure = ""
        stream.wait_stream(torch.cuda.current_stream(self.device))  # staging was packed there
        try:
            with torch.cuda.stream(stream):
                for i, w in enumerate(writes):
                    dst = self._mapped(destinations[w.dst_rank])
                    started.add(i)
                    for s in w.segments:
                        dst[s.dst_offset : s.dst_offset + s.length].copy_(
                            staging[s.src_offset : s.src_offset + s.length], non_blocking=True
                        )
                checksums = device_checksums(staging, [w.segments for w in writes], side="src")
            stream.synchronize()
        except Exception as err:  # noqa: BLE001 - any error: wait for the queued copies, then FAILED
            failure = f"CUDA IPC write of ticket {ticket_id} failed: {err}"
            # FAILED is a final outcome (nothing more will land), so copies already queued on the
            # stream must be over before this call returns: wait for them. If the wait itself
            # fails, the CUDA error is sticky and the context runs nothing more, so no queued
            # copy can land later either.
            try:
                stream.synchronize()
            except RuntimeError:
                pass
        outcomes = []
        for i, w in enumerate(writes):
            if not failure:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, checksums[i]))
            elif i in started:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "FAILED", w.num_bytes, 0,
                                             f"{failure}; the write may have landed in part"))
            else:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, failure))
        return outcomes

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap every destination (only once no write is in flight) and drop exported pools."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for mapping in self._mappings.values():
                mapping.close()
            self._mappings.clear()
        self._regions.clear()


def make_sender(device: str | None = None) -> CudaIpcEndpoint:
    return CudaIpcEndpoint(device)


def make_receiver(device: str | None = None) -> CudaIpcEndpoint:
    return CudaIpcEndpoint(device)


__all__ = [
    "CudaIpcEndpoint",
    "CudaIpcError",
    "IpcRegion",
    "device_checksums",
    "export_region",
    "host_id",
    "make_receiver",
    "make_sender",
    "verify_writes",
    "write_checksum",
]
