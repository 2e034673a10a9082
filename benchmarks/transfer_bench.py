"""Goodput of the KV transports on one host: Mooncake TCP vs the gRPC stream vs a raw TCP socket.

A receiver process holds one destination region (registered once with Mooncake, served by a
grpc.aio PutKv server and a raw socket server); this process sends. Each transfer is one
planned write of SIZE bytes (a contiguous page run, i.e. one segment, what the planner produces
for TP=n -> TP=n), timed from the call until the sender holds the transport's completion:
- mooncake: `MooncakeEndpoint.write` (xxh3 of the staging bytes, hashed while the batch is in
  flight; async submit, sleep through 75% of the predicted time, then the engine's wait);
- mooncake-spin: the same with sleep_fraction=0 (the engine's spinning sync call), optional;
- mooncake-engine: the bare `batch_transfer_sync_write`, to show what the kvrelay layer costs;
- grpc: `GrpcStreamSender.write` (1 MiB PutKv chunks, acknowledged when applied);
- raw-socket: sendall of the bytes, the receiver recv_into()s the region and answers one byte.
Sizes and transports are interleaved (every repetition visits every (size, transport) pair, in
a rotated order) so drift on a shared machine hits them alike. Prints a table of medians.

    .venv/bin/python benchmarks/transfer_bench.py --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import socket
import statistics
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20
DEFAULT_SIZES = [1, 4, 16, 32, 64, 128, 256]
TINY_BYTES = 16 * 1024  # a tiny row: e.g. 8 tokens of a small preset's KV
_HDR = struct.Struct("!QQ")


def _raw_server(region: Any, listener: socket.socket, stop: threading.Event) -> None:
    view = memoryview(region.numpy())
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                hdr = conn.recv(_HDR.size, socket.MSG_WAITALL)
                if len(hdr) < _HDR.size:
                    break
                offset, length = _HDR.unpack(hdr)
                got = 0
                while got < length:
                    n = conn.recv_into(view[offset + got : offset + length])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"\x01")


def grpc_server() -> Any:
    """The receiver's PutKv listener, with kvrelay's own server options (every kvrelay server's:
    kvrelay.security.server_options), above all its keepalive ping permits: the sender's channel
    pings every 15 s (kvrelay.security.Keepalive), and a plain server answers the second ping on a
    stream idle between sizes with GOAWAY too_many_pings."""
    import grpc

    from kvrelay.security import Credentials, server_options

    return grpc.aio.server(options=server_options(Credentials()))


def receiver_main(conn: Connection, region_bytes: int, protocol: str) -> None:
    import torch

    from kvrelay.transfer.grpc_stream import GrpcStreamReceiver
    from kvrelay.transfer.mooncake import endpoint
    from kvrelay.v1 import dit_pb2_grpc

    torch.set_num_threads(1)
    region = torch.zeros(region_bytes, dtype=torch.uint8)
    mc = endpoint("127.0.0.1", protocol)
    mooncake_region = mc.register_region(region, 0)
    stop = threading.Event()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    raw_thread = threading.Thread(target=_raw_server, args=(region, listener, stop), daemon=True)
    raw_thread.start()

    grpc_receiver = GrpcStreamReceiver("pending")
    port_box: list[int] = []
    ready = threading.Event()

    class Servicer(dit_pb2_grpc.DitServiceServicer):
        async def PutKv(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
            sink = grpc_receiver.sink()
            async for request in request_iterator:
                sink.apply(request)
            return sink.response()

    def serve() -> None:
        async def main() -> None:
            server = grpc_server()
            dit_pb2_grpc.add_DitServiceServicer_to_server(Servicer(), server)
            port_box.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(1)

        asyncio.run(main())

    grpc_thread = threading.Thread(target=serve, daemon=True)
    grpc_thread.start()
    ready.wait(30)
    grpc_receiver.endpoint = f"127.0.0.1:{port_box[0]}"
    grpc_region = grpc_receiver.register_region(region, 0)
    conn.send((mooncake_region, grpc_region, listener.getsockname()[1]))
    # Until "stop": answer "cpu" with this process's CPU seconds (all threads), for the profile.
    while conn.recv() == "cpu":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        conn.send(usage.ru_utime + usage.ru_stime)
    stop.set()
    grpc_thread.join(5)
    raw_thread.join(5)
    listener.close()
    mc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=DEFAULT_SIZES)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny-reps", type=int, default=50)
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--transports", nargs="+", default=["mooncake", "mooncake-engine", "grpc", "raw-socket"])
    args = ap.parse_args()

    import torch

    from kvrelay.transfer.grpc_stream import GrpcStreamSender
    from kvrelay.transfer.mooncake import endpoint
    from kvrelay.transfer.planner import PlannedWrite, Segment

    torch.set_num_threads(1)
    max_bytes = max(max(args.sizes_mib) * MiB, TINY_BYTES)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, max_bytes, args.protocol), daemon=True)
    proc.start()
    try:
        mooncake_region, grpc_region, raw_port = parent.recv()
        staging = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8)
        mc = endpoint("127.0.0.1", args.protocol)
        mc.register(staging)
        grpc_sender = GrpcStreamSender()
        raw = socket.create_connection(("127.0.0.1", raw_port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        staging_view = memoryview(staging.numpy())
        engine = mc._engine  # the bare engine call, for the overhead breakdown only

        cpu: dict[tuple[str, int], list[tuple[float, float]]] = {}

        def remote_cpu() -> float:
            parent.send("cpu")
            return float(parent.recv())

        def run(transport: str, nbytes: int) -> float:
            r0, s0 = remote_cpu(), time.process_time()
            elapsed = _run(transport, nbytes)
            s1, r1 = time.process_time(), remote_cpu()
            cpu.setdefault((transport, nbytes), []).append((s1 - s0, r1 - r0))
            return elapsed

        def _run(transport: str, nbytes: int) -> float:
            write = PlannedWrite(0, 0, 0, (Segment(0, 0, nbytes),))
            t0 = time.perf_counter()
            if transport == "mooncake":
                (out,) = mc.write(staging, [write], {0: mooncake_region}, "bench", 120.0)
                assert out.ok, out.message
            elif transport == "mooncake-engine":
                rc = engine.batch_transfer_sync_write(
                    mooncake_region.endpoint, [staging.data_ptr()], [mooncake_region.base_address], [nbytes]
                )
                assert rc == 0
            elif transport == "mooncake-spin":
                # The same write with the engine's spinning completion wait (sleep_fraction=0).
                saved, mc.sleep_fraction = mc.sleep_fraction, 0.0
                try:
                    (out,) = mc.write(staging, [write], {0: mooncake_region}, "bench", 120.0)
                finally:
                    mc.sleep_fraction = saved
                assert out.ok, out.message
            elif transport == "grpc":
                (out,) = grpc_sender.write(staging, [write], {0: grpc_region}, "bench", 120.0)
                assert out.ok, out.message
            elif transport == "raw-socket":
                raw.sendall(_HDR.pack(0, nbytes))
                raw.sendall(staging_view[:nbytes])
                assert raw.recv(1) == b"\x01"
            else:
                raise ValueError(transport)
            return time.perf_counter() - t0

        transports = list(args.transports)
        for t in transports:  # warm connections, handshakes and segment caches
            run(t, MiB)
        times: dict[tuple[str, int], list[float]] = {}
        for rep in range(args.reps):
            for size in args.sizes_mib:
                order = transports[rep % len(transports) :] + transports[: rep % len(transports)]
                for t in order:
                    times.setdefault((t, size), []).append(run(t, size * MiB))
        # Tiny rows twice: back to back (hot engine threads) and after an idle gap, which is how
        # a serving process sees them (one handoff per request, with gaps between).
        tiny: dict[str, list[float]] = {}
        tiny_idle: dict[str, list[float]] = {}
        for i in range(args.tiny_reps):
            for t in transports[i % len(transports) :] + transports[: i % len(transports)]:
                tiny.setdefault(t, []).append(_run(t, TINY_BYTES))
        for i in range(args.tiny_reps):
            for t in transports[i % len(transports) :] + transports[: i % len(transports)]:
                time.sleep(0.02)
                tiny_idle.setdefault(t, []).append(_run(t, TINY_BYTES))

        print(f"# transfer_bench: {args.reps} reps, interleaved, medians; protocol={args.protocol}")
        header = "| size | " + " | ".join(f"{t} GB/s" for t in transports) + " | " + " | ".join(
            f"{t} vs raw" for t in transports if t != "raw-socket"
        ) + " |"
        print(header)
        print("|" + "---|" * (1 + len(transports) + len(transports) - 1))
        for size in args.sizes_mib:
            gbps = {t: size * MiB / statistics.median(times[(t, size)]) / 1e9 for t in transports}
            raw_gbps = gbps.get("raw-socket")
            ratios = [
                f"{gbps[t] / raw_gbps:.2f}x" if raw_gbps else "n/a" for t in transports if t != "raw-socket"
            ]
            print(f"| {size} MiB | " + " | ".join(f"{gbps[t]:.2f}" for t in transports) + " | "
                  + " | ".join(ratios) + " |")
        print()
        print("CPU seconds per GiB moved (median; sender process / receiver process, all threads):")
        print("| size | " + " | ".join(transports) + " |")
        print("|" + "---|" * (1 + len(transports)))
        for size in args.sizes_mib:
            cells = []
            for t in transports:
                samples = cpu[(t, size * MiB)]
                per_gib = (1 << 30) / (size * MiB)
                snd = statistics.median(c[0] for c in samples) * per_gib
                rcv = statistics.median(c[1] for c in samples) * per_gib
                cells.append(f"{snd:.2f} / {rcv:.2f}")
            print(f"| {size} MiB | " + " | ".join(cells) + " |")
        print()
        print(f"fixed per-transfer overhead, tiny row ({TINY_BYTES // 1024} KiB), median of {args.tiny_reps}:")
        for t in transports:
            print(f"- {t}: {statistics.median(tiny[t]) * 1e6:.0f} us back to back, "
                  f"{statistics.median(tiny_idle[t]) * 1e6:.0f} us after 20 ms idle")
        raw.close()
        grpc_sender.close()
        parent.send("stop")
        proc.join(30)
        mc.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


if __name__ == "__main__":
    main()
