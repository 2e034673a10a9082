"""Run inside the vLLM engine process (through the handler's `OnWorkers`): hold every transport call
of the worker's KvRelayConnector until released, so a test can keep a write in the transport past
its timeout (IN_DOUBT) and then let it finish."""

from __future__ import annotations

import threading
from typing import Any

_STATE: dict[str, Any] = {}


def hold_transfers(worker: Any) -> None:
    from kvrelay.ar_service.vllm_connector import _worker_connector

    sender = _worker_connector()._sender
    gate = threading.Event()
    real = sender._transfer

    def transfer(*args: Any) -> Any:
        gate.wait(60)
        return real(*args)

    sender._transfer = transfer
    _STATE.update(gate=gate, real=real, sender=sender)


def release_transfers(worker: Any) -> None:
    if "gate" in _STATE:
        _STATE["gate"].set()
        _STATE["sender"]._transfer = _STATE.pop("real")
        _STATE.clear()


def finished_not_returned(worker: Any) -> list[str]:
    """The request ids the worker's connector keeps as finished but has not returned in
    finished_sending yet (a held row waiting for its release)."""
    from kvrelay.ar_service.vllm_connector import _worker_connector

    return sorted(_worker_connector()._worker.finished)
