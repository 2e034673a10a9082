"""A node that tells the truth: taken ports, configuration errors and missing devices fail in one
clear line (before anything starts, or by stopping the node), never as a restart loop."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvrelay.node.supervisor import SupervisorError, run_up, start_node
from kvrelay.ports import Listen, PortInUse, check_ports_free
from tests.supervisor.test_supervisor import (
    COMMAND,
    all_pids,
    by_name,
    node_env,
    records,
    state_dir,  # noqa: F401 - fixture
    wait_dead,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_check_ports_free_names_the_port_and_its_holder() -> None:
    with _listening_socket() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(PortInUse) as err:
            check_ports_free([Listen("127.0.0.1", port, "broker gRPC")])
    message = str(err.value)
    assert f"port {port} (broker gRPC" in message
    assert f"pid {os.getpid()}" in message
    with pytest.raises(PortInUse, match="configured twice"):
        check_ports_free([Listen("127.0.0.1", 5, "a"), Listen("127.0.0.1", 5, "b")])
    check_ports_free([Listen("127.0.0.1", port, "free again")])  # released: no error


def test_a_taken_port_fails_up_before_anything_starts(
    tmp_path: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    with _listening_socket() as sock:
        port = sock.getsockname()[1]
        path = write_config(tmp_path, 1, 1)
        data = yaml.safe_load(path.read_text())
        data["stages"][1]["port"] = port
        path.write_text(yaml.safe_dump(data))
        args = argparse.Namespace(config=str(path), host=None, log_dir=None, log_level=None, ready_timeout=20)
        assert run_up(args, command=[*COMMAND]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvrelay up:")]
    assert len(err) == 1, err
    assert f"port {port} (dit-0 gRPC" in err[0] and f"pid {os.getpid()}" in err[0]
    assert records(state_dir) == []  # not even the broker was started


def test_a_child_config_error_at_start_is_one_line(tmp_path: Path, state_dir: Path) -> None:  # noqa: F811
    path = write_config(tmp_path, 1, 1)
    behaviour = {"ar-0": {"exit_at_start": 2}}
    with pytest.raises(SupervisorError) as info:
        start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), log_dir=tmp_path / "logs")
    assert str(info.value) == "ar-0: kvrelay ar: ar-0: exiting at start as asked"
    assert len(by_name(state_dir, "ar-0")) == 1
    assert wait_dead(all_pids(state_dir)) == []


@pytest.mark.parametrize(
    ("child", "code", "message"),
    [
        # A config error: its one line went to the terminal (stderr), unread by the supervisor; the
        # node's error said "see its log" although there was no log file.
        ("ar-0", 2, "ar-0: exited with code 2 (a configuration error: its own `kvrelay ar: ...` line is above on "
                    "stderr; with --log-dir, kvrelay up repeats it here)"),
        # A DiT whose checkpoint does not load exits 3 and prints `kvrelay dit: startup failed: FILE:
        # ...` to the terminal; the node's error said only "exited with code 3 before it was SERVING".
        ("dit-0", 3, "dit-0 exited with code 3 before it was SERVING: its own `kvrelay dit: ...` line (why) is "
                     "above on stderr; with --log-dir, kvrelay up repeats it here"),
    ],
)  # fmt: skip
def test_a_child_failing_its_start_without_a_log_dir_says_where_its_line_is(
    tmp_path: Path, state_dir: Path, child: str, code: int, message: str  # noqa: F811
) -> None:
    path = write_config(tmp_path, 1, 1)
    behaviour = {child: {"exit_at_start": code}}
    with pytest.raises(SupervisorError) as info:
        start_node(path, command=COMMAND, env=node_env(state_dir, behaviour))
    assert str(info.value) == message
    assert wait_dead(all_pids(state_dir)) == []


def test_a_node_not_serving_in_time_says_how_to_wait_longer(tmp_path: Path, state_dir: Path) -> None:  # noqa: F811
    # `kvrelay up --ready-timeout 1`: "not SERVING within 1s: ar-0, dit-0" and nothing more.
    path = write_config(tmp_path, 1, 1)
    behaviour = {"ar-0": {"serving_delay": 60}}
    with pytest.raises(SupervisorError) as info:
        start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), ready_timeout=2)
    assert str(info.value).startswith(
        "not SERVING within 2s: ar-0 (still starting: loading a model, registering page memory? a larger "
        "--ready-timeout waits longer; their logs say where they are)"
    )
    assert wait_dead(all_pids(state_dir)) == []


def test_a_config_error_after_start_stops_the_node_instead_of_restarting(
    tmp_path: Path, state_dir: Path  # noqa: F811
) -> None:
    path = write_config(tmp_path, 1, 1)
    behaviour = {"dit-0": {"crash_after": 0.3, "crash_code": 2}}
    node = start_node(
        path, command=COMMAND, env=node_env(state_dir, behaviour), log_dir=tmp_path / "logs", backoff_initial=0.1
    )
    try:
        deadline = time.monotonic() + 20
        while node.fatal_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.fatal_error == "dit-0: kvrelay dit: dit-0: crashing with code 2 as asked"
        time.sleep(0.5)  # several backoffs: no restart
        assert len(by_name(state_dir, "dit-0")) == 1
    finally:
        node.stop()
    assert wait_dead(all_pids(state_dir)) == []


@pytest.mark.slow
@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_gpu_config_on_a_host_without_that_gpu_fails_in_one_line(tmp_path: Path, role: str) -> None:
    import torch

    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    # One GPU more than this host has (none on a CPU host).
    index = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for stage in data["stages"]:
        stage["devices"] = str(index)
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = [sys.executable, "-m", "kvrelay", role, "--config", str(path), "--replica", "0",
            "--port", "0", "--metrics-port", "0", "--broker", "127.0.0.1:1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    record = json.loads(lines[0])  # KVRELAY_LOG_FORMAT=json: the line is wrapped, level error
    assert record["level"] == "error"
    lines = [record["line"]]
    assert lines[0].startswith(f"kvrelay {role}: stages[") and f"cuda:{index} configured" in lines[0]


@pytest.mark.slow
def test_an_advertised_endpoint_the_broker_cannot_reach_fails_up_instead_of_reporting_it_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    for stage in data["stages"]:
        stage.pop("kv_transfer_config")  # the gRPC fallback: no Mooncake needed for this
    # An address no host here has (TEST-NET-1). A name that does not resolve at all (like
    # configs/compose-node.yaml outside compose) is refused before the AR starts: tests/cli.
    data["stages"][0]["advertise_host"] = "192.0.2.1"
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    args = argparse.Namespace(
        config=str(path), host=None, log_dir=str(tmp_path / "logs"), log_level=None, ready_timeout=240
    )
    assert run_up(args) == 1
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("kvrelay up:")]
    assert len(err) == 1, captured.err
    # The broker dials what a replica advertises when it registers (UNREACHABLE_ENDPOINT), so the
    # AR exits before `up`'s own check of the SERVING replicas can run; either names the address.
    assert "ar-0 advertises 192.0.2.1:" in err[0], err[0]
    assert "UNREACHABLE_ENDPOINT" in err[0] or "does not answer from this host" in err[0], err[0]
    assert "every process is SERVING" not in captured.out


@pytest.mark.parametrize(("where", "key"), [("broker", "broker.host"), ("dit", "stages[1].host"), ("--host", "--host")])
def test_a_refused_non_loopback_bind_names_the_setting_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str, key: str
) -> None:
    for env in ("KVRELAY_REPLICA_TOKEN", "KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
        monkeypatch.delenv(env, raising=False)
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    if where == "broker":
        data["broker"]["host"] = "0.0.0.0"
    elif where == "dit":
        data["stages"][1]["host"] = "0.0.0.0"
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    args = argparse.Namespace(
        config=str(path), host="0.0.0.0" if where == "--host" else None, log_dir=None, log_level=None
    )
    assert run_up(args) == 2
    err = capsys.readouterr().err.strip()
    # Refused before anything starts, one line, "kvrelay up:" once (it used to be printed twice).
    assert err.startswith(f"kvrelay up: {key}: refusing to listen on 0.0.0.0"), err
    assert err.count("kvrelay up") == 1 and "\n" not in err
