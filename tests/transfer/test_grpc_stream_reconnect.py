"""The gRPC fallback sender dials afresh after a write failed to connect.

Found black-box with ARs and DiTs in network namespaces over the fallback transport: after the
AR -> DiT link was cut and restored, writes kept failing at once with `failed to connect to all
addresses` (9 of the next 40 requests) because the sender's cached channel waited out gRPC's
reconnect backoff, which grows to 2 minutes over a longer outage. A channel a call failed on
with UNAVAILABLE is now dropped (closed once its last call returns) and the next write connects
at once."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvrelay.server import reserve_free_port
from kvrelay.transfer.grpc_stream import GrpcStreamSender
from kvrelay.transfer.planner import PlannedWrite, Segment
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.v1 import dit_pb2, dit_pb2_grpc


class _Sink(dit_pb2_grpc.DitServiceServicer):
    def __init__(self) -> None:
        self.received = 0

    def PutKv(self, request_iterator: Iterator[dit_pb2.PutKvRequest], context: Any) -> dit_pb2.PutKvResponse:  # noqa: N802
        n = sum(len(chunk.data) for chunk in request_iterator)
        self.received += n
        return dit_pb2.PutKvResponse(bytes_received=n)


def _free_port() -> int:
    return reserve_free_port()


def test_a_write_after_the_peer_came_back_connects_at_once() -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    writes = [PlannedWrite(0, 0, 0, (Segment(0, 0, 4096),))]
    regions = {0: RegionDescriptor(0, "grpc", endpoint, 0, 1 << 20)}
    staging = bytearray(b"\x5a" * 4096)
    sender = GrpcStreamSender()
    server = None
    try:
        # Nothing listens: the write fails (connection refused) and gRPC backs off from the address.
        for _ in range(2):
            [outcome] = sender.write(staging, writes, regions, "t-1", timeout_s=5.0)
            assert outcome.status in ("FAILED", "NOT_STARTED") and "UNAVAILABLE" in outcome.message
        # The DiT is back at its address; the very next write must reach it (a channel in
        # reconnect backoff failed it at once, for up to its backoff).
        sink = _Sink()
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        dit_pb2_grpc.add_DitServiceServicer_to_server(sink, server)
        assert server.add_insecure_port(endpoint) == port
        server.start()
        [outcome] = sender.write(staging, writes, regions, "t-2", timeout_s=5.0)
        assert outcome.status == "OK", outcome.message
        assert sink.received == 4096
    finally:
        sender.close()
        if server is not None:
            server.stop(0)
