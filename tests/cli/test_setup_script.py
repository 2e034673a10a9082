"""scripts/setup.sh on a machine that has everything: a fresh user's quickstart once printed
`setup: installing Debian packages: libibverbs1` (and ran apt-get) on its second run, with the
library installed: `ldconfig -p | grep -q` under `set -o pipefail` fails whenever grep stops at the
match before ldconfig has written the whole cache (SIGPIPE), which a user without sudo saw as
"not root and no sudo: install these Debian packages". The script runs here in a copy of the
repository's layout with a venv that is already set up and stand-ins for ldconfig, apt-get and
sudo, so nothing is installed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Prints the cache with libibverbs on its first line, then far more than a pipe holds: a reader
# that stops at the first match leaves this writer to die of SIGPIPE (exit 141), every time.
FAKE_LDCONFIG = """#!/bin/bash
{match}
yes '	libfoo.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libfoo.so.1' | head -n 200000
"""
RECORDER = """#!/bin/bash
echo "$(basename "$0") $*" >> "{log}"
exit 1
"""


def _run_setup(tmp_path: Path, *, has_libibverbs: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/setup.sh", root / "scripts/setup.sh")
    (root / "requirements").mkdir()
    for name in ("pyproject.toml", "requirements/constraints.txt"):
        shutil.copy(REPO / name, root / name)
    # A venv that setup.sh already finished: its python exists and the stamp matches.
    (root / ".venv/bin").mkdir(parents=True)
    (root / ".venv/bin/python").write_text("#!/bin/sh\nexit 0\n")
    (root / ".venv/bin/python").chmod(0o755)
    digest = hashlib.sha256(
        (root / "pyproject.toml").read_bytes() + (root / "requirements/constraints.txt").read_bytes()
    ).hexdigest()
    (root / ".venv/.kvrelay-setup").write_text(digest + "\n")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "installers.log"
    match = (
        "echo '	libibverbs.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libibverbs.so.1'"
        if has_libibverbs
        else ""
    )
    tools = {
        "ldconfig": FAKE_LDCONFIG.format(match=match),
        "apt-get": RECORDER.format(log=log),
        "sudo": RECORDER.format(log=log),
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(root / "scripts/setup.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, log.read_text() if log.exists() else ""


def test_setup_finds_an_installed_libibverbs_however_early_grep_stops(tmp_path: Path) -> None:
    proc, installers = _run_setup(tmp_path, has_libibverbs=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing Debian packages" not in proc.stdout + proc.stderr
    assert installers == ""
    assert "setup: ready (.venv/bin/kvrelay)" in proc.stdout


def test_setup_still_installs_a_missing_libibverbs(tmp_path: Path) -> None:
    proc, installers = _run_setup(tmp_path, has_libibverbs=False)
    assert "setup: installing Debian packages: libibverbs1" in proc.stdout
    # Root calls apt-get directly, anyone else through sudo: either stand-in records the call
    # and fails it, which stops setup.sh (set -e) before anything else.
    assert installers.startswith(("apt-get update", "sudo apt-get update")), installers
    assert proc.returncode != 0
