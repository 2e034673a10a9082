"""Two processes of one replica id, with real processes: the second is refused, the first serves on.

Found black-box: a `dit-0` started beside a running one with another lock folder (as on another
host) registered a new incarnation, which the broker took as proof that the first was gone: the
first's tickets ended, it failed stop, and 6 of 8 generations in flight failed. Now the broker asks
the registered incarnation at its endpoint first: while it answers, the newcomer is refused
`ALREADY_EXISTS REPLICA_ID_IN_USE` and exits 2 with the broker's message; the first keeps its id and
its generations. Once the first is killed (`kill -9`), a new process takes the id at once: well
within the old lease (the takeover logs `replica_new_incarnation` with `old_was_up: true`).

The broker's lease is long (60 s) so that "at once" is told apart from "after the lease lapsed";
the duplicate reads the same config with a 1 s lease, which is only how long it asks again before
it gives up (twice its lease), so the test does not wait two minutes for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from kvrelay.client import GenerationState, KvRelayClient
from tests.procs import ServiceProcess, start_service

pytestmark = pytest.mark.slow

LEASE_S = 60.0
# The duplicates' lease: they ask again for twice that long after the first refusal, then give up.
DUPLICATE_LEASE_S = 1.0


def _config(repo_root: Path, tmp_path: Path, name: str, lease_s: float) -> Path:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "journal.sqlite"), lease_seconds=lease_s)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _dit(config: Path, broker: str, lock_dir: Path, cwd: Path) -> ServiceProcess:
    lock_dir.mkdir(exist_ok=True)
    return start_service(
        ["dit", "--config", str(config), "--replica", "0", "--broker", broker, "--port", "0", "--metrics-port", "0"],
        cwd=cwd, env={"KVRELAY_LOCK_DIR": str(lock_dir)}, timeout=120,
    )  # fmt: skip


def _events(proc: ServiceProcess, event: str) -> list[dict[str, Any]]:
    found = []
    for line in list(proc.lines):
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found


def _dit0(client: KvRelayClient) -> Any:
    (dit,) = [r for r in client.list_replicas() if r.replica_id == "dit-0"]
    return dit


def _stop(procs: list[ServiceProcess]) -> None:
    """Every replica process at once (SIGTERM, then each waited for; on a loaded machine each
    takes seconds to exit, one after another they took most of a minute), the broker last."""
    broker, replicas = procs[:1], procs[1:]
    for proc in replicas:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
    for proc in replicas:
        try:
            proc.proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.stop(5)  # SIGTERM again (a fast stop), then SIGKILL
    for proc in broker:
        proc.stop(20)


def _wait(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_second_process_of_a_replica_id_is_refused_and_a_killed_ones_successor_takes_over(
    repo_root: Path, tmp_path: Path
) -> None:
    config = _config(repo_root, tmp_path, "node", LEASE_S)
    short = _config(repo_root, tmp_path, "duplicate", DUPLICATE_LEASE_S)
    procs: list[ServiceProcess] = []
    try:
        broker = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=tmp_path)
        procs.append(broker)
        procs.append(start_service(
            ["ar", "--config", str(config), "--replica", "0", "--broker", broker.address, "--port", "0",
             "--metrics-port", "0"],
            cwd=tmp_path, env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks-a")}, timeout=120,
        ))  # fmt: skip
        first = _dit(config, broker.address, tmp_path / "locks-a", tmp_path)
        procs.append(first)
        with KvRelayClient(broker.address, timeout=60) as client:
            _wait("dit-0 registered", lambda: any(r.replica_id == "dit-0" and r.up for r in client.list_replicas()), 120)
            registered = _dit0(client)
            assert first.address.endswith(registered.endpoint.rsplit(":", 1)[1])

            # Generations run on the first while the duplicate starts, is refused and gives up.
            results: list[Any] = []
            stop = threading.Event()

            def generate() -> None:
                with KvRelayClient(broker.address, timeout=60) as own:
                    generate_with(own)

            def generate_with(client: KvRelayClient) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    handle = client.generate("a cat", seed=n, width=64, height=64, num_inference_steps=20,
                                             request_id=f"during-{n}", timeout=120)  # fmt: skip
                    try:
                        handle.result()
                    except Exception as err:  # noqa: BLE001 - counted and reported below
                        results.append(err)
                        continue
                    results.append(client.get_generation(f"during-{n}"))

            loop = threading.Thread(target=generate, daemon=True)
            loop.start()
            # Another lock folder: the lock does not stop it, as on another host. A duplicate AR
            # starts beside it (its start-up and refusal overlap the DiT's, where in turn they
            # made the test a few process start-ups longer): refused alike, checked below.
            _wait("ar-0 registered", lambda: any(r.replica_id == "ar-0" and r.up for r in client.list_replicas()), 120)
            (ar,) = [r for r in client.list_replicas() if r.replica_id == "ar-0"]
            duplicate = _dit(short, broker.address, tmp_path / "locks-b", tmp_path)
            procs.append(duplicate)
            ar_duplicate = start_service(
                ["ar", "--config", str(short), "--replica", "0", "--broker", broker.address, "--port", "0",
                 "--metrics-port", "0"],
                cwd=tmp_path, env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks-b")}, timeout=120,
            )  # fmt: skip
            procs.append(ar_duplicate)
            code = duplicate.proc.wait(90)
            ar_code = ar_duplicate.proc.wait(90)
            stop.set()
            loop.join(150)
            assert not loop.is_alive(), "the generation loop did not end"

            out = duplicate.output()
            assert code == 2, out
            assert "kvrelay dit: the broker refused registration: ALREADY_EXISTS REPLICA_ID_IN_USE" in out, out
            assert f"replica dit-0 is in use: its registered process answers at {registered.endpoint}" in out, out
            assert _events(duplicate, "replica_id_in_use"), out
            assert not _events(duplicate, "deregister_failed"), out
            refused = [e for e in _events(broker, "replica_id_in_use_refused") if e.get("replica_id") == "dit-0"]
            assert refused and refused[0]["live_endpoint"] == registered.endpoint, broker.output()

            # The first kept its id, its process, and every generation.
            assert first.proc.poll() is None, first.output()
            assert _dit0(client).endpoint == registered.endpoint and _dit0(client).up
            assert results, "no generation ran while the duplicate tried"
            failed = [r for r in results if isinstance(r, Exception) or r.state != GenerationState.SUCCEEDED]
            assert failed == [], failed
            assert all(r.attempt == 1 for r in results), [r.attempt for r in results]
            assert not _events(first, "replica_superseded") and not _events(broker, "replica_new_incarnation")
            assert client.generate("after", seed=7, width=64, height=64, num_inference_steps=2,
                                   timeout=120).result().png  # fmt: skip

            # The AR was refused alike (exit 2, the broker's message), and the live ar-0 serves on.
            assert ar_code == 2, ar_duplicate.output()
            assert not _events(ar_duplicate, "deregister_failed"), ar_duplicate.output()  # it never registered
            assert ("kvrelay ar: the broker refused registration: ALREADY_EXISTS REPLICA_ID_IN_USE: replica ar-0 is in "
                    f"use: its registered process answers at {ar.endpoint}") in ar_duplicate.output(), ar_duplicate.output()
            (still,) = [r for r in client.list_replicas() if r.replica_id == "ar-0"]
            assert still.endpoint == ar.endpoint and still.up

            # kill -9 of the first (and its ranks, which die with it): a new process (another lock
            # folder, as on another host) takes the id at once, long before the 60 s lease lapses.
            main = psutil.Process(first.proc.pid)
            ranks = main.children(recursive=True)
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            psutil.wait_procs(ranks, timeout=20)
            killed_at = time.monotonic()
            successor = _dit(config, broker.address, tmp_path / "locks-b", tmp_path)
            procs.append(successor)
            _wait("the successor registered",
                  lambda: _dit0(client).endpoint != registered.endpoint and _dit0(client).up, 60)  # fmt: skip
            took = time.monotonic() - killed_at
            (takeover,) = _events(broker, "replica_new_incarnation")
            # Within the old lease: the successor did not wait for it to lapse.
            assert takeover["old_was_up"] is True, (took, takeover)
            assert client.generate("successor", seed=8, width=64, height=64, num_inference_steps=2,
                                   timeout=120).result().png  # fmt: skip
    finally:
        _stop(procs)


def test_a_stopped_one_is_taken_over_and_fails_stop_when_it_resumes(repo_root: Path, tmp_path: Path) -> None:
    """A process stopped with SIGSTOP (and its ranks) accepts connections and answers nothing: the
    probe's 1.5 s pass and a new process of its id takes over, as before the check; when the
    stopped one resumes, its next heartbeat is refused and it fails stop (exit 3), leaving the
    successor serving."""
    config = _config(repo_root, tmp_path, "node", LEASE_S)
    procs: list[ServiceProcess] = []
    stopped: list[psutil.Process] = []
    try:
        broker = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=tmp_path)
        procs.append(broker)
        procs.append(start_service(
            ["ar", "--config", str(config), "--replica", "0", "--broker", broker.address, "--port", "0",
             "--metrics-port", "0"],
            cwd=tmp_path, env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks-a")}, timeout=120,
        ))  # fmt: skip
        first = _dit(config, broker.address, tmp_path / "locks-a", tmp_path)
        procs.append(first)
        with KvRelayClient(broker.address, timeout=60) as client:
            _wait("dit-0 registered", lambda: any(r.replica_id == "dit-0" and r.up for r in client.list_replicas()), 120)
            registered = _dit0(client)
            main = psutil.Process(first.proc.pid)
            stopped = [main, *main.children(recursive=True)]
            for proc in stopped:
                os.kill(proc.pid, signal.SIGSTOP)
            successor = _dit(config, broker.address, tmp_path / "locks-b", tmp_path)
            procs.append(successor)
            _wait("the successor registered",
                  lambda: _dit0(client).endpoint != registered.endpoint and _dit0(client).up, 60)  # fmt: skip
            (takeover,) = _events(broker, "replica_new_incarnation")
            assert takeover["old_was_up"] is True, takeover  # within the stopped one's lease
            assert not _events(broker, "replica_id_in_use_refused")
            assert not _events(successor, "replica_id_in_use")

            for proc in stopped:
                os.kill(proc.pid, signal.SIGCONT)
            stopped = []
            assert first.proc.wait(90) == 3, first.output()
            assert _dit0(client).endpoint != registered.endpoint and _dit0(client).up
            assert client.generate("after", seed=9, width=64, height=64, num_inference_steps=2,
                                   timeout=120).result().png  # fmt: skip
    finally:
        for proc in stopped:
            os.kill(proc.pid, signal.SIGCONT)
        _stop(procs)
