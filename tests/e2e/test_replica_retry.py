"""A DiT killed (`kill -9`) in the middle of a generation's denoise, with real processes: the broker
runs the generation again on the other DiT (broker.max_replica_retries, default 1), it succeeds
with the very bytes an undisturbed run of the same seed makes, and no page leaks: the killed
DiT's pages come back once `kvrelay up` has restarted it (a new incarnation proves its reader
gone), the other DiT's at once.

The kill is made deterministic with SIGSTOP: every process of the DiT holding the generation is
stopped as soon as the client sees DENOISING, the generation is checked to be still DENOISING
(it cannot move on: its ranks are stopped), and only then is the DiT killed.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import GenerationState, KvRelayClient
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

PROMPT = "a red fox in the snow"
SEED = 1234
# Enough steps that the denoise is still running when the test reacts to its first step.
STEPS = 400


def _two_dits(cfg: dict[str, Any]) -> None:
    cfg["stages"][1]["num_replicas"] = 2


def _broker_counter(node: Any, name: str, labels: str) -> float:
    metrics = node.process("broker").metrics
    assert metrics, "the broker serves no metrics"
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not served")


def _generate(client: KvRelayClient, request_id: str) -> Any:
    return client.generate(
        PROMPT, seed=SEED, width=64, height=64, num_inference_steps=STEPS, request_id=request_id, timeout=180
    )


def test_a_dit_killed_mid_denoise_the_generation_succeeds_on_the_other_dit(tmp_path: Path) -> None:
    with running_node(tmp_path, "retry", _two_dits) as node, KvRelayClient(node.address(), timeout=60) as client:
        totals = {p.replica_id: p.total_pages for p in wait_pools_full(client)}
        assert len(totals) == 2
        undisturbed = _generate(client, "undisturbed").result()

        handle = _generate(client, "moved")
        first_ticket = ""
        for event in handle.events():
            assert not event.state.is_terminal, event
            if event.state == GenerationState.DENOISING:
                first_ticket = event.ticket_id
                break
        (ticket,) = [t for t in client.list_tickets() if t.ticket_id == first_ticket]
        victim = ticket.dit_replica_id
        info = node.process(victim)
        assert info.pid is not None
        main = psutil.Process(info.pid)
        procs = [main, *main.children(recursive=True)]
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            held = client.get_generation("moved")
            assert held.state == GenerationState.DENOISING and held.step < STEPS, held
        finally:
            for proc in procs:
                os.kill(proc.pid, signal.SIGKILL)

        result = handle.result()
        assert result.png == undisturbed.png, "the retry made another image than the undisturbed run"
        assert result.seed == SEED
        done = client.get_generation("moved")
        assert done.state == GenerationState.SUCCEEDED and done.ticket_id != first_ticket
        assert done.attempt == 2
        assert _broker_counter(node, "kvrelay_generation_retries_total", 'reason="REPLICA_UNAVAILABLE"') == 1
        assert _broker_counter(node, "kvrelay_generations_total", 'outcome="failed"') == 0

        # The other DiT's pages are back at once; the killed one's once its next incarnation runs.
        survivor = next(rid for rid in totals if rid != victim)
        (pool,) = client.get_pools(survivor)
        deadline = time.monotonic() + 20
        while pool.free_pages != pool.total_pages:
            assert time.monotonic() < deadline, f"{survivor}: pages did not come back: {pool}"
            time.sleep(0.05)
            (pool,) = client.get_pools(survivor)
        node.wait_serving(victim, timeout=120, not_pid=info.pid)
        pools = wait_pools_full(client, timeout=30)
        assert {p.replica_id: p.total_pages for p in pools} == totals
        assert client.list_tickets() == []
