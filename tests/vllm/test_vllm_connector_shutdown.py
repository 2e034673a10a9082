"""KvRelayConnector.shutdown with a write still in its transport call (IN_DOUBT): the sender is
not closed and the staging region the call reads is not freed until the call returned, or the
bound passed (then neither ever is, for the process's life). No vLLM engine: a connector on a
one-layer fake cache with a fake transport whose calls block until the test lets them end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.ar_service import vllm_connector  # noqa: E402
from kvrelay.ar_service.engine import WriteTicket  # noqa: E402
from kvrelay.ar_service.vllm_connector import (  # noqa: E402
    HeldRow,
    KvRelayConnector,
    VllmWriteTicket,
    _WorkerState,
)
from kvrelay.transfer.layout import KvGeometry, PageLayout  # noqa: E402
from kvrelay.transfer.planner import RowSpec, plan_transfer  # noqa: E402
from kvrelay.transfer.staging import StagingAllocator  # noqa: E402
from kvrelay.transfer.transport import FinishedCall, RegionDescriptor, WriteOutcome  # noqa: E402

BLOCK = 16
HEADS, HEAD_DIM = 2, 32


class BlockingSender:
    """Each write's call runs on a thread until `gate` is set (reading staging meanwhile); the
    write itself returns IN_DOUBT at once, as a real sender does when its wait ends first."""

    name = "fake"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[tuple[str, threading.Thread, list[Any]]] = []
        self.closed_while_running: list[str] = []
        self.closed = False

    def write(self, staging: Any, writes: Sequence[Any], destinations: Any, ticket_id: str,
              timeout_s: float, **_: Any) -> list[WriteOutcome]:  # fmt: skip
        thread = threading.Thread(target=self.gate.wait, args=(30,), daemon=True)
        thread.start()
        self.calls.append((ticket_id, thread, list(writes)))
        return [
            WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", w.num_bytes, 1, "wait ended")
            for w in writes
        ]

    def collect_finished(self) -> list[FinishedCall]:
        done = [c for c in self.calls if not c[1].is_alive()]
        self.calls = [c for c in self.calls if c[1].is_alive()]
        return [
            FinishedCall(
                t, tuple(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, 1) for w in ws)
            )
            for t, _, ws in done
        ]

    def close(self) -> None:
        self.closed = True
        self.closed_while_running = [t for t, thread, _ in self.calls if thread.is_alive()]


def _connector(sender: BlockingSender, wait_s: float) -> KvRelayConnector:
    connector = object.__new__(KvRelayConnector)  # the worker side, without a vLLM engine
    cache = torch.randn(4, HEADS, BLOCK, 2 * HEAD_DIM)
    connector._worker = _WorkerState(kv_caches=[cache])
    connector._lock = threading.Lock()
    connector._staging = torch.zeros(1 << 20, dtype=torch.uint8)
    connector._regions = StagingAllocator(1 << 20)
    connector._finished = []
    connector._sender = sender
    connector._block_size = BLOCK
    connector._shutdown_wait_s = wait_s
    connector._tp_rank = lambda: 0  # type: ignore[method-assign]
    return connector


def _write_in_doubt(connector: KvRelayConnector) -> None:
    geometry = KvGeometry(1, HEADS, HEAD_DIM, "float32", BLOCK)
    rows = (RowSpec(0, 20, (1, 2)),)
    plan = plan_transfer(geometry, 1, 1, rows)
    pool = PageLayout(geometry, 1, 0).pool_bytes(4)
    dest = (RegionDescriptor(0, "grpc", "127.0.0.1:1", 0, pool),)
    cmd = WriteTicket("t-doubt", rows, geometry, 1, 1, plan, dest, timeout_s=0.1)
    done = connector.write_ticket(VllmWriteTicket(cmd, (HeldRow(0, "req-0", (1, 2), 20),)))
    assert {o.status for o in done.outcomes} == {"IN_DOUBT"}
    assert [r.ticket_id for r in connector._regions.held()] == ["t-doubt"]  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _forget_left_running() -> Iterator[None]:
    yield
    vllm_connector._LEFT_RUNNING.clear()


def test_shutdown_waits_for_an_in_doubt_call_before_closing_the_sender() -> None:
    sender = BlockingSender()
    connector = _connector(sender, wait_s=20.0)
    _write_in_doubt(connector)
    shut = threading.Thread(target=connector.shutdown)
    shut.start()
    time.sleep(0.3)
    # The call still reads its staging region: nothing closed or freed yet.
    assert shut.is_alive() and not sender.closed
    assert [r.ticket_id for r in connector._regions.held()] == ["t-doubt"]  # type: ignore[union-attr]
    sender.gate.set()  # the call returns
    shut.join(10)
    assert not shut.is_alive()
    assert sender.closed and sender.closed_while_running == []
    assert connector._regions.held() == []  # type: ignore[union-attr]


def test_shutdown_past_its_bound_leaves_the_call_its_sender_and_staging() -> None:
    sender = BlockingSender()
    connector = _connector(sender, wait_s=0.3)
    _write_in_doubt(connector)
    staging = connector._staging
    try:
        started = time.monotonic()
        connector.shutdown()
        assert time.monotonic() - started < 5  # bounded: WorkerGroup.stop kills the process at 10 s
        # Never closed (Mooncake's close unregisters the memory the call reads), the region still
        # held, and the buffer kept referenced for the process's life.
        assert not sender.closed
        assert [r.ticket_id for r in connector._regions.held()] == ["t-doubt"]  # type: ignore[union-attr]
        assert any(kept[1] is staging for kept in vllm_connector._LEFT_RUNNING)
        connector.shutdown()  # idempotent: vLLM may call it again
        assert not sender.closed
    finally:
        sender.gate.set()
