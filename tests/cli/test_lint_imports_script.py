"""scripts/lint_imports.sh (a step of scripts/test.sh and of every commit) prints only its result:
from a fresh clone it began with `DeprecationWarning: The option 'config' is deprecated` (the
script passed import-linter's `--config`), which a new user running scripts/test.sh reads as
something wrong with the setup."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_lint_imports_checks_every_contract_without_a_deprecation_warning() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/lint_imports.sh")], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Deprecat" not in out, out
    # The contracts were read (pyproject.toml found without --config), every one of them, all kept.
    contracts = (REPO / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert contracts > 0 and f"Contracts: {contracts} kept, 0 broken." in out, out
