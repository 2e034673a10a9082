"""The transport interface (DESIGN.md section 5): one interface, two sides.

- Receiving side (DiT rank): registers a memory region once and describes it with a
  `RegionDescriptor` that the broker hands to senders.
- Sending side (AR rank): executes a plan's writes from its staging buffer against those
  descriptions and returns one `WriteOutcome` per write, never raising for a failed write.

A sender's "OK" is not proof that bytes landed; receivers confirm with `verify_write`.
Backends are imported lazily by name so that a process never loads Mooncake or gRPC it does
not use, and a missing backend fails with an ImportError that says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from kvrelay.transfer.checksum import verify_write, write_checksum
from kvrelay.transfer.planner import PlannedWrite

__all__ = [
    "RegionDescriptor",
    "WriteOutcome",
    "FinishedCall",
    "KvSender",
    "KvReceiver",
    "TransportName",
    "make_sender",
    "make_receiver",
    "transport_for_connector",
    "not_started_outcomes",
    "staging_address",
    "verify_write",
    "write_checksum",
]

TransportName = Literal["mooncake", "grpc", "cuda_ipc"]
# OK, FAILED (the transport call returned an error) and NOT_STARTED are final; IN_DOUBT means the
# sender stopped waiting while the call still runs (it still reads staging, bytes may land).
WriteStatusName = Literal["OK", "FAILED", "NOT_STARTED", "IN_DOUBT"]

# Mooncake's TCP transport rejects a whole batch past this many queued segments per peer
# (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); batches are split to stay below it.
MOONCAKE_MAX_QUEUED_TRANSFERS_PER_PEER = 1024
# The gRPC fallback never puts more than this into one PutKv message (DESIGN.md section 5).
GRPC_MAX_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """Where one receiving rank's pool lives: enough for a sender to address any byte of it."""

    rank: int
    transport: TransportName
    # Mooncake: the receiver's session id "host:rpc_port"; gRPC: the DiT service address;
    # CUDA IPC: "cudaipc:<host id>:<device uuid>" (a handle opens on that host only).
    endpoint: str
    # Mooncake: virtual address of byte 0 in the receiver process; gRPC: 0 (offsets only);
    # CUDA IPC: the region's offset inside the exported allocation.
    base_address: int
    length: int
    # CUDA IPC: the allocation's cudaIpcMemHandle (64 bytes); empty for the other transports.
    ipc_handle: bytes = b""


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What the sender knows about one planned write after trying it."""

    row: int
    src_rank: int
    dst_rank: int
    status: WriteStatusName
    bytes: int
    # xxh3_64 of the staging bytes of the write (segment order); 0 when not started.
    checksum: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def final(self) -> bool:
        """Nothing more of this write can land (and its staging bytes are no longer read)."""
        return self.status != "IN_DOUBT"


@dataclass(frozen=True, slots=True)
class FinishedCall:
    """A write call that had in-doubt writes has really returned: their final outcomes. Nothing
    of the call reads the staging memory any more."""

    ticket_id: str
    outcomes: tuple[WriteOutcome, ...]


# ---------------------------------------------------------------------------------------------
# Sending side
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class KvSender(Protocol):
    """Executes planned writes. Called once per ticket per source rank, from a worker thread
    (it blocks); returns exactly one outcome per write, in the order of `writes`.

    An outcome is final (OK, FAILED, NOT_STARTED) or IN_DOUBT: the wait ended while the transport
    call still runs. `staging` stays in use until `collect_finished()` (polled by the caller,
    like vLLM's `get_finished`) returns that call with the final outcome of each in-doubt write.
    `write_token` (bound replica tokens): the AR's credential at the destination replica, from
    the broker; the gRPC fallback presents it on PutKv, the others have no credential to give."""

    name: str

    def write(
        self,
        staging: Any,
        writes: Sequence[PlannedWrite],
        destinations: Mapping[int, RegionDescriptor],
        ticket_id: str,
        timeout_s: float,
        *,
        write_token: str = "",
    ) -> list[WriteOutcome]: ...

    def collect_finished(self) -> list[FinishedCall]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Receiving side
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class KvReceiver(Protocol):
    """Owns the registration of one process's receive regions. `register_region` is called
    once per rank region at start-up; the memory must stay alive and mapped until `close`."""

    name: str

    def register_region(self, memory: Any, rank: int) -> RegionDescriptor: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------

_INSTALL_HINT = {
    "mooncake": "pip install 'kvrelay[mooncake]' (CPU build: mooncake-transfer-engine-non-cuda; "
    "GPU hosts: mooncake-transfer-engine)",
    "grpc": "pip install grpcio",
}


def transport_for_connector(kv_connector: str | None) -> TransportName:
    """Map the config's `kv_connector` to a transport; None (no kv_transfer_config) = gRPC stream."""
    if kv_connector is None:
        return "grpc"
    mapping: dict[str, TransportName] = {"MooncakeConnector": "mooncake", "CudaIpcConnector": "cuda_ipc"}
    try:
        return mapping[kv_connector]
    except KeyError:
        raise ValueError(
            f"unknown kv_connector {kv_connector!r}; expected one of {sorted(mapping)} or no kv_transfer_config"
        ) from None


def _load(name: str) -> Any:
    if name == "mooncake":
        from kvrelay.transfer import mooncake as mooncake_module

        mooncake_module.quiet_engine_info_log()
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the mooncake transport needs Mooncake: {_INSTALL_HINT['mooncake']}") from e
        return mooncake_module
    if name == "grpc":
        try:
            import grpc  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the grpc transport needs gRPC: {_INSTALL_HINT['grpc']}") from e
        from kvrelay.transfer import grpc_stream as grpc_module

        return grpc_module
    if name == "cuda_ipc":
        # Needs torch with a CUDA device; the module says so when it has none.
        from kvrelay.transfer import cuda_ipc as cuda_ipc_module

        return cuda_ipc_module
    raise ValueError(f"unknown transport {name!r}; expected 'mooncake', 'grpc' or 'cuda_ipc'")


def make_sender(name: str, **options: Any) -> KvSender:
    """A sender by transport name. mooncake options: hostname, protocol, device_name;
    grpc options: max_chunk_bytes; cuda_ipc options: device."""
    sender: KvSender = _load(name).make_sender(**options)
    return sender


def make_receiver(name: str, **options: Any) -> KvReceiver:
    """A receiver by transport name. mooncake options: hostname, protocol, device_name;
    grpc options: endpoint (the DiT service address peers dial)."""
    receiver: KvReceiver = _load(name).make_receiver(**options)
    return receiver


# ---------------------------------------------------------------------------------------------
# Helpers shared by the backends
# ---------------------------------------------------------------------------------------------


def not_started_outcomes(writes: Sequence[PlannedWrite], message: str) -> list[WriteOutcome]:
    """Outcomes for writes that never began (e.g. reported from a sender's `finally`)."""
    return [WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, message) for w in writes]


def staging_address(staging: Any) -> tuple[int, int]:
    """(address, length in bytes) of a contiguous host buffer: torch uint8 tensor or numpy array."""
    if hasattr(staging, "data_ptr"):
        if not staging.is_contiguous() or staging.element_size() != 1:
            raise ValueError("staging must be a contiguous uint8 tensor")
        if staging.device.type != "cpu":
            raise ValueError("staging must live in host memory (pinned on GPU hosts)")
        return int(staging.data_ptr()), int(staging.numel())
    if hasattr(staging, "ctypes") and hasattr(staging, "nbytes"):
        if not staging.flags["C_CONTIGUOUS"]:
            raise ValueError("staging must be a C-contiguous array")
        return int(staging.ctypes.data), int(staging.nbytes)
    raise TypeError(f"staging must be a torch uint8 tensor or a numpy array, got {type(staging).__name__}")


def check_writes_fit(
    writes: Sequence[PlannedWrite], destinations: Mapping[int, RegionDescriptor], staging_len: int
) -> None:
    """Raise before sending anything if a write's segments fall outside staging or its region."""
    for w in writes:
        if w.dst_rank not in destinations:
            raise ValueError(f"no region for destination rank {w.dst_rank} (write row={w.row} src={w.src_rank})")
        region = destinations[w.dst_rank]
        for s in w.segments:
            if s.src_offset + s.length > staging_len:
                raise ValueError(
                    f"write row={w.row} dst={w.dst_rank}: segment past the {staging_len}-byte staging buffer"
                )
            if s.dst_offset + s.length > region.length:
                raise ValueError(
                    f"write row={w.row} dst={w.dst_rank}: segment [{s.dst_offset}, {s.dst_offset + s.length}) "
                    f"past the {region.length}-byte region of rank {region.rank}"
                )
