"""An AR killed (`kill -9`) after the DiT verified every row of its request but before the AR's
`Prefill` reply, with real processes (Mooncake TCP, one AR, one DiT, tiny, CPU): the denoise needs
nothing more from the AR, so the generation goes on and succeeds in its first attempt with the
very bytes of an undisturbed run.

Found black-box (the writing AR SIGSTOPped, its writes verified, its call lost): the broker's
`Prefill` call ended `UNAVAILABLE` and that ended the attempt although the ticket was CONSUMING:
with another AR up the whole generation ran again (`broker.max_replica_retries`), with none it
FAILED `REPLICA_UNAVAILABLE`.

Deterministic: the AR (every process) is SIGSTOPped as soon as the ticket is WRITING; once the
ticket is CONSUMING (every row verified at the DiT: the writes had been reported, the reply was
not sent) the DiT is SIGSTOPped too (it cannot finish first), the AR killed, the broker seen to
notice (its log says `prefill_reply_lost`, or the generation ended), and only then the DiT
continues. A stop that caught the AR before its last report ends the generation
TRANSFER_TIMEOUT: the AR is continued and the test tries again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError, TicketState
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

PROMPT = "a lighthouse on a cliff at sunset"
SEED = 77
STEPS = 300


def _generate(client: KvRelayClient, request_id: str) -> Any:
    return client.generate(
        PROMPT, seed=SEED, width=64, height=64, num_inference_steps=STEPS, request_id=request_id, timeout=120
    )


def _processes(node: Any, name: str) -> list[psutil.Process]:
    main = psutil.Process(node.process(name).pid)
    return [main, *main.children(recursive=True)]


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        os.kill(proc.pid, sig)


def _broker_counter(node: Any, name: str, labels: str) -> float:
    metrics = node.process("broker").metrics
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not served")


def _stop_when_writing(client: KvRelayClient, node: Any, found: dict[str, Any], give_up: threading.Event) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not give_up.is_set():
        for t in client.list_tickets():
            if t.state == TicketState.WRITING:
                procs = _processes(node, t.ar_replica_id)
                _signal(procs, signal.SIGSTOP)
                found.update(ticket=t, procs=procs)
                return
        time.sleep(0.0005)


def test_an_ar_killed_after_the_dit_loaded_every_row_does_not_end_the_generation(tmp_path: Path) -> None:
    with running_node(tmp_path, "arlost") as node, KvRelayClient(node.address(), timeout=60) as client:
        wait_pools_full(client, timeout=60)
        undisturbed = _generate(client, "undisturbed").result()
        broker_log = tmp_path / "arlost" / "logs" / "broker.log"
        for attempt in range(6):
            found: dict[str, Any] = {}
            give_up = threading.Event()
            watcher = threading.Thread(target=_stop_when_writing, args=(client, node, found, give_up), daemon=True)
            watcher.start()
            request_id = f"ar-lost-{attempt}"
            handle = _generate(client, request_id)
            watcher.join(40)
            assert found, "the ticket was never seen WRITING"
            ticket = found["ticket"]
            deadline = time.monotonic() + 30
            while True:
                (now,) = [t for t in client.list_tickets() if t.ticket_id == ticket.ticket_id] or [None]
                if now is None or now.state == TicketState.CONSUMING:
                    break
                if client.get_generation(request_id).state.is_terminal:
                    break
                assert time.monotonic() < deadline, f"the ticket stayed {now.state.name}"
                time.sleep(0.01)
            if now is None or client.get_generation(request_id).state.is_terminal:
                # Stopped before its last report (TRANSFER_TIMEOUT) or after its reply: again.
                ar_pid = node.process("ar-0").pid
                _signal(found["procs"], signal.SIGKILL)
                with contextlib.suppress(KvRelayError):
                    handle.result()
                node.wait_serving("ar-0", timeout=120, not_pid=ar_pid)
                wait_pools_full(client, timeout=30)
                continue
            break
        else:
            pytest.fail("never stopped the AR between its last write report and its reply")
        ar_pid = node.process("ar-0").pid
        dit = _processes(node, "dit-0")
        _signal(dit, signal.SIGSTOP)
        try:
            _signal(found["procs"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while "prefill_reply_lost" not in broker_log.read_text():
                if client.get_generation(request_id).state.is_terminal:
                    break
                assert time.monotonic() < deadline, "the broker never noticed the AR's Prefill call end"
                time.sleep(0.02)
        finally:
            _signal(dit, signal.SIGCONT)

        result = handle.result()
        assert result.png == undisturbed.png
        done = client.get_generation(request_id)
        assert done.state == GenerationState.SUCCEEDED and done.attempt == 1 and done.ticket_id == ticket.ticket_id
        assert _broker_counter(node, "kvrelay_generation_retries_total", 'reason="REPLICA_UNAVAILABLE"') == 0
        node.wait_serving("ar-0", timeout=120, not_pid=ar_pid)
        wait_pools_full(client, timeout=30)
        assert client.list_tickets() == []
