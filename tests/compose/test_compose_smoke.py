"""The compose deployment, run for real: scripts/compose_smoke.sh (profile cpu) under pytest.

It builds the CPU image, brings broker, AR and DiT up under compose, generates an image from the
host, checks the PNG, the published metrics and the page pool, crashes the DiT and expects the
engine to restart it and the next request to succeed, then `compose down -v`. It is skipped only
where no container engine exists (no Docker daemon answers and podman is not installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def container_engine() -> str | None:
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return "docker"
    if shutil.which("podman") is not None:
        return "podman"
    return None


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_compose_cpu_profile_serves_restarts_and_cleans_up(repo_root: Path) -> None:
    engine = container_engine()
    if engine is None:
        pytest.skip("no container engine here: no Docker daemon answers `docker info` and podman is not installed")
    proc = subprocess.run(
        ["bash", str(repo_root / "scripts" / "compose_smoke.sh")],
        cwd=repo_root, capture_output=True, text=True, timeout=2900,
        env={**os.environ, "KVRELAY_CONTAINER_ENGINE": engine},
    )
    summary = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("compose_smoke:"))
    print(summary)
    assert proc.returncode == 0, f"compose_smoke.sh exited {proc.returncode}:\n{proc.stderr[-12000:]}"
    assert "compose_smoke: PASSED" in proc.stderr
    # `compose down -v` left nothing behind: no container and no journal volume of that project.
    project = next(line.split("project ")[-1] for line in proc.stderr.splitlines() if "compose_smoke: project " in line)
    containers = subprocess.run([engine, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    volumes = subprocess.run([engine, "volume", "ls", "--format", "{{.Name}}"], capture_output=True, text=True)
    assert project not in containers.stdout and project not in volumes.stdout, (containers.stdout, volumes.stdout)
