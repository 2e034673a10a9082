"""The checkout's wheel as the tests that read it get it (tests/foundation/conftest.py builds it once)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BuiltWheel:
    path: Path  # the one kvrelay-*.whl built
    output: str  # what `pip wheel -v` printed (stdout and stderr)


def build_wheel(repo_root: Path, into: Path) -> BuiltWheel:
    """`pip wheel --no-deps --no-build-isolation -v` of the checkout, which must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(into), str(repo_root)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = into.glob("kvrelay-*.whl")
    return BuiltWheel(wheel, done.stdout + done.stderr)
