"""The `kvrelay` CLI as a new user meets it: every subcommand's --help works, and input it cannot
use (a config that is missing or not YAML, an unknown preset, a port in use) is one line naming
the problem, a non-zero exit and no traceback. Real processes, as a shell runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG_COMMANDS = ["up", "broker", "ar", "dit", "bench"]


def kvrelay(*argv: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
    # Console logs, as on a terminal: a service's error line is then the plain line a user reads.
    base.update(KVRELAY_LOG_FORMAT="console", KVRELAY_NATIVE_CAPTURE="0")
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**base, **(env or {})},
    )  # fmt: skip


def assert_one_clear_line(proc: subprocess.CompletedProcess[str], command: str, *names: str) -> None:
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvrelay {command}: "), err
    for name in names:
        assert name in lines[0], err


@pytest.fixture(scope="module")
def subcommands() -> list[str]:
    import argparse

    from kvrelay.node.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_subcommand_has_help(subcommands: list[str]) -> None:
    for command in subcommands:
        proc = kvrelay(command, "--help")
        assert proc.returncode == 0 and proc.stderr == "", (command, proc.stderr)
        assert proc.stdout.startswith(f"usage: kvrelay {command}"), (command, proc.stdout)


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_kvrelay_config_is_the_config_of_every_subcommand_without_config(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "from-env.yaml"
    proc = kvrelay(command, env={"KVRELAY_CONFIG": str(missing)})
    assert_one_clear_line(proc, command, f"config file not found: {missing}")
    assert proc.returncode == 2


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_a_missing_or_broken_config_is_one_line(command: str, tmp_path: Path) -> None:
    proc = kvrelay(command, "--config", str(tmp_path / "nope.yaml"))
    assert_one_clear_line(proc, command, f"config file not found: {tmp_path / 'nope.yaml'}")
    bad = tmp_path / "bad.yaml"
    bad.write_text("broker:\n  port: [50051\n")
    proc = kvrelay(command, "--config", str(bad))
    assert_one_clear_line(proc, command, f"invalid YAML in {bad} line 3 column 1")
