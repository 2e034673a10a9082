"""The ownership hand-off over the gRPC-stream fallback with the whole DiT replica stopped
(SIGSTOP of its service process, which serves PutKv, and of every rank) in the middle of a
request's stream, for longer than the request's deadline, the stream's deadline and the lease.

Under test (DESIGN.md section 6, docs/broker.md Draining): the AR's stream returns (its deadline
passed) with chunks of it still unread in the stopped DiT's socket; the writes are final
(`FAILED`), but their pages are never freed while the DiT is down. While it is stopped, no live
ticket holds any of those pages (watched continuously). After SIGCONT the DiT reads what its
socket held; the pages come back only after its heartbeat proves that its process and every rank
ran the proof window (2.5 s) since (before, the whole `receiver_settle_seconds`, 32 s here, after
the FAILED report), no byte of them changes once they are free, and a request served right after
(on pages that may include them) gives the image of the same request run before the fault, bit
for bit.

Held (no defect found; written as the regression of that attack): the stream's FAILED writes are
never freed while the stopped DiT's lease lapsed, nor before it ran the window.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, TicketState, WriteStatus
from tests.e2e.node import running_node, wait_pools_full
from tests.e2e.test_in_doubt_write import PageWatcher, _ticket_of, _wait

pytestmark = pytest.mark.slow

LONG = "a lighthouse on a cliff at sunset, oil painting, " * 18  # ~900 byte tokens per row
SHORT = "a red fox in the snow"
REQUEST_TIMEOUT_S = 4.0
# The DiT's rank stall limit; its settle time is this + a watch interval + 1 s, far above when the
# proof frees the pages (~3 s after SIGCONT, ~15 s after the stop on a loaded machine).
STALL_S = 30.0
PROOF_WINDOW_S = 2.5  # KvRelayConfig.receiver_proof_window_seconds


def _config(cfg: dict[str, Any]) -> None:
    # `small` KV (4 KiB/token): the long request streams ~7 MiB, far more than the HTTP/2 windows
    # and socket buffers of a receiver that does not read, so the stream blocks while stopped.
    for stage in cfg["stages"]:
        stage["model"] = {"preset": "small"}
        stage.pop("kv_transfer_config", None)
    cfg["stages"][0]["kv_cache_memory_bytes"] = 64 << 20
    cfg["stages"][1]["kv_cache_memory_bytes"] = 32 << 20
    cfg["stages"][1]["rank_stall_seconds"] = STALL_S
    cfg["broker"]["max_replica_retries"] = 0


def _dit_tree(node: Any) -> list[psutil.Process]:
    main = psutil.Process(node.process("dit-0").pid)
    return [main, *main.children(recursive=True)]


def test_a_dit_stopped_whole_mid_stream_keeps_the_streams_pages_until_it_read_its_socket(tmp_path: Path) -> None:
    with running_node(tmp_path, "fbstop", _config) as node, KvRelayClient(node.address(), timeout=30) as client:
        total = wait_pools_full(client)[0].total_pages
        reference = client.generate(SHORT, seed=7, width=64, height=64, timeout=60).result()
        dit_pid = node.process("dit-0").pid
        (pool_file,) = Path("/dev/shm").glob(f"kvrelay-dit-0-{dit_pid}-rank0-*")
        tree = _dit_tree(node)
        watcher: PageWatcher | None = None
        held: set[int] = set()
        continued: float | None = None
        try:
            for p in tree:
                os.kill(p.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()  # before the stream, so before its FAILED report
            first = client.generate(LONG, negative_prompt=LONG, seed=1, width=64, height=64,
                                    timeout=REQUEST_TIMEOUT_S, request_id="fallback-stopped-dit")
            with pytest.raises(KvRelayError):
                first.result()
            # The stream's deadline passed: the call returned, its started writes are final.
            ticket = _wait("the AR's final report", lambda: (
                t if (t := _ticket_of(client, first.request_id)) is not None and t.writes
                and all(w.status in (WriteStatus.FAILED, WriteStatus.NOT_STARTED) for w in t.writes) else None),
                timeout=30)
            assert any(w.status == WriteStatus.FAILED for w in ticket.writes), ticket.writes
            held = {p for r in ticket.rows for p in r.page_ids}
            watcher = PageWatcher(node.address(), ticket.ticket_id, held)
            watcher.start()
            # Past the quiet period (0.2 s) and the lease (2 s): the stopped DiT still holds the bytes.
            time.sleep(3.0)
            (pool,) = client.get_pools()
            assert _ticket_of(client, first.request_id).state == TicketState.DRAINING
            assert pool.draining_pages == len(held) and pool.free_pages == total - len(held), pool
            # A request arriving now waits for the DiT (down); it must never get the held pages.
            second = client.generate(SHORT, seed=7, width=64, height=64, timeout=90, request_id="after-the-stop")
            time.sleep(1.0)
        finally:
            continued = time.monotonic()
            for p in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            if watcher is not None:
                watcher.writer_blocked.clear()  # running again: the release may come
        try:
            # The DiT reads its socket and heartbeats; the pages come back once a heartbeat proves
            # that its process and its ranks ran the proof window since they continued.
            wait_pools_full(client, timeout=STALL_S + 40)
            freed_after = time.monotonic() - continued
            assert freed_after >= PROOF_WINDOW_S, f"freed {freed_after:.1f}s after SIGCONT: before the DiT ran the window"
            since_stop = time.monotonic() - stopped_at
            assert since_stop < STALL_S, f"freed {since_stop:.1f}s after the stop: the whole settle time, no proof"
            assert watcher is not None
            released = _ticket_of(client, first.request_id)
            assert released.state == TicketState.RELEASED, released
            page_bytes = pool_file.stat().st_size // total

            def pages_now() -> list[bytes]:
                data = pool_file.read_bytes()
                return [data[p * page_bytes:(p + 1) * page_bytes] for p in sorted(held)]

            freed = pages_now()
            time.sleep(1.0)
            assert pages_now() == freed, "bytes of the dead stream landed in freed pages"
            assert node.process("dit-0").pid == dit_pid, "the DiT restarted: the stop was not a temporary hang"
            assert second.result().png == reference.png, "the request after the stop read other bytes"
        finally:
            if watcher is not None:
                watcher.stop.set()
                watcher.join(10)
        assert watcher.checks > 10 and watcher.violations == [], watcher.violations[:3]
