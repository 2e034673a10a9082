"""`kvrelay verify`: the seed's bit-for-bit accuracy check, reproducible with one command.

For a non-zero prefix prefilled by the built-in AR, the pages that land in a separate receiver
process over Mooncake are compared with the pages that land over the gRPC-stream fallback, with the
pages written locally by executing the same plan with plain copies, and with the pages written
straight from the dense local prefill (no planner at all); then the DiT attention over the prefix
read from each is compared, layer by layer, and one full DiT velocity evaluation. Prints exactly
the seed's three lines on stdout (details go to stderr) and exits non-zero on any difference.

A composition root like the CLI: it runs the AR model, the transfer plane and the DiT model.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

RECEIVE_TIMEOUT_S = 30.0


def _log(msg: str) -> None:
    print(f"verify: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# The receiving process: one region per destination rank for each transport
# ------------------------------------------------------------------------------------------------


def _serve_put_kv(sinks: Any, port_box: list[int], ready: threading.Event, stop: threading.Event) -> None:
    import grpc

    from kvrelay.security import Credentials, server_options
    from kvrelay.transfer.grpc_stream import PutKvRejected
    from kvrelay.v1 import dit_pb2_grpc

    class PutKvOnly(dit_pb2_grpc.DitServiceServicer):
        async def PutKv(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            sink = sinks.sink()
            try:
                async for request in request_iterator:
                    sink.apply(request)
            except PutKvRejected as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            return sink.response()

    async def main() -> None:
        # In-process loopback receiver of this check only: plaintext, explicit size limits.
        server = grpc.aio.server(options=server_options(Credentials()))
        dit_pb2_grpc.add_DitServiceServicer_to_server(PutKvOnly(), server)
        port_box.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(1)

    asyncio.run(main())


def receiver_main(conn: Connection, pool_bytes: int, dst_shards: int, device: str = "cpu") -> None:
    import torch

    torch.set_num_threads(1)
    from kvrelay.transfer.checksum import verify_write_until
    from kvrelay.transfer.grpc_stream import GrpcStreamReceiver
    from kvrelay.transfer.transport import make_receiver

    pools = {
        "mooncake": [torch.zeros(pool_bytes, dtype=torch.uint8) for _ in range(dst_shards)],
        "grpc": [torch.zeros(pool_bytes, dtype=torch.uint8) for _ in range(dst_shards)],
    }
    ipc: Any = None
    if device.startswith("cuda"):
        # Device-resident pools, written by the sender's GPU copies through CUDA IPC.
        pools["cuda_ipc"] = [torch.zeros(pool_bytes, dtype=torch.uint8, device=device) for _ in range(dst_shards)]
        ipc = make_receiver("cuda_ipc", device=device)
    stop = threading.Event()
    mooncake = make_receiver("mooncake", hostname="127.0.0.1")
    grpc_receiver = GrpcStreamReceiver("pending")
    port_box: list[int] = []
    ready = threading.Event()
    server = threading.Thread(target=_serve_put_kv, args=(grpc_receiver, port_box, ready, stop), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("PutKv server did not start")
        grpc_receiver.endpoint = f"127.0.0.1:{port_box[0]}"
        described = {
            "mooncake": [mooncake.register_region(p, d) for d, p in enumerate(pools["mooncake"])],
            "grpc": [grpc_receiver.register_region(p, d) for d, p in enumerate(pools["grpc"])],
        }
        if ipc is not None:
            described["cuda_ipc"] = [ipc.register_region(p, d) for d, p in enumerate(pools["cuda_ipc"])]
        conn.send(("ok", described))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                conn.send(("ok", None))
                return
            try:
                if cmd == "verify":
                    transport, writes, checksums = arg
                    if transport == "cuda_ipc":
                        from kvrelay.transfer.cuda_ipc import verify_writes

                        # The device checksum, computed on the receiver's GPU over its pool.
                        conn.send(("ok", [
                            verify_writes(pools[transport][w.dst_rank], [w])[0] == c
                            for w, c in zip(writes, checksums, strict=True)
                        ]))
                        continue
                    conn.send(("ok", [
                        verify_write_until(pools[transport][w.dst_rank], w, c, RECEIVE_TIMEOUT_S)
                        for w, c in zip(writes, checksums, strict=True)
                    ]))
                elif cmd == "dump":
                    conn.send(("ok", {t: [bytes(p.cpu().numpy()) for p in ps] for t, ps in pools.items()}))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
                conn.send(("error", traceback.format_exc()))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
    finally:
        stop.set()
        server.join(10)
        mooncake.close()
        grpc_receiver.close()
        if ipc is not None:
            ipc.close()


def _call(conn: Connection, cmd: str, arg: Any = None, timeout: float = 120.0) -> Any:
    conn.send((cmd, arg))
    if not conn.poll(timeout):
        raise TimeoutError(f"receiver did not answer {cmd!r} in {timeout}s")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"receiver failed {cmd!r}:\n{value}")
    return value


# ------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------


def run_check(
    preset_name: str = "tiny",
    prompt: str = "a red fox in the snow, watercolor",
    negative_prompt: str = "blurry",
    ar_tp: int = 1,
    dit_tp: int = 1,
    dit_sp: int = 1,
    seed: int = 0,
    page_size: int = 16,
    flip_byte_in: str | None = None,
    device: str = "cpu",
    dit_cfg: int = 1,
) -> dict[str, Any]:
    """Run the check; `flip_byte_in` names a variant whose pages get one byte flipped after they
    arrive (the check's own self-test: it must then report a difference).

    `dit_cfg` 2: the receiver is a CFG-parallel DiT (2 groups of dit_tp * dit_sp ranks; rank
    g * shards + s holds head shard s of row g only): each row lands only on its group's ranks,
    and every byte of every rank's pool (the other row's pages included, which must stay zero)
    is compared with the dense reference."""
    import torch

    from kvrelay.models.ar import build_ar_model
    from kvrelay.models.dit import DitRunner
    from kvrelay.models.paged_attention import prefix_attention, read_prefix, write_prefix
    from kvrelay.models.presets import get_preset
    from kvrelay.models.tokenizer import ByteTokenizer
    from kvrelay.transfer.checksum import write_checksum
    from kvrelay.transfer.layout import PageLayout
    from kvrelay.transfer.pack import pack_staging
    from kvrelay.transfer.planner import RowSpec, cfg_group, plan_transfer, staging_bytes
    from kvrelay.transfer.transport import make_sender

    preset = get_preset(preset_name)
    dst_shards = dit_tp * dit_sp
    dst_ranks = dit_cfg * dst_shards
    geometry = preset.kv_geometry(page_size)
    tokenizer = ByteTokenizer()
    on_gpu = device.startswith("cuda")
    ar = build_ar_model(preset=preset_name, seed=seed, device=device)
    # Both rows in one batched prefill (a captured graph on a GPU), as the AR service runs them.
    kv_dev = dict(enumerate(ar.prefill_batch([tokenizer.encode(prompt), tokenizer.encode(negative_prompt)])))
    kv_full = {row: kv.cpu() for row, kv in kv_dev.items()}
    del ar
    if not all(bool(kv.abs().sum() > 0) for kv in kv_full.values()):
        raise RuntimeError("the prefill produced an all-zero prefix: nothing would be checked")
    # Non-contiguous, out-of-order pages: a plan must honour the broker's page ids exactly.
    rows, cursor = [], 1
    for row, kv in kv_full.items():
        n = int(kv.shape[3])
        pages = geometry.pages_for(n)
        rows.append(RowSpec(row, n, tuple(reversed(range(cursor, cursor + pages)))))
        cursor += pages + 2
    num_pages = cursor + 1
    # Rank d holds head shard d % dst_shards (of its CFG group's rows).
    layouts = [PageLayout(geometry, dst_shards, d % dst_shards) for d in range(dst_ranks)]
    pool_bytes = layouts[0].page_bytes * num_pages
    plan = plan_transfer(geometry, ar_tp, dst_shards, rows, cfg_parallel=dit_cfg)
    per_rank = [sum(w.num_bytes for w in plan if w.dst_rank == d) for d in range(dst_ranks)]
    _log(f"preset={preset_name} tokens={[r.num_tokens for r in rows]} AR TP={ar_tp} -> DiT shards={dst_shards} "
         f"x CFG groups={dit_cfg} writes={len(plan)} bytes={sum(per_rank)} bytes per DiT rank={per_rank}")

    # Pack every source rank's share into its own staging buffer, as each AR rank does.
    stagings = {}
    for s in range(ar_tp):
        lo, hi = geometry.head_range(ar_tp, s)
        staging = torch.zeros(staging_bytes(plan, s), dtype=torch.uint8)
        pack_staging(staging, {r: kv[:, :, lo:hi].contiguous() for r, kv in kv_full.items()},
                     geometry, ar_tp, dst_shards, rows, plan, s)
        stagings[s] = staging
    device_stagings = {}
    if on_gpu:
        # CUDA IPC packs on the device, from the KV where the prefill left it.
        for s in range(ar_tp):
            lo, hi = geometry.head_range(ar_tp, s)
            staging = torch.zeros(staging_bytes(plan, s), dtype=torch.uint8, device=device)
            pack_staging(staging, {r: kv[:, :, lo:hi].contiguous() for r, kv in kv_dev.items()},
                         geometry, ar_tp, dst_shards, rows, plan, s)
            device_stagings[s] = staging

    # Local reference 1: the plan executed with plain copies.
    planned = [torch.zeros(pool_bytes, dtype=torch.uint8) for _ in range(dst_ranks)]
    for w in plan:
        for seg in w.segments:
            planned[w.dst_rank][seg.dst_offset : seg.dst_offset + seg.length] = \
                stagings[w.src_rank][seg.src_offset : seg.src_offset + seg.length]
    # Local reference 2: the dense prefill written straight into pages (no planner, no staging).
    dense = [torch.zeros(pool_bytes, dtype=torch.uint8) for _ in range(dst_ranks)]
    for d, layout in enumerate(layouts):
        h_lo, h_hi = geometry.head_range(dst_shards, layout.shard)
        for spec in rows:
            if cfg_group(spec.row, dit_cfg) != d // dst_shards:
                continue  # a CFG-parallel rank never reads the other group's row: its pages stay zero
            kv = kv_full[spec.row]
            write_prefix(dense[d], layout, spec.page_ids,
                         [(kv[layer, 0, h_lo:h_hi], kv[layer, 1, h_lo:h_hi]) for layer in range(geometry.num_layers)])

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, pool_bytes, dst_ranks, device), daemon=True)
    proc.start()
    received: dict[str, list[bytes]] = {}
    try:
        if not parent.poll(60):
            raise TimeoutError("receiver process did not start")
        status, described = parent.recv()
        if status != "ok":
            raise RuntimeError(f"receiver failed to start:\n{described}")
        for transport in ("mooncake", "grpc", *(("cuda_ipc",) if on_gpu else ())):
            if transport == "mooncake":
                sender = make_sender(transport, hostname="127.0.0.1")
            elif transport == "cuda_ipc":
                sender = make_sender(transport, device=device)
            else:
                sender = make_sender(transport)
            sources = device_stagings if transport == "cuda_ipc" else stagings
            try:
                destinations = {region.rank: region for region in described[transport]}
                outcomes = []
                for s, staging in sources.items():
                    outcomes += sender.write(staging, [w for w in plan if w.src_rank == s], destinations,
                                             f"verify-{transport}", RECEIVE_TIMEOUT_S)
            finally:
                sender.close()
            failed = [o for o in outcomes if not o.ok]
            if failed:
                raise RuntimeError(f"{transport}: writes failed: {failed}")
            if transport == "cuda_ipc":
                from kvrelay.transfer.cuda_ipc import write_checksum as device_write_checksum

                expected = [device_write_checksum(device_stagings[w.src_rank], w) for w in plan]
            else:
                expected = [write_checksum(stagings[w.src_rank], w) for w in plan]
            reported = {(o.row, o.src_rank, o.dst_rank): o.checksum for o in outcomes}
            if [reported.get((w.row, w.src_rank, w.dst_rank)) for w in plan] != expected:
                raise RuntimeError(f"{transport}: the sender's checksums differ from the staging bytes")
            verified = _call(parent, "verify", (transport, list(plan), expected))
            _log(f"{transport}: {len(outcomes)} writes OK, receiver verified {sum(verified)}/{len(verified)}")
            if not all(verified):
                raise RuntimeError(f"{transport}: the receiver's bytes do not match the writer's checksums")
        received = _call(parent, "dump")
        _call(parent, "stop")
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    variants = {
        name: [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in pools] for name, pools in received.items()
    }
    variants |= {"local_plan": planned, "local_prefill": dense}
    if flip_byte_in is not None:
        first = rows[0].page_ids[0] * layouts[0].page_bytes
        variants[flip_byte_in][0][first + 5] ^= 0x40
    prefix_bits_equal = all(
        torch.equal(variants[name][d], dense[d]) for name in variants for d in range(dst_ranks)
    )

    # Attention over each variant's prefix (read back from its pages, every shard's heads joined)
    # against the same attention over the dense prefill tensors.
    def prefix_rows_of(pools: list[Any]) -> list[list[tuple[Any, Any]]]:
        out = []
        for spec in rows:
            base = cfg_group(spec.row, dit_cfg) * dst_shards  # the ranks of the row's CFG group
            shards = [read_prefix(pools[base + s], layouts[base + s], spec.page_ids, spec.num_tokens)
                      for s in range(dst_shards)]
            out.append([(torch.cat([s[layer][0] for s in shards]), torch.cat([s[layer][1] for s in shards]))
                        for layer in range(geometry.num_layers)])
        return out

    reference_rows = [[(kv_full[r.row][layer, 0], kv_full[r.row][layer, 1]) for layer in range(geometry.num_layers)]
                      for r in rows]
    gen = torch.Generator().manual_seed(1234)
    n_img, heads_q = 64, preset.dit.num_heads
    dtype = kv_full[0].dtype
    q = torch.randn(len(rows), heads_q, n_img, geometry.head_dim, generator=gen).to(dtype)
    k = torch.randn(len(rows), geometry.num_kv_heads, n_img, geometry.head_dim, generator=gen).to(dtype)
    v = torch.randn(len(rows), geometry.num_kv_heads, n_img, geometry.head_dim, generator=gen).to(dtype)
    runner = DitRunner(preset, weight_seed=seed, device=device)
    latents = torch.randn(len(rows), preset.dit.latent_channels, 16, 16, generator=gen).to(device, runner.dtype)
    t = 0.5  # the flow time, shared by every row
    q, k, v = q.to(device), k.to(device), v.to(device)

    def outputs(host_rows: list[list[tuple[Any, Any]]]) -> list[Any]:
        prefix_rows = [[(pk.to(device), pv.to(device)) for pk, pv in row] for row in host_rows]
        attn = [prefix_attention(q, k, v, [row[layer] for row in prefix_rows]) for layer in range(geometry.num_layers)]
        with torch.no_grad():
            velocity = runner.model(latents, t, prefix_rows)
        return [*attn, velocity]

    reference = outputs(reference_rows)
    attention_bits_equal = True
    max_abs_diff = 0.0
    for name, pools in variants.items():
        got = outputs(prefix_rows_of(pools))
        for a, b in zip(got, reference, strict=True):
            attention_bits_equal &= bool(torch.equal(a, b))
            max_abs_diff = max(max_abs_diff, float((a.float() - b.float()).abs().max()))
        _log(f"{name}: pages equal={all(torch.equal(p, dense[d]) for d, p in enumerate(pools))}")
    return {
        "prefix_bits_equal": prefix_bits_equal,
        "attention_bits_equal": attention_bits_equal,
        "max_abs_diff": max_abs_diff,
        "tokens": [r.num_tokens for r in rows],
        "bytes": sum(w.num_bytes for w in plan),
        "bytes_per_rank": per_rank,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.models.presets import get_preset

    torch.set_num_threads(1)
    preset = args.preset or ("bagel-7b-shape" if args.device.startswith("cuda") else "tiny")
    # Bad input is one line naming it and exit 2, before any model is built (never a traceback).
    try:
        get_preset(preset)
        _check_device(torch, args.device)
        result = run_check(
            preset, args.prompt, args.negative_prompt, args.ar_tp, args.dit_tp, args.dit_sp, args.seed,
            device=args.device, dit_cfg=args.dit_cfg,
        )
    except ValueError as err:  # the preset, the device, or a layout the planner refuses
        print(f"kvrelay verify: {err}", file=sys.stderr)
        return 2
    print(f"prefix_bits_equal {result['prefix_bits_equal']}")
    print(f"attention_bits_equal {result['attention_bits_equal']}")
    print(f"max_abs_diff {result['max_abs_diff']}")
    ok = result["prefix_bits_equal"] and result["attention_bits_equal"] and result["max_abs_diff"] == 0.0
    return 0 if ok else 1


def _check_device(torch: Any, device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device}: not a device (cpu, cuda or cuda:N)") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise ValueError(f"--device {device}: only cpu and cuda are checked")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is False)")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA device(s)")
