"""`kvrelay up` / Node after the start: a child that was SERVING and turns NOT_SERVING (a replica
whose broker refuses its credential) or stops answering (a wedged process) is reported in one
line naming it and its log, once, and once more when it serves again; it is never restarted for
it. Real children (tests/supervisor/health_child.py) serving real gRPC health."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvrelay.node import supervisor
from kvrelay.node.supervisor import Node, start_node
from tests.supervisor.test_supervisor import COMMAND, all_pids, node_env, state_dir, wait_dead, write_config

__all__ = ["state_dir"]  # the fixture, used by name

WATCH_S = 0.2


class Recorder:
    """The supervisor's logger, replaced: every event it logs, whatever structlog's configuration
    (a logger cached by an earlier test escapes structlog.testing.capture_logs)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, level: str) -> Callable[..., None]:
        def record(event: str, **fields: Any) -> None:
            with self._lock:
                self.events.append({"event": event, "log_level": level, **fields})

        return record


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    recorder = Recorder()
    monkeypatch.setattr(supervisor, "log", recorder)
    return recorder.events


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def events(logs: list[dict[str, Any]], name: str, child: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name and e.get("child") == child]


def _node(tmp_path: Path, state_dir: Path, behaviour: dict[str, Any]) -> Node:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    return start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), log_dir=tmp_path / "logs",
                      health_watch_seconds=WATCH_S)  # fmt: skip


def test_a_child_that_turns_not_serving_is_reported_once_and_again_when_it_serves(
    tmp_path: Path, state_dir: Path, logs: list[dict[str, Any]]
) -> None:
    with _node(tmp_path, state_dir, {"dit-0": {"health_file": True}}) as node:
        before = node.process("dit-0")
        (state_dir / "dit-0.health").write_text("NOT_SERVING")
        wait_for("dit-0 reported NOT_SERVING", lambda: node.process("dit-0").health_lost == "NOT_SERVING")
        assert "NOT_SERVING" in [line.split()[-1] for line in node.describe().splitlines() if line.startswith("dit-0")]
        # Many more checks, all NOT_SERVING: no second line.
        checks_later = time.monotonic() + 10 * WATCH_S
        wait_for("ten more health checks", lambda: time.monotonic() > checks_later)
        (state_dir / "dit-0.health").write_text("SERVING")
        wait_for("dit-0 serving again", lambda: node.process("dit-0").health_lost is None)
        after = node.process("dit-0")
        pids = all_pids(state_dir)
    [lost] = events(logs, "child_not_serving", "dit-0")
    assert lost["health"] == "NOT_SERVING" and lost["pid"] == before.pid and lost["log_level"] == "warning"
    assert lost["see"].startswith(f"{tmp_path / 'logs' / 'dit-0.log'} ("), lost
    [back] = events(logs, "child_serving_again", "dit-0")
    assert back["was"] == "NOT_SERVING" and back["pid"] == before.pid
    # Not restarted, and nothing said of the others.
    assert after.pid == before.pid and after.restarts == 0 and after.serving
    assert not [e for e in logs if e["event"] in ("child_not_serving", "child_serving_again") and e["child"] != "dit-0"]
    assert wait_dead(pids) == []


def test_a_child_that_stops_answering_is_reported_and_again_when_it_answers(
    tmp_path: Path, state_dir: Path, logs: list[dict[str, Any]]
) -> None:
    with _node(tmp_path, state_dir, {}) as node:
        pid = node.process("ar-0").pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # ours: the node started it; wedged, but running
        try:
            wait_for("ar-0 reported not answering", lambda: node.process("ar-0").health_lost is not None)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for("ar-0 serving again", lambda: node.process("ar-0").health_lost is None)
        info = node.process("ar-0")
        pids = all_pids(state_dir)
    [lost] = events(logs, "child_not_serving", "ar-0")
    assert lost["health"] == "not answering its health check: DEADLINE_EXCEEDED", lost
    assert len(events(logs, "child_serving_again", "ar-0")) == 1
    assert info.pid == pid and info.restarts == 0
    assert wait_dead(pids) == []
