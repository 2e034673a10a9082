"""Packing, checksums, PutKv application and proto conversions, in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.transfer import convert
from kvrelay.transfer.checksum import checksum_bytes, verify_write, write_checksum
from kvrelay.transfer.grpc_stream import PutKvRejected, PutKvSink, apply_put_kv
from kvrelay.transfer.layout import KvGeometry, PageLayout
from kvrelay.transfer.pack import TORCH_DTYPES, pack_staging, read_row
from kvrelay.transfer.planner import RowSpec, plan_transfer, staging_bytes
from kvrelay.transfer.transport import RegionDescriptor, WriteOutcome, transport_for_connector
from kvrelay.v1 import dit_pb2


def _full_kv(g: KvGeometry, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.num_layers, 2, g.num_kv_heads, num_tokens, g.head_dim, generator=gen)
    return x.to(TORCH_DTYPES[g.dtype])


def _move(g, src_shards, dst_shards, rows, num_pages):
    """Pack every source rank, execute the plan with plain copies; return (full kv, pools, plan, stagings)."""
    plan = plan_transfer(g, src_shards, dst_shards, rows)
    full = {r.row: _full_kv(g, r.num_tokens, seed=r.row + 7) for r in rows}
    stagings = {}
    for s in range(src_shards):
        lo, hi = g.head_range(src_shards, s)
        staging = torch.full((staging_bytes(plan, s),), 0xEE, dtype=torch.uint8)
        kv = {row: t[:, :, lo:hi].contiguous() for row, t in full.items()}
        assert pack_staging(staging, kv, g, src_shards, dst_shards, rows, plan, s) == staging.numel()
        stagings[s] = staging
    pools = {
        d: torch.zeros(PageLayout(g, dst_shards, d).pool_bytes(num_pages), dtype=torch.uint8)
        for d in range(dst_shards)
    }
    for w in plan:
        for seg in w.segments:
            pools[w.dst_rank][seg.dst_offset : seg.dst_offset + seg.length] = stagings[w.src_rank][
                seg.src_offset : seg.src_offset + seg.length
            ]
    return full, pools, plan, stagings


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([2, 4]), shards=st.sampled_from([(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (1, 4)]),
    layers=st.integers(1, 3), head_dim=st.sampled_from([2, 8]), page_size=st.integers(1, 5),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]), t0=st.integers(1, 17), t1=st.integers(1, 17),
)
def test_pack_then_plan_copies_reproduce_each_ranks_heads(heads, shards, layers, head_dim, page_size, dtype, t0, t1):
    src_shards, dst_shards = shards
    if heads % src_shards or heads % dst_shards:
        return
    g = KvGeometry(layers, heads, head_dim, dtype, page_size)
    n0, n1 = g.pages_for(t0), g.pages_for(t1)
    # Row 1's pages before row 0's and non-contiguous, as a real reservation may hand out.
    rows = [RowSpec(0, t0, tuple(range(n1 + 1, n1 + 1 + n0))), RowSpec(1, t1, tuple(range(n1 - 1, -1, -1)))]
    full, pools, plan, stagings = _move(g, src_shards, dst_shards, rows, n0 + n1 + 2)
    for d in range(dst_shards):
        layout = PageLayout(g, dst_shards, d)
        lo, hi = g.head_range(dst_shards, d)
        for r in rows:
            got = read_row(pools[d], layout, r)
            assert torch.equal(got.view(torch.uint8), full[r.row][:, :, lo:hi].contiguous().view(torch.uint8))
        # The spare page between the rows was never written.
        spare = pools[d].view(-1, layout.page_bytes)[n1]
        assert int(spare.count_nonzero()) == 0
    for w in plan:
        assert verify_write(pools[w.dst_rank], w, write_checksum(stagings[w.src_rank], w))


def test_padding_is_zero_and_a_corrupted_byte_fails_verification() -> None:
    g = KvGeometry(2, 2, 4, "bfloat16", 4)
    rows = [RowSpec(0, 5, (0, 1)), RowSpec(1, 3, (2,))]
    _, pools, plan, stagings = _move(g, 1, 1, rows, 3)
    layout = PageLayout(g, 1, 0)
    pages = pools[0].view(torch.bfloat16).view(3, 2, 2, 2, 4, 4)
    assert int(pages[1, :, :, :, 1:].count_nonzero()) == 0  # row 0: tokens 5..7 of page 1
    assert int(pages[2, :, :, :, 3:].count_nonzero()) == 0
    w = plan[0]
    good = write_checksum(stagings[0], w)
    assert verify_write(pools[0], w, good)
    pools[0][layout.offset(1, 1, 1, 1, 2) + 3] ^= 0x01
    assert not verify_write(pools[0], w, good)
    # Row 1's write does not cover the corrupted byte and still verifies.
    assert verify_write(pools[0], plan[1], write_checksum(stagings[0], plan[1]))


def test_pack_rejects_wrong_shapes_and_small_staging() -> None:
    g = KvGeometry(1, 2, 2, "float16", 2)
    rows = [RowSpec(0, 3, (0, 1))]
    plan = plan_transfer(g, 1, 1, rows)
    kv = {0: torch.zeros(1, 2, 2, 3, 2, dtype=torch.float16)}
    with pytest.raises(ValueError, match="needs"):
        pack_staging(torch.zeros(4, dtype=torch.uint8), kv, g, 1, 1, rows, plan, 0)
    staging = torch.zeros(staging_bytes(plan, 0), dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype"):
        pack_staging(staging, {0: kv[0].float()}, g, 1, 1, rows, plan, 0)
    with pytest.raises(ValueError, match="shape"):
        pack_staging(staging, {0: kv[0][:, :, :, :2]}, g, 1, 1, rows, plan, 0)


def test_apply_put_kv_copies_in_bounds_and_rejects_out_of_region() -> None:
    region = torch.zeros(64, dtype=torch.uint8)
    req = dit_pb2.PutKvRequest(ticket_id="t", row=0, src_rank=0, dst_rank=0, dst_offset=60, data=b"\x01\x02\x03\x04")
    assert apply_put_kv(region, req, 64) == 4
    assert region[60:].tolist() == [1, 2, 3, 4]
    with pytest.raises(PutKvRejected, match="outside the 64-byte region"):
        apply_put_kv(region, dit_pb2.PutKvRequest(dst_offset=61, data=b"abcd"), 64)
    # region_length narrower than the memory (e.g. a pool view) is what bounds the write.
    with pytest.raises(PutKvRejected, match="outside"):
        apply_put_kv(region, dit_pb2.PutKvRequest(dst_offset=30, data=b"abcd"), 32)
    with pytest.raises(PutKvRejected, match="reserved"):
        apply_put_kv(region, dit_pb2.PutKvRequest(dst_offset=8, data=b"ab"), 64, allowed_ranges=[(0, 8), (16, 32)])
    with pytest.raises(PutKvRejected, match="limit"):
        apply_put_kv(bytearray(3 << 20), dit_pb2.PutKvRequest(dst_offset=0, data=bytes((1 << 20) + 1)), 3 << 20)
    assert int(region[:60].count_nonzero()) == 0
    buf = bytearray(16)
    sink = PutKvSink({1: (buf, 16)})
    sink.apply(dit_pb2.PutKvRequest(ticket_id="t", dst_rank=1, dst_offset=2, data=b"xy"))
    assert bytes(buf[2:4]) == b"xy" and sink.response().bytes_received == 2
    with pytest.raises(PutKvRejected, match="does not hold"):
        sink.apply(dit_pb2.PutKvRequest(dst_rank=0, data=b"x"))


def test_checksum_is_xxh3_of_bytes_in_segment_order() -> None:
    import xxhash

    data = np.arange(100, dtype=np.uint8)
    assert checksum_bytes(data) == xxhash.xxh3_64_intdigest(data.tobytes())
    g = KvGeometry(1, 2, 2, "float32", 1)
    plan = plan_transfer(g, 2, 1, [RowSpec(0, 2, (1, 0))])
    staging = torch.arange(staging_bytes(plan, 0), dtype=torch.uint8)
    w = plan[0]
    expect = xxhash.xxh3_64_intdigest(b"".join(bytes(staging[s.src_offset : s.src_offset + s.length].numpy())
                                               for s in w.segments))
    assert write_checksum(staging, w) == expect


def test_proto_round_trips() -> None:
    g = KvGeometry(3, 4, 8, "bfloat16", 16)
    assert convert.geometry_from_proto(convert.geometry_to_proto(g)) == g
    rows = [RowSpec(0, 40, (5, 6, 7)), RowSpec(1, 3, (1,))]
    assert [convert.row_from_proto(convert.row_to_proto(r)) for r in rows] == rows
    plan = plan_transfer(g, 2, 1, rows)
    assert convert.writes_from_proto(convert.write_to_proto(w) for w in plan) == plan
    region = RegionDescriptor(1, "mooncake", "127.0.0.1:1234", 2**47 + 5, 1 << 30)
    assert convert.region_from_proto(convert.region_to_proto(region)) == region
    out = WriteOutcome(1, 0, 1, "FAILED", 10, 2**64 - 1, "boom")
    assert convert.outcome_from_progress(convert.outcome_to_progress(out), "boom") == out
    report = convert.outcome_to_report(out, "tk", "ar-0", "inc")
    assert (report.ticket_id, report.checksum, report.message) == ("tk", 2**64 - 1, "boom")
    pb = convert.geometry_to_proto(g)
    pb.dtype = 0
    with pytest.raises(ValueError, match="unspecified"):
        convert.geometry_from_proto(pb)


def test_connector_names_map_to_transports() -> None:
    assert transport_for_connector("MooncakeConnector") == "mooncake"
    assert transport_for_connector(None) == "grpc"
    with pytest.raises(ValueError, match="unknown kv_connector"):
        transport_for_connector("NixlConnector")


def test_grpc_receiver_describes_numpy_and_tensor_regions() -> None:
    import numpy as np

    from kvrelay.transfer.grpc_stream import GrpcStreamReceiver

    receiver = GrpcStreamReceiver("127.0.0.1:1")
    # numpy 2 arrays carry `.device == "cpu"` (a string): they are host memory like CPU tensors.
    assert receiver.register_region(np.zeros(100, dtype=np.uint8), 0).length == 100
    assert receiver.register_region(torch.zeros(64, dtype=torch.uint8), 1).length == 64
