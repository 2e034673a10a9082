"""The wheel adds exactly one top-level package, and the service folders import under kvrelay."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.foundation.wheel import BuiltWheel


@pytest.mark.slow
def test_wheel_holds_only_the_kvrelay_package(built_wheel: BuiltWheel) -> None:
    wheel = built_wheel.path
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvrelay"}
    for sub in ("broker", "ar_service", "dit_service", "client", "v1", "models", "transfer"):
        assert f"kvrelay/{sub}/__init__.py" in names, sub
    assert "kvrelay/v1/broker_pb2.pyi" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvrelay = kvrelay.node.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_import_kvrelay_loads_no_torch_and_no_service() -> None:
    code = (
        "import sys, kvrelay, kvrelay.config, kvrelay.node.cli, kvrelay.client;"
        "bad = [m for m in ('torch', 'kvrelay.ar_service', 'kvrelay.dit_service', 'kvrelay.broker') if m in sys.modules];"
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_broker_process_modules_load_no_torch() -> None:
    code = (
        "import sys, kvrelay.broker.main, kvrelay.broker.service, kvrelay.broker.orchestrator;"
        "bad = [m for m in ('torch', 'kvrelay.ar_service', 'kvrelay.dit_service') if m in sys.modules];"
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_service_folders_import_under_kvrelay() -> None:
    import kvrelay.ar_service
    import kvrelay.broker
    import kvrelay.client
    import kvrelay.dit_service

    for mod, folder in (
        (kvrelay.broker, "broker"),
        (kvrelay.ar_service, "ar_service"),
        (kvrelay.dit_service, "dit_service"),
        (kvrelay.client, "client"),
    ):
        assert Path(mod.__file__).parent.name == folder


def test_cli_help_everywhere(python_exe: str) -> None:
    """`kvrelay --help`; every subcommand's --help (each one the parser has, not a list kept
    here) is tests/foundation/test_cli_errors.py::test_every_subcommand_has_help."""
    proc = subprocess.run([python_exe, "-m", "kvrelay", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: kvrelay" in proc.stdout
