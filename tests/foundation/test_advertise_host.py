"""`kvrelay ar|dit --advertise-host`: one config file for every host of a deployment.

Found setting up the broker, two ARs and two DiTs in five network namespaces by hand: the only way
to give each replica its own host's address was a per-host copy of the config with that stage's
`advertise_host` edited (`--host` moves the listener, not the address peers dial). Now the flag
sets it, for the process's own stage only, and the replica registers under it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay.client import KvRelayClient
from kvrelay.config import ConfigError, load_config
from kvrelay.node.supervisor import start_node
from tests.foundation.test_cli_errors import REPO, assert_one_clear_line, kvrelay

CONFIG = REPO / "tests" / "configs" / "test-fast.yaml"


def test_the_flag_replaces_only_its_own_stage_and_leaves_the_file_alone() -> None:
    cfg = load_config(CONFIG)
    dit = cfg.with_advertise_host("dit", "10.77.0.22")
    assert dit.dit_stage.advertise_host == "10.77.0.22"
    assert dit.ar_stage.advertise_host == cfg.ar_stage.advertise_host == "127.0.0.1"
    assert cfg.dit_stage.advertise_host == "127.0.0.1"  # a copy: the loaded config is unchanged
    ar = cfg.with_advertise_host("ar", "ar-host.example")
    assert (ar.ar_stage.advertise_host, ar.dit_stage.advertise_host) == ("ar-host.example", "127.0.0.1")
    assert cfg.with_advertise_host("dit", "fd00::5").dit_stage.advertise_host == "fd00::5"


@pytest.mark.parametrize("bad", ["", " 10.0.0.5", "10.0.0.5:50071", "[fd00::5]:50071", "http://10.0.0.5"])
def test_a_bad_value_names_the_flag(bad: str) -> None:
    with pytest.raises(ConfigError, match="--advertise-host"):
        load_config(CONFIG).with_advertise_host("dit", bad)


@pytest.mark.parametrize("command", ["ar", "dit"])
def test_a_bad_value_is_one_line_before_anything_starts(command: str) -> None:
    proc = kvrelay(command, "--config", str(CONFIG), "--advertise-host", "10.0.0.5:50071")
    assert proc.returncode == 2
    assert_one_clear_line(proc, command, "--advertise-host", "10.0.0.5:50071")


def test_a_replica_registers_under_the_advertised_host(tmp_path: Path) -> None:
    # `localhost` instead of the config's 127.0.0.1: an address of this host the test can tell
    # apart, that the broker does not need to dial (loopback from this host).
    with start_node(CONFIG, roles=("broker",), log_dir=tmp_path / "logs", cwd=tmp_path) as node:
        env = {**os.environ, "KVRELAY_NATIVE_CAPTURE": "0", "KVRELAY_LOCK_DIR": str(tmp_path / "locks")}
        env.pop("KVRELAY_CONFIG", None)
        dit = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "dit", "--config", str(CONFIG), "--broker", node.address(),
             "--port", "0", "--metrics-port", "0", "--advertise-host", "localhost"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with KvRelayClient(node.address()) as client:
                deadline = time.monotonic() + 90
                endpoints: list[str] = []
                while time.monotonic() < deadline and not endpoints:
                    assert dit.poll() is None, f"dit exited with {dit.returncode}"
                    endpoints = [r.endpoint for r in client.list_replicas() if r.replica_id == "dit-0" and r.up]
                    time.sleep(0.5)
            assert len(endpoints) == 1 and endpoints[0].startswith("localhost:"), endpoints
        finally:
            dit.terminate()
            try:
                dit.wait(30)
            except subprocess.TimeoutExpired:
                dit.kill()
                dit.wait()
