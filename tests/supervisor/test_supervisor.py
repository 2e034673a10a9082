"""`kvrelay up` / Node: start order, readiness, restart with backoff, clean stop, no orphans.

Children are real processes serving real gRPC health (tests/supervisor/health_child.py, started
with the exact argv `kvrelay broker|ar|dit` would get), plus the real `kvrelay broker`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.node.supervisor import Node, SupervisorError, plan_children, run_up, start_node

REPO = Path(__file__).resolve().parents[2]
CHILD = str(Path(__file__).with_name("health_child.py"))
COMMAND = [sys.executable, CHILD]
BASE_CONFIG = REPO / "tests" / "configs" / "test-fast.yaml"


def write_config(tmp_path: Path, ar_replicas: int = 1, dit_replicas: int = 2) -> Path:
    data = yaml.safe_load(BASE_CONFIG.read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    data["stages"][0]["num_replicas"] = ar_replicas
    data["stages"][1]["num_replicas"] = dit_replicas
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir()
    yield path
    # Whatever a test left behind (it should be nothing): kill what these tests started, by pid.
    for record in records(path):
        for pid in (record.get("pid"), record.get("grandchild")):
            if isinstance(pid, int) and alive(pid) and _started_by_us(pid, record):
                os.kill(pid, signal.SIGKILL)


def _started_by_us(pid: int, record: dict[str, Any]) -> bool:
    try:
        return psutil.Process(pid).create_time() <= record["started"] + 5
    except psutil.NoSuchProcess:
        return False


def records(state_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(state_dir.glob("*.json")):
        out.append(json.loads(path.read_text()))
    return sorted(out, key=lambda r: r["started"])


def by_name(state_dir: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in records(state_dir) if r["name"] == name]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_pids(state_dir: Path) -> list[int]:
    pids = []
    for record in records(state_dir):
        pids += [p for p in (record.get("pid"), record.get("grandchild")) if isinstance(p, int)]
    return pids


def wait_dead(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def node_env(state_dir: Path, behaviour: dict[str, Any] | None = None) -> dict[str, str]:
    return {"CHILD_STATE_DIR": str(state_dir), "CHILD_BEHAVIOUR": json.dumps(behaviour or {})}


def test_plan_gives_every_replica_its_own_port_and_the_broker_address(tmp_path: Path) -> None:
    from kvrelay.config import load_config

    path = write_config(tmp_path, ar_replicas=2, dit_replicas=3)
    phases = plan_children(path, load_config(path), command=["X"])
    assert [[s.name for s in phase] for phase in phases] == [
        ["broker"],
        ["ar-0", "ar-1", "dit-0", "dit-1", "dit-2"],
    ]
    broker = phases[0][0]
    ports = {s.address for phase in phases for s in phase} | {s.metrics for phase in phases for s in phase}
    assert len(ports) == 12  # 6 gRPC + 6 metrics, all distinct
    for spec in phases[1]:
        argv = list(spec.argv)
        assert argv[:4] == ["X", spec.role, "--config", str(path)]
        assert argv[argv.index("--replica") + 1] == spec.name.split("-")[1]
        assert argv[argv.index("--broker") + 1] == broker.address
        assert spec.address.endswith(":" + argv[argv.index("--port") + 1])
    # Fixed ports in the config are used as they are: port_for(N) = base + N.
    data = yaml.safe_load(path.read_text())
    data["broker"]["port"], data["stages"][1]["port"] = 50551, 50571
    path.write_text(yaml.safe_dump(data))
    phases = plan_children(path, load_config(path), command=["X"], host="0.0.0.0")
    assert phases[0][0].address == "127.0.0.1:50551"
    assert [s.address for s in phases[1] if s.role == "dit"] == [
        "127.0.0.1:50571",
        "127.0.0.1:50572",
        "127.0.0.1:50573",
    ]
    assert all(s.argv[-2:] == ("--host", "0.0.0.0") for phase in phases for s in phase)


def test_ports_picked_for_port_0_are_outside_the_ephemeral_range(tmp_path: Path) -> None:
    """A picked port is kept across restarts; one from the ephemeral range can meanwhile be the local
    port of an outgoing connection, and the restarted child cannot bind it (a broker stayed down a
    minute: 'port 58323 (broker metrics) is already in use')."""
    from kvrelay.config import load_config
    from kvrelay.ports import ephemeral_port_range, is_port_free

    low, high = ephemeral_port_range()
    # The hazard: a connection whose local port is P keeps a listener from binding P.
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.bind(("127.0.0.1", 0))
        client.connect(server.getsockname())
        assert not is_port_free("127.0.0.1", client.getsockname()[1])
    path = write_config(tmp_path, ar_replicas=2, dit_replicas=2)
    for _ in range(5):
        phases = plan_children(path, load_config(path), command=["X"])
        ports = [int(a.rsplit(":", 1)[1]) for phase in phases for s in phase for a in (s.address, s.metrics)]
        assert len(set(ports)) == 10
        assert not [p for p in ports if low <= p <= high], (ports, (low, high))

def test_node_starts_the_broker_first_then_every_replica_and_says_where(
    tmp_path: Path, state_dir: Path
) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=2)
    with start_node(path, command=COMMAND, log_dir=tmp_path / "logs", env=node_env(state_dir)) as node:
        infos = node.processes()
        assert [p.name for p in infos] == ["broker", "ar-0", "dit-0", "dit-1"]
        assert all(p.serving and p.pid and alive(p.pid) for p in infos)
        assert all(serving(p.address) for p in infos)
        broker = by_name(state_dir, "broker")[0]
        for name in ("ar-0", "dit-0", "dit-1"):
            [replica] = by_name(state_dir, name)
            assert replica["broker_checked"] == node.address()
            assert replica["started"] >= broker["serving"]  # started only once the broker was SERVING
        table = node.describe()
        for p in infos:
            assert p.name in table and p.address in table and str(p.pid) in table
        assert (tmp_path / "logs" / "dit-1.log").read_text().count("dit-1 listening on") == 1
        pids = all_pids(state_dir)
    assert wait_dead(pids) == []


def test_children_get_grpc_core_logs_at_error_unless_the_user_chose(
    tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC core's INFO lines ("Got goaway" from a channel to a child that stopped) were printed at
    # every stop of a node; kvrelay/logging.py GRPC_CORE_LOG_DEFAULTS.
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    monkeypatch.delenv("GRPC_TRACE", raising=False)
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    for chosen in (None, "INFO"):
        if chosen is not None:
            monkeypatch.setenv("GRPC_VERBOSITY", chosen)
        with start_node(path, command=COMMAND, roles=("broker",), log_dir=tmp_path / "logs",
                        env=node_env(state_dir)) as node:  # fmt: skip
            pid = node.processes()[0].pid
        [broker] = [r for r in by_name(state_dir, "broker") if r["pid"] == pid]
        assert broker["grpc_verbosity"] == (chosen or "ERROR")
        assert wait_dead([pid]) == []


def test_a_replica_that_exits_is_restarted_on_the_same_address(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    with start_node(path, command=COMMAND, env=node_env(state_dir), backoff_initial=0.2) as node:
        old = node.process("dit-0")
        [record] = by_name(state_dir, "dit-0")
        os.kill(old.pid, signal.SIGKILL)
        new = node.wait_serving("dit-0", timeout=30, not_pid=old.pid)
        assert new.restarts == 1 and new.address == old.address
        assert serving(new.address)
        # The dead replica's leftovers (its grandchild, same process group) are gone too.
        assert wait_dead([record["grandchild"]]) == []
        assert node.process("ar-0").restarts == 0 and node.process("broker").restarts == 0
        pids = all_pids(state_dir)
    assert wait_dead(pids) == []


def test_restarts_back_off_exponentially_up_to_the_cap(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    behaviour = {"ar-0": {"crash_after": 0.6, "grandchild": False}}
    initial, cap = 0.3, 1.2
    node = start_node(
        path, command=COMMAND, env=node_env(state_dir, behaviour), backoff_initial=initial, backoff_max=cap
    )
    try:
        deadline = time.monotonic() + 60
        while len(by_name(state_dir, "ar-0")) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        node.stop()
    runs = by_name(state_dir, "ar-0")
    assert len(runs) >= 6
    for i in range(5):
        expected = min(cap, initial * 2**i)
        gap = runs[i + 1]["started"] - runs[i]["exited"]
        assert expected <= gap < expected + 2.0, (i, gap, expected)
    assert node.process("broker").restarts == 0


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    behaviour = {"dit-0": {"ignore_sigterm": True}}
    node = start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), grace=1.0)
    pids = all_pids(state_dir)
    assert len(pids) == 6 and all(alive(p) for p in pids)
    started = time.monotonic()
    node.stop()
    assert 1.0 <= time.monotonic() - started < 8
    assert wait_dead(pids, timeout=5) == []
    assert by_name(state_dir, "ar-0")[0]["exit_code"] == 0  # the polite one stopped cleanly
    assert "exit_code" not in by_name(state_dir, "dit-0")[0]  # the stubborn one was killed


def test_a_child_that_dies_during_startup_fails_the_start_and_nothing_is_left(
    tmp_path: Path, state_dir: Path
) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=2)
    behaviour = {"dit-1": {"exit_at_start": 7}}
    with pytest.raises(SupervisorError) as info:
        start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), log_dir=tmp_path / "logs")
    # The headline carries what the child printed about why (a checkpoint that does not load,
    # say), then the tail of its log.
    assert str(info.value).splitlines()[0] == (
        "dit-1 exited with code 7 before it was SERVING: kvrelay dit: dit-1: exiting at start as asked"
    )
    assert "--- last lines of" in str(info.value)
    assert wait_dead(all_pids(state_dir)) == []


def test_a_child_never_serving_times_out_and_nothing_is_left(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    behaviour = {"ar-0": {"serving_delay": 60}}
    started = time.monotonic()
    with pytest.raises(SupervisorError, match="not SERVING within 3s: ar-0"):
        start_node(path, command=COMMAND, env=node_env(state_dir, behaviour), ready_timeout=3)
    assert time.monotonic() - started < 20
    assert wait_dead(all_pids(state_dir)) == []


def _up_process(
    tmp_path: Path, state_dir: Path, path: Path, behaviour: dict[str, Any] | None = None, log_dir: bool = True
) -> subprocess.Popen[str]:
    code = (
        "import argparse, sys\n"
        "from kvrelay.node.supervisor import run_up\n"
        f"args = argparse.Namespace(config={str(path)!r}, host=None, log_dir={str(tmp_path / 'logs') if log_dir else None!r},"
        " log_level=None, ready_timeout=60)\n"
        f"sys.exit(run_up(args, command=[sys.executable, {CHILD!r}]))\n"
    )
    # TMPDIR: kvrelay up's copy of the config goes under the test's folder (a SIGKILLed one leaves it).
    env = {**os.environ, **node_env(state_dir, behaviour), "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_up(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("try: kvrelay generate"):
            return lines
    proc.kill()
    raise AssertionError(
        "kvrelay up did not come up:\n" + "".join(lines) + (proc.stderr.read() if proc.stderr else "")
    )


def test_without_a_log_dir_stdout_is_the_node_report_and_the_childrens_output_is_on_stderr(
    tmp_path: Path, state_dir: Path
) -> None:
    # The children shared kvrelay up's stdout: their "listening on" lines (a JSON log, when not on
    # a terminal) came among the table's, and `kvrelay up > node.txt` got them all.
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    proc = _up_process(tmp_path, state_dir, path, log_dir=False)
    try:
        report = _wait_up(proc)
        pids = all_pids(state_dir)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and wait_dead(pids) == []
    lines = [line.rstrip("\n") for line in report] + rest.splitlines()
    assert lines[0].startswith("kvrelay up: every process is SERVING"), lines
    assert lines[1].split()[0] == "PROCESS" and [row.split()[0] for row in lines[2:5]] == ["broker", "ar-0", "dit-0"]
    assert lines[5].startswith("node metrics") and lines[6].startswith("try: kvrelay generate") and len(lines) == 7
    for name in ("broker", "ar-0", "dit-0"):
        assert f"{name} listening on" in err


# SIGHUP: the terminal or SSH session of `kvrelay up` went away. It used to kill the supervisor
# outright: the children got PDEATHSIG's SIGTERM all at once, the broker went first and an AR
# lingered 30 s as an orphan, reporting to a broker that was gone.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_kvrelay_up_stops_everything_and_leaves_no_process(
    tmp_path: Path, state_dir: Path, sig: signal.Signals
) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=2)
    proc = _up_process(tmp_path, state_dir, path)
    try:
        lines = _wait_up(proc)
        table = "".join(lines)
        for name in ("broker", "ar-0", "dit-0", "dit-1"):
            assert name in table
        pids = all_pids(state_dir)
        assert len(pids) == 8 and all(alive(p) for p in pids)
        # The supervisor's descendants are exactly these: nothing started behind our back.
        assert {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} == set(pids)
        proc.send_signal(sig)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert wait_dead(pids, timeout=5) == []
    assert all(r.get("exit_code") == 0 for r in records(state_dir))  # each child stopped gracefully
    # Replicas stop first (they deregister while the broker still listens), the broker last.
    broker_exit = by_name(state_dir, "broker")[0]["exited"]
    assert all(r["exited"] < broker_exit for r in records(state_dir) if r["name"] != "broker")


def test_ctrl_c_while_starting_stops_what_was_started_and_exits_130(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    proc = _up_process(tmp_path, state_dir, path, behaviour={"dit-0": {"serving_delay": 120}})
    try:
        deadline = time.monotonic() + 60
        while not by_name(state_dir, "dit-0") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert by_name(state_dir, "dit-0"), "dit-0 never started"
        time.sleep(0.3)  # let it start its grandchild
        pids = all_pids(state_dir)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert wait_dead(pids, timeout=5) == []
    assert wait_dead(all_pids(state_dir), timeout=5) == []


def test_kvrelay_up_killed_outright_still_takes_its_children_down(tmp_path: Path, state_dir: Path) -> None:
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    proc = _up_process(tmp_path, state_dir, path)
    try:
        _wait_up(proc)
        children = [r["pid"] for r in records(state_dir)]
        proc.kill()  # SIGKILL: no cleanup code runs; PR_SET_PDEATHSIG does the work
        proc.wait(10)
        assert wait_dead(children, timeout=15) == []
        assert all(r.get("exit_code") == 0 for r in records(state_dir))  # they got SIGTERM, not SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvrelay_up_rejects_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: []\nedges: []\nbogus: 1\n")
    args = argparse.Namespace(config=str(bad), host=None, log_dir=None, log_level=None, ready_timeout=5)
    assert run_up(args, command=COMMAND) == 2
    assert "bogus" in capsys.readouterr().err


def test_the_real_broker_under_supervision_is_restarted_when_killed(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    with start_node(
        path, roles=("broker",), log_dir=tmp_path / "logs", backoff_initial=0.2, cwd=tmp_path
    ) as node:
        info = node.process("broker")
        assert serving(info.address)
        assert info.metrics and info.metrics != info.address
        os.kill(info.pid, signal.SIGKILL)
        again = node.wait_serving("broker", timeout=60, not_pid=info.pid)
        assert again.address == info.address and serving(again.address)
        pid = again.pid
    assert wait_dead([info.pid, pid]) == []
    assert "kvrelay broker listening on" in (tmp_path / "logs" / "broker.log").read_text()


def test_node_is_reusable_as_a_plain_object(tmp_path: Path, state_dir: Path) -> None:
    node = Node(
        plan_children(write_config(tmp_path, 1, 1), _load(tmp_path), command=COMMAND, roles=("broker",)),
        env=node_env(state_dir),
    )
    with node:
        assert node.running and node.process("broker").serving
    assert not node.running
    node.stop()  # idempotent
    assert wait_dead(all_pids(state_dir)) == []


def _load(tmp_path: Path) -> Any:
    from kvrelay.config import load_config

    return load_config(tmp_path / "node.yaml")


def test_a_restarted_child_runs_the_config_kvrelay_up_started_with_not_an_edit(
    tmp_path: Path, state_dir: Path
) -> None:
    # The children read the file named on the command line: a replica restarted after the file
    # was edited ran the edit beside processes still on the old config, and an invalid edit made it
    # exit 2, which stopped the whole serving node (found black-box: page_size: 0 written into the
    # config of a running node, then a DiT crash). Every child now runs kvrelay up's own copy.
    path = write_config(tmp_path, ar_replicas=1, dit_replicas=1)
    original = path.read_bytes()
    proc = _up_process(tmp_path, state_dir, path, {"dit-0": {"crash_after": 1.0, "grandchild": False}})
    try:
        _wait_up(proc)
        path.write_text(path.read_text().replace("page_size:", "page_size: 0\n  bogus:"))
        deadline = time.monotonic() + 30
        while len(by_name(state_dir, "dit-0")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        runs = by_name(state_dir, "dit-0")
        assert len(runs) >= 2, runs
        used = [Path(r["argv"][r["argv"].index("--config") + 1]) for r in runs + by_name(state_dir, "broker")]
        assert len(set(used)) == 1 and used[0] != path, used
        assert used[0].read_bytes() == original  # the restart got the config the node started with
        pids = all_pids(state_dir)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and wait_dead(pids) == []
    assert not used[0].parent.exists()  # the copy goes with the node


def test_picked_ports_are_never_handed_out_twice_nor_in_mooncakes_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """bind(0) twice in a row may return one port: a bench node got it for its AR's gRPC and
    metrics ('port 56787 is configured twice'). Mooncake engines take ports of their range later."""
    from kvrelay.ports import ephemeral_port_range, pick_free_port
    from kvrelay.server import reserve_free_port

    monkeypatch.setenv("MC_MIN_RPC_PORT", "15000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "32000")
    low, high = ephemeral_port_range()
    ports = [reserve_free_port() for _ in range(200)] + [pick_free_port("127.0.0.1", set()) for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if 15000 <= p <= 32000 or low <= p <= high]
