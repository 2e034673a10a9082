"""A WRITE_FAILED transfer (a rank of the AR raised while writing: its answer is lost, so its writes
are in doubt) is retried with a fresh ticket like TRANSFER_FAILED / TRANSFER_TIMEOUT, with real
processes (`kvrelay up`'s supervisor: broker, AR, DiT, tiny preset, Mooncake TCP).

The fault is real code in the real rank process: a `sitecustomize` on the node's PYTHONPATH wraps
the AR rank's write handler (`ArRankHandler._write`) so that, once, it raises right after its
transport call returned: the bytes really landed in the failed attempt's pages, but the service
never hears the outcomes and answers `Prefill` WRITE_FAILED with each write IN_DOUBT. The failed
attempt's ticket must then drain holding its pages (nobody can prove its writes over until the
AR's incarnation is replaced), the retry must get pages of its own on the same (only) AR/DiT pair
and make the very PNG an undisturbed run of the same seed makes, and a restart of the AR (a new
incarnation: the proof) must give every page back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client import GenerationState, KvRelayClient, TicketState
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

FAULT_ENV = "KVRELAY_E2E_WRITE_FAULT_FILE"
SITECUSTOMIZE = f'''
import importlib.abc
import importlib.machinery
import os
import sys


def _take_fault():
    path = os.environ.get("{FAULT_ENV}", "")
    try:
        os.remove(path)  # one fault per file, whichever process takes it first
    except OSError:
        return False
    return True


class _WrapWrite(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvrelay.ar_service.engine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            original = module.ArRankHandler._write

            def _write(self, cmd):
                done = original(self, cmd)
                if _take_fault():
                    raise RuntimeError("injected: the rank raised after its transport call returned")
                return done

            module.ArRankHandler._write = _write

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WrapWrite())
'''


# The DiT's rank stall limit (default max(10 s, 3 x lease) = 10 s here). The failed attempt's
# pages wait the receiver's settle time after the AR's restart proves its writer gone: this + 2 s
# (docs/broker.md, Draining), most of the test's wait after the restart. No DiT rank is stopped
# here; 4 s is 8 liveness beats, as generous as tests/e2e/test_stopped_rank.py's 3 s.
DIT_STALL_S = 4.0


def _short_settle(cfg: dict[str, Any]) -> None:
    cfg["stages"][1]["rank_stall_seconds"] = DIT_STALL_S


def _generate(client: KvRelayClient, request_id: str) -> Any:
    return client.generate("a lighthouse at dusk", negative_prompt="blurry", seed=3, width=64, height=64,
                           timeout=90, request_id=request_id)  # fmt: skip


def _broker_counter(node: Any, name: str, labels: str) -> float:
    metrics = node.process("broker").metrics
    assert metrics, "the broker serves no metrics"
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    return 0.0


def _pages(ticket: Any) -> set[tuple[int, int]]:
    return {(r.row, p) for r in ticket.rows for p in r.page_ids}


def test_a_write_failed_transfer_is_retried_with_fresh_pages_and_the_image_is_the_undisturbed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    fault = tmp_path / "write-fault"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(FAULT_ENV, str(fault))
    assert str(hook) not in sys.path  # this process is not wrapped, only the node's

    with running_node(tmp_path, "wfretry", _short_settle) as node, KvRelayClient(node.address(), timeout=60) as client:
        total = wait_pools_full(client)[0].total_pages
        undisturbed = _generate(client, "undisturbed").result()
        wait_pools_full(client)

        fault.write_text("once")
        handle = _generate(client, "retried")
        events = list(handle.events())
        result = handle.result()
        assert not fault.exists(), "the AR rank never took the fault"
        assert result.png == undisturbed.png, "the retry made another image than the undisturbed run"
        done = client.get_generation("retried")
        assert done.state == GenerationState.SUCCEEDED and done.attempt == 2, done
        seen = [(e.state, e.step) for e in events]
        assert seen == sorted(seen), seen  # never back, across the retry
        assert _broker_counter(node, "kvrelay_generation_retries_total", 'reason="WRITE_FAILED"') == 1
        assert _broker_counter(node, "kvrelay_generations_total", 'outcome="failed"') == 0

        # The failed attempt's ticket ended as before: over, its writes in doubt, every page held,
        # none of them the retry's.
        first_id = next(e.ticket_id for e in events if e.ticket_id and e.ticket_id != done.ticket_id)
        (first,) = [t for t in client.list_tickets() if t.ticket_id == first_id]
        assert first.state == TicketState.DRAINING, first
        (pool,) = client.get_pools()
        assert pool.draining_pages == len(_pages(first)) and pool.free_pages == total - len(_pages(first)), pool
        retry_ticket = next(t for t in client.list_tickets([TicketState.RELEASED]) if t.ticket_id == done.ticket_id)
        assert not _pages(first) & _pages(retry_ticket), "the retry got a page its failed attempt may still write"

        # Proof that no write can land any more: the AR's incarnation replaced (kill -9, the
        # supervisor restarts it). Then every page comes back, and the node serves on.
        os.kill(node.process("ar-0").pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while any(t.ticket_id == first_id for t in client.list_tickets()):
            assert time.monotonic() < deadline, "the failed attempt's pages never came back after the AR restarted"
            time.sleep(0.2)
        assert wait_pools_full(client, timeout=60)[0].total_pages == total
        assert _generate(client, "after").result().png
