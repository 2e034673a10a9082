"""Conversions between the transfer plane's dataclasses and the kvrelay.v1 protos.

The only place that knows both shapes, so that pb2 types never leak into the pure planner and
dataclasses never go on the wire. Enum mappings are total: an UNSPECIFIED value raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from kvrelay.transfer.layout import DTypeName, KvGeometry
from kvrelay.transfer.planner import PlannedWrite, RowSpec, Segment
from kvrelay.transfer.transport import RegionDescriptor, TransportName, WriteOutcome, WriteStatusName
from kvrelay.v1 import broker_pb2, common_pb2

_DTYPE_TO_PB: dict[str, int] = {
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}

_TRANSPORT_TO_PB: dict[str, int] = {
    "mooncake": common_pb2.TRANSPORT_KIND_MOONCAKE,
    "grpc": common_pb2.TRANSPORT_KIND_GRPC_STREAM,
    "cuda_ipc": common_pb2.TRANSPORT_KIND_CUDA_IPC,
}
_TRANSPORT_FROM_PB = {v: k for k, v in _TRANSPORT_TO_PB.items()}

_STATUS_TO_PB: dict[str, int] = {
    "OK": common_pb2.WRITE_STATUS_OK,
    "FAILED": common_pb2.WRITE_STATUS_FAILED,
    "NOT_STARTED": common_pb2.WRITE_STATUS_NOT_STARTED,
    "IN_DOUBT": common_pb2.WRITE_STATUS_IN_DOUBT,
}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}


def _lookup(table: dict[int, str], value: int, what: str) -> str:
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"{what} {value} is unspecified or unknown") from None


def geometry_to_proto(g: KvGeometry) -> common_pb2.KvGeometry:
    return common_pb2.KvGeometry(
        num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
        dtype=_DTYPE_TO_PB[g.dtype], page_size=g.page_size,  # type: ignore[arg-type]
    )


def geometry_from_proto(pb: common_pb2.KvGeometry) -> KvGeometry:
    return KvGeometry(
        num_layers=pb.num_layers, num_kv_heads=pb.num_kv_heads, head_dim=pb.head_dim,
        dtype=cast(DTypeName, _lookup(_DTYPE_FROM_PB, pb.dtype, "KvGeometry.dtype")), page_size=pb.page_size,
    )


def row_to_proto(r: RowSpec) -> common_pb2.RowPages:
    return common_pb2.RowPages(row=r.row, num_tokens=r.num_tokens, page_ids=list(r.page_ids))


def row_from_proto(pb: common_pb2.RowPages) -> RowSpec:
    return RowSpec(row=pb.row, num_tokens=pb.num_tokens, page_ids=tuple(pb.page_ids))


def write_to_proto(w: PlannedWrite) -> common_pb2.PlannedWrite:
    return common_pb2.PlannedWrite(
        row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
        segments=[common_pb2.Segment(src_offset=s.src_offset, dst_offset=s.dst_offset, length=s.length)
                  for s in w.segments],
    )


def write_from_proto(pb: common_pb2.PlannedWrite) -> PlannedWrite:
    return PlannedWrite(
        row=pb.row, src_rank=pb.src_rank, dst_rank=pb.dst_rank,
        segments=tuple(Segment(s.src_offset, s.dst_offset, s.length) for s in pb.segments),
    )


def writes_from_proto(pbs: Iterable[common_pb2.PlannedWrite]) -> tuple[PlannedWrite, ...]:
    return tuple(write_from_proto(pb) for pb in pbs)


def region_to_proto(r: RegionDescriptor) -> common_pb2.MemoryRegion:
    return common_pb2.MemoryRegion(
        rank=r.rank, transport=_TRANSPORT_TO_PB[r.transport],  # type: ignore[arg-type]
        endpoint=r.endpoint, base_address=r.base_address, length=r.length,
        ipc_handle=getattr(r, "ipc_handle", b""),
    )


def region_from_proto(pb: common_pb2.MemoryRegion) -> RegionDescriptor:
    return RegionDescriptor(
        rank=pb.rank,
        transport=cast(TransportName, _lookup(_TRANSPORT_FROM_PB, pb.transport, "MemoryRegion.transport")),
        endpoint=pb.endpoint, base_address=pb.base_address, length=pb.length, ipc_handle=bytes(pb.ipc_handle),
    )


def outcome_to_progress(o: WriteOutcome) -> broker_pb2.WriteProgress:
    return broker_pb2.WriteProgress(
        row=o.row, src_rank=o.src_rank, dst_rank=o.dst_rank,
        status=_STATUS_TO_PB[o.status], checksum=o.checksum, bytes=o.bytes,  # type: ignore[arg-type]
    )


def outcome_from_progress(pb: broker_pb2.WriteProgress, message: str = "") -> WriteOutcome:
    return WriteOutcome(
        row=pb.row, src_rank=pb.src_rank, dst_rank=pb.dst_rank,
        status=cast(WriteStatusName, _lookup(_STATUS_FROM_PB, pb.status, "WriteProgress.status")),
        bytes=pb.bytes, checksum=pb.checksum, message=message,
    )


def outcome_to_report(
    o: WriteOutcome, ticket_id: str, replica_id: str, incarnation_id: str
) -> broker_pb2.ReportWriteRequest:
    """The AR's ReportWrite for one outcome."""
    return broker_pb2.ReportWriteRequest(
        ticket_id=ticket_id, row=o.row, src_rank=o.src_rank, dst_rank=o.dst_rank,
        replica_id=replica_id, incarnation_id=incarnation_id,
        status=_STATUS_TO_PB[o.status], checksum=o.checksum, bytes=o.bytes, message=o.message,  # type: ignore[arg-type]
    )


def outcomes_to_report(
    outcomes: Sequence[WriteOutcome], ticket_id: str, replica_id: str, incarnation_id: str
) -> broker_pb2.ReportWriteRequest:
    """The AR's ReportWrite for several outcomes of one ticket (one call, one broker commit)."""
    return broker_pb2.ReportWriteRequest(
        ticket_id=ticket_id, replica_id=replica_id, incarnation_id=incarnation_id,
        writes=[
            broker_pb2.WriteReport(
                row=o.row, src_rank=o.src_rank, dst_rank=o.dst_rank, status=_STATUS_TO_PB[o.status],  # type: ignore[arg-type]
                checksum=o.checksum, bytes=o.bytes, message=o.message,
            )
            for o in outcomes
        ],
    )
