"""The compose file is valid and runs the same topology as its config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvrelay.config import load_config


def test_compose_file_is_valid_and_matches_config(repo_root: Path) -> None:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is missing: scripts/setup.sh installs Debian's docker-compose")
    proc = subprocess.run(
        ["docker-compose", "-f", str(repo_root / "compose" / "docker-compose.yml"), "config"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rendered = yaml.safe_load(proc.stdout)
    assert set(rendered["services"]) == {"broker", "ar", "dit"}
    cfg = load_config(repo_root / "configs" / "compose-node.yaml")
    assert cfg.ar_stage.advertise_host == "ar" and cfg.dit_stage.advertise_host == "dit"
    for name in ("ar", "dit"):
        command = rendered["services"][name]["command"]
        assert command[0] == name and "--broker" in command
        assert rendered["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
