"""Test harness: a real sender process and a real receiver process on loopback.

The receiver holds one arena of host memory (registered once, as a DiT rank registers its pool)
and carves each scenario's per-rank pools out of it; for the gRPC fallback it also serves
DitService.PutKv with `apply_put_kv`. The sender packs each source rank's KV into a registered
staging arena and runs the real transport. The parent (the test) drives both over pipes.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvrelay.transfer.layout import KvGeometry, PageLayout
from kvrelay.transfer.planner import PlannedWrite, RowSpec, plan_transfer, staging_bytes

SENTINEL = 0x5A
ARENA_BYTES = 24 << 20


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    geometry: KvGeometry
    src_shards: int
    dst_shards: int
    rows: tuple[RowSpec, ...]
    num_pages: int

    def plan(self) -> tuple[PlannedWrite, ...]:
        return plan_transfer(self.geometry, self.src_shards, self.dst_shards, self.rows)

    def pool_bytes(self, rank: int) -> int:
        return PageLayout(self.geometry, self.dst_shards, rank).pool_bytes(self.num_pages)


def _scenarios() -> tuple[Scenario, ...]:
    g = KvGeometry(num_layers=3, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=8)
    # Two CFG rows: the prompt (not a multiple of page_size, one run of pages after a gap)
    # and the negative prompt (scattered pages, reserved before row 0's).
    rows = (RowSpec(0, 45, (2, 3, 4, 5, 6, 7)), RowSpec(1, 13, (9, 0)))
    out = [
        Scenario("tp1_to_tp1", g, 1, 1, rows, 11),
        Scenario("tp2_to_tp2", g, 2, 2, rows, 11),
        Scenario("tp2_to_tp1", g, 2, 1, rows, 11),
        Scenario("tp1_to_sp2", g, 1, 2, rows, 11),
    ]
    # TP=2 -> TP=1 with one-token pages: 2 * 2 * 600 = 2400 segments per write to one peer,
    # past Mooncake's 1024 queued-per-peer limit, so the sender must split batches.
    many = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=1)
    out.append(Scenario("many_segments_tp2_to_tp1", many, 2, 1, (RowSpec(0, 600, tuple(range(600))),), 601))
    # 8 MiB rows, twice: the first teaches the Mooncake sender the peer's goodput, the second
    # then takes the submit-sleep-wait path (batches of 1 MiB and more).
    big = KvGeometry(num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16)
    big_rows = (RowSpec(0, 1000, tuple(range(63))), RowSpec(1, 16, (63,)))
    out.append(Scenario("large_tp1_to_tp1_first", big, 1, 1, big_rows, 64))
    out.append(Scenario("large_tp1_to_tp1_second", big, 1, 1, big_rows, 64))
    return tuple(out)


SCENARIOS = _scenarios()


def row_kv(geometry: KvGeometry, spec: RowSpec) -> Any:
    """The full (all heads) KV of a row, deterministic: [L, 2, H, T, head_dim]."""
    import torch

    from kvrelay.transfer.pack import TORCH_DTYPES

    gen = torch.Generator().manual_seed(1_000 * spec.row + spec.num_tokens)
    g = geometry
    x = torch.randn(g.num_layers, 2, g.num_kv_heads, spec.num_tokens, g.head_dim, generator=gen)
    return x.to(TORCH_DTYPES[g.dtype])


def region_offsets() -> dict[tuple[int, int], int]:
    """Arena offset of (scenario index, rank): scenarios never share bytes."""
    offsets, at = {}, 0
    for i, sc in enumerate(SCENARIOS):
        for d in range(sc.dst_shards):
            offsets[(i, d)] = at
            at += sc.pool_bytes(d)
    assert at <= ARENA_BYTES
    return offsets


def _child_setup() -> None:
    import torch

    # 2-core CI machine: the parent, the sender and the receiver must not oversubscribe it.
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Receiver process
# ---------------------------------------------------------------------------------------------


def _serve_put_kv(receiver: Any, port_box: list[int], ready: threading.Event, stop: threading.Event) -> None:
    import grpc

    from kvrelay.transfer.grpc_stream import PutKvRejected
    from kvrelay.v1 import dit_pb2_grpc

    class Servicer(dit_pb2_grpc.DitServiceServicer):
        async def PutKv(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
            sink = receiver.sink()
            try:
                async for request in request_iterator:
                    sink.apply(request)
            except PutKvRejected as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return sink.response()

    async def main() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 4 << 20), ("grpc.max_send_message_length", 4 << 20)]
        )
        dit_pb2_grpc.add_DitServiceServicer_to_server(Servicer(), server)
        port_box.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.02)
        finally:
            await server.stop(1)

    asyncio.run(main())


def receiver_main(conn: Connection, transport: str) -> None:
    _child_setup()
    import torch

    from kvrelay.transfer.checksum import verify_write_until
    from kvrelay.transfer.transport import make_receiver

    arena = torch.full((ARENA_BYTES,), SENTINEL, dtype=torch.uint8)
    offsets = region_offsets()
    stop = threading.Event()
    server_thread = None
    try:
        if transport == "grpc":
            from kvrelay.transfer.grpc_stream import GrpcStreamReceiver

            port_box: list[int] = []
            ready = threading.Event()
            endpoint_holder: dict[str, Any] = {}
            receiver = GrpcStreamReceiver("pending")
            endpoint_holder["r"] = receiver
            server_thread = threading.Thread(target=_serve_put_kv, args=(receiver, port_box, ready, stop), daemon=True)
            server_thread.start()
            if not ready.wait(30):
                raise RuntimeError("PutKv server did not start")
            receiver.endpoint = f"127.0.0.1:{port_box[0]}"
        else:
            receiver = make_receiver(transport, hostname="127.0.0.1")
            # The whole arena registered once, before any sender connects.
            receiver.register_region(arena, rank=-1)

        def pool(i: int, d: int) -> Any:
            off = offsets[(i, d)]
            return arena[off : off + SCENARIOS[i].pool_bytes(d)]

        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            try:
                if cmd == "stop":
                    conn.send(("ok", None))
                    return
                if cmd == "describe":
                    i = arg
                    conn.send(("ok", [receiver.register_region(pool(i, d), d) for d in range(SCENARIOS[i].dst_shards)]))
                elif cmd == "verify":
                    i, writes, checksums, timeout_s = arg
                    conn.send(("ok", [verify_write_until(pool(i, w.dst_rank), w, c, timeout_s)
                                      for w, c in zip(writes, checksums, strict=True)]))
                elif cmd == "dump":
                    i = arg
                    conn.send(("ok", {d: bytes(pool(i, d).numpy()) for d in range(SCENARIOS[i].dst_shards)}))
                elif cmd == "corrupt":
                    i, d, offset = arg
                    pool(i, d)[offset] ^= 0xFF
                    conn.send(("ok", None))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        stop.set()
        if server_thread is not None:
            server_thread.join(10)
        receiver.close()


# ---------------------------------------------------------------------------------------------
# Sender process
# ---------------------------------------------------------------------------------------------


def sender_main(conn: Connection, transport: str) -> None:
    _child_setup()
    import torch

    from kvrelay.transfer.pack import pack_staging
    from kvrelay.transfer.transport import make_sender

    sender = make_sender(transport, hostname="127.0.0.1") if transport == "mooncake" else make_sender(transport)
    staging_arena = torch.zeros(12 << 20, dtype=torch.uint8)
    if transport == "mooncake":
        sender.register(staging_arena)  # type: ignore[attr-defined]
    try:
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            try:
                if cmd == "stop":
                    conn.send(("ok", None))
                    return
                if cmd == "send":
                    i, destinations, timeout_s = arg
                    sc = SCENARIOS[i]
                    plan = sc.plan()
                    outcomes = []
                    full = {r.row: row_kv(sc.geometry, r) for r in sc.rows}
                    at = 0
                    for s in range(sc.src_shards):
                        # Each source rank gets its own staging range, as each AR rank has its own buffer.
                        n = staging_bytes(plan, s)
                        staging = staging_arena[at : at + n]
                        at += n
                        lo, hi = sc.geometry.head_range(sc.src_shards, s)
                        kv = {row: t[:, :, lo:hi].contiguous() for row, t in full.items()}
                        pack_staging(staging, kv, sc.geometry, sc.src_shards, sc.dst_shards, sc.rows, plan, s)
                        mine = [w for w in plan if w.src_rank == s]
                        outcomes += sender.write(staging, mine, destinations, f"ticket-{sc.name}", timeout_s)
                    conn.send(("ok", outcomes))
                elif cmd == "goodput":
                    conn.send(("ok", dict(getattr(sender, "_goodput", {}))))
                elif cmd == "send_raw":
                    writes, destinations, timeout_s = arg
                    conn.send(("ok", sender.write(staging_arena, writes, destinations, "ticket-raw", timeout_s)))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        sender.close()
