"""A request id resubmitted while its earlier generation's ticket still drains, with real processes
(`kvrelay up`'s supervisor: broker, AR, DiT, tiny preset, Mooncake TCP).

The earlier generation fails WRITE_FAILED (the real AR rank raises once after its transport call,
the sitecustomize of test_write_failed_retry; no retries), so its ticket drains holding its pages
until the AR's incarnation is replaced. Once the broker forgot that generation (`max_results: 1`,
another one finished), the same id is submitted again with another generation behind it: both
run at once on pages of their own (before, the resubmission waited at the queue's head for the
draining ticket, and everything behind it with it), and the draining ticket keeps every page.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client import GenerationState, KvRelayClient, TicketState
from tests.e2e.node import running_node, wait_pools_full
from tests.e2e.test_write_failed_retry import FAULT_ENV, SITECUSTOMIZE, _generate, _pages

pytestmark = pytest.mark.slow


def _one_result_no_retry(cfg: dict[str, Any]) -> None:
    cfg["broker"]["max_replica_retries"] = 0
    cfg["broker"]["max_results"] = 1


def test_a_resubmitted_id_runs_beside_its_earlier_generations_draining_ticket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    fault = tmp_path / "write-fault"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(FAULT_ENV, str(fault))
    assert str(hook) not in sys.path  # this process is not wrapped, only the node's

    with running_node(tmp_path, "resubmit", _one_result_no_retry) as node, \
            KvRelayClient(node.address(), timeout=60) as client:  # fmt: skip
        total = wait_pools_full(client)[0].total_pages
        fault.write_text("once")
        events = list(_generate(client, "dup").events())
        assert not fault.exists(), "the AR rank never took the fault"
        assert events[-1].state == GenerationState.FAILED, events[-1]
        assert events[-1].error is not None and events[-1].error.reason == "WRITE_FAILED", events[-1].error
        earlier_id = next(e.ticket_id for e in events if e.ticket_id)
        (earlier,) = [t for t in client.list_tickets() if t.ticket_id == earlier_id]
        assert earlier.state == TicketState.DRAINING, earlier

        filler = _generate(client, "filler").result()  # the broker forgets "dup" (max_results 1)
        assert "dup" not in {g.request_id for g in client.list_generations()}

        again, behind = _generate(client, "dup"), _generate(client, "behind")
        done = list(again.events())[-1]
        assert done.state == GenerationState.SUCCEEDED and done.attempt == 1, done
        assert again.result().png == filler.png and behind.result().png == filler.png
        mine = next(t for t in client.list_tickets([TicketState.RELEASED]) if t.ticket_id == done.ticket_id)
        assert not _pages(earlier) & _pages(mine), "the resubmission got a page a write may still land in"
        (still,) = [t for t in client.list_tickets() if t.ticket_id == earlier_id]
        assert still.state == TicketState.DRAINING, still
        (pool,) = client.get_pools()
        assert pool.draining_pages == len(_pages(earlier)) and pool.free_pages == total - len(_pages(earlier)), pool
