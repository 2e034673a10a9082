"""Real processes on loopback: a sender process and a receiver process move two CFG rows over
Mooncake TCP and over the gRPC stream, for TP=1->TP=1, TP=2->TP=2, TP=2->TP=1 and TP=1->SP=2
(plus a plan past Mooncake's per-peer queue limit). Asserts on the bytes that landed."""

from __future__ import annotations

import functools
import multiprocessing as mp
from typing import Any

import pytest
import torch

from kvrelay.transfer.checksum import write_checksum
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.pack import pack_staging, read_row
from kvrelay.transfer.planner import PlannedWrite, Segment, staging_bytes
from kvrelay.transfer.transport import RegionDescriptor
from tests.transfer import loopback
from tests.transfer.loopback import SCENARIOS, SENTINEL, row_kv

pytestmark = pytest.mark.slow

TRANSPORTS = ("mooncake", "grpc")


class Peer:
    """One spawned harness process driven over a pipe; always stopped, by its own handle."""

    def __init__(self, target: Any, transport: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, transport), daemon=True)
        self.proc.start()
        child.close()
        self._expect("ready", timeout=60)

    def _expect(self, status: str, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"harness process {self.proc.pid} did not answer within {timeout}s")
        got, value = self.conn.recv()
        if got != status:
            raise RuntimeError(f"harness process failed:\n{value}")
        return value

    def call(self, cmd: str, arg: Any = None, timeout: float = 60) -> Any:
        self.conn.send((cmd, arg))
        return self._expect("ok", timeout)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop", timeout=15)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _expected_checksums(i: int) -> list[int]:
    """Pack in the test process too: the checksum the sender must report for each write."""
    sc = SCENARIOS[i]
    plan = sc.plan()
    full = {r.row: row_kv(sc.geometry, r) for r in sc.rows}
    sums = []
    for s in range(sc.src_shards):
        staging = torch.zeros(staging_bytes(plan, s), dtype=torch.uint8)
        lo, hi = sc.geometry.head_range(sc.src_shards, s)
        kv = {row: t[:, :, lo:hi].contiguous() for row, t in full.items()}
        pack_staging(staging, kv, sc.geometry, sc.src_shards, sc.dst_shards, sc.rows, plan, s)
        sums += [write_checksum(staging, w) for w in plan if w.src_rank == s]
    return sums


@functools.cache
def run_transport(transport: str) -> dict[str, Any]:
    receiver = sender = None
    try:
        receiver = Peer(loopback.receiver_main, transport)
        sender = Peer(loopback.sender_main, transport)
        results: dict[str, Any] = {"scenarios": {}}
        for i, sc in enumerate(SCENARIOS):
            destinations = {d.rank: d for d in receiver.call("describe", i)}
            outcomes = sender.call("send", (i, destinations, 30.0))
            plan = sc.plan()
            ordered = [w for s in range(sc.src_shards) for w in plan if w.src_rank == s]
            checksums = [o.checksum for o in outcomes]
            verified = receiver.call("verify", (i, ordered, checksums, 5.0))
            dumps = receiver.call("dump", i)
            results["scenarios"][sc.name] = dict(
                outcomes=outcomes, writes=ordered, verified=verified, dumps=dumps, destinations=destinations
            )

        results["goodput"] = sender.call("goodput")

        # A corrupted byte inside row 0's first page on rank 0 of the first scenario.
        sc0 = SCENARIOS[0]
        layout = PageLayout(sc0.geometry, sc0.dst_shards, 0)
        offset = layout.offset(sc0.rows[0].page_ids[0], 1, 1, 2, 5) + 1
        first = results["scenarios"][sc0.name]
        receiver.call("corrupt", (0, 0, offset))
        results["after_corruption"] = receiver.call(
            "verify", (0, first["writes"], [o.checksum for o in first["outcomes"]], 0.05)
        )

        # Failure paths, against the live receiver; the gRPC receiver routes by rank to the last
        # described pools, so scenario 0's pools are described again first.
        region = receiver.call("describe", 0)[0]
        probe = PlannedWrite(0, 0, 0, (Segment(0, 0, 64),))
        if transport == "mooncake":
            unregistered = RegionDescriptor(0, "mooncake", region.endpoint, 0x1000, 1 << 20)
            gone = RegionDescriptor(0, "mooncake", "127.0.0.1:1", region.base_address, region.length)
            results["fail_unregistered"] = sender.call("send_raw", ([probe], {0: unregistered}, 10.0))
            results["fail_unreachable"] = sender.call("send_raw", ([probe], {0: gone}, 10.0))
        else:
            # The descriptor lies about the region's size; the receiver's bounds check must hold.
            liar = RegionDescriptor(0, "grpc", region.endpoint, 0, region.length + (1 << 20))
            past = PlannedWrite(0, 0, 0, (Segment(0, region.length, 64),))
            results["fail_out_of_region"] = sender.call("send_raw", ([past], {0: liar}, 10.0))
            gone = RegionDescriptor(0, "grpc", "127.0.0.1:1", 0, region.length)
            results["fail_unreachable"] = sender.call("send_raw", ([probe], {0: gone}, 3.0))
            results["dump_after_failures"] = receiver.call("dump", 0)
        return results
    finally:
        for peer in (sender, receiver):
            if peer is not None:
                peer.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[sc.name for sc in SCENARIOS])
def test_rows_land_bit_identical_to_the_source(transport: str, index: int) -> None:
    sc = SCENARIOS[index]
    got = run_transport(transport)["scenarios"][sc.name]
    assert [o.status for o in got["outcomes"]] == ["OK"] * len(got["writes"]), [o.message for o in got["outcomes"]]
    assert [o.bytes for o in got["outcomes"]] == [w.num_bytes for w in got["writes"]]
    assert [(o.row, o.src_rank, o.dst_rank) for o in got["outcomes"]] == [
        (w.row, w.src_rank, w.dst_rank) for w in got["writes"]
    ]
    assert [o.checksum for o in got["outcomes"]] == _expected_checksums(index)
    assert got["verified"] == [True] * len(got["writes"])
    reserved = {p for r in sc.rows for p in r.page_ids}
    for d in range(sc.dst_shards):
        layout = PageLayout(sc.geometry, sc.dst_shards, d)
        pool = torch.frombuffer(bytearray(got["dumps"][d]), dtype=torch.uint8)
        lo, hi = sc.geometry.head_range(sc.dst_shards, d)
        for r in sc.rows:
            expect = row_kv(sc.geometry, r)[:, :, lo:hi].contiguous()
            assert torch.equal(read_row(pool, layout, r).view(torch.uint8), expect.view(torch.uint8))
        pages = pool.view(sc.num_pages, layout.page_bytes)
        for p in range(sc.num_pages):
            if p not in reserved:
                assert bool((pages[p] == SENTINEL).all()), f"page {p} outside the reservation was touched"


def test_both_transports_land_the_same_bits() -> None:
    mooncake, grpc_stream = run_transport("mooncake"), run_transport("grpc")
    for sc in SCENARIOS:
        assert mooncake["scenarios"][sc.name]["dumps"] == grpc_stream["scenarios"][sc.name]["dumps"], sc.name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_corrupted_byte_is_caught_by_the_checksum(transport: str) -> None:
    results = run_transport(transport)
    writes = results["scenarios"][SCENARIOS[0].name]["writes"]
    # Row 0 holds the corrupted page; row 1's write does not cover it.
    assert results["after_corruption"] == [w.row != 0 for w in writes]


def test_mooncake_sender_learned_the_peer_goodput_for_the_sleep_path() -> None:
    # Without a learned goodput the large second scenario would not have exercised the
    # submit-sleep-wait path whose bytes test_rows_land_bit_identical_to_the_source checks.
    goodput = run_transport("mooncake")["goodput"]
    assert len(goodput) == 1 and next(iter(goodput.values())) > 1e6


def test_mooncake_failures_come_back_as_failed_outcomes() -> None:
    results = run_transport("mooncake")
    for key in ("fail_unregistered", "fail_unreachable"):
        (outcome,) = results[key]
        assert outcome.status == "FAILED", key
        assert "Mooncake batch write" in outcome.message


def test_grpc_out_of_region_chunk_is_rejected_and_nothing_lands() -> None:
    results = run_transport("grpc")
    (outcome,) = results["fail_out_of_region"]
    assert outcome.status == "FAILED"
    assert "INVALID_ARGUMENT" in outcome.message and "outside" in outcome.message
    (unreachable,) = results["fail_unreachable"]
    assert unreachable.status in ("FAILED", "NOT_STARTED") and "UNAVAILABLE" in unreachable.message
    # Only the corruption the test made differs from the first dump.
    before = results["scenarios"][SCENARIOS[0].name]["dumps"]
    after = results["dump_after_failures"]
    assert after.keys() == before.keys()
    diff = [i for i, (a, b) in enumerate(zip(before[0], after[0], strict=True)) if a != b]
    assert len(diff) == 1
