"""The compose file: valid under docker-compose, one file with a cpu and a gpu profile that run the
topology of their configs, and the properties a deployment relies on (built images, healthchecks
through the kvrelay CLI, published metrics, the journal on a named volume, tokens without default,
restart policies). Engine-free: the real run is tests/compose/test_compose_smoke.py."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.config import load_config
from kvrelay.security import replica_token_for

COMPOSE_FILE = Path("compose") / "docker-compose.yml"
# Bound replica tokens: the broker's api and operator tokens and replica secret, each replica's own.
TOKENS = {"KVRELAY_API_TOKEN": "t-api", "KVRELAY_OPERATOR_TOKEN": "t-op", "KVRELAY_REPLICA_SECRET": "t-secret",
          "KVRELAY_AR0_TOKEN": "t-ar0", "KVRELAY_DIT0_TOKEN": "t-dit0"}  # fmt: skip
BROKER_SECRETS = ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_SECRET")
PROFILES = {
    "cpu": ("configs/compose-node-cpu.yaml", "localhost/kvrelay:cpu"),
    "gpu": ("configs/compose-node.yaml", "localhost/kvrelay:gpu"),
}


def _compose(
    repo_root: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is missing: scripts/setup.sh installs Debian's docker-compose")
    env_file = tmp_path / "kvrelay.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in (env if env is not None else TOKENS).items()))
    return subprocess.run(
        ["docker-compose", "-f", str(repo_root / COMPOSE_FILE), "--env-file", str(env_file), *args, "config"],
        capture_output=True, text=True, timeout=60, cwd=repo_root,
        # Only the env file speaks: the shell's own KVRELAY_* would take precedence over it.
        env={k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")},
    )


def _rendered(repo_root: Path, tmp_path: Path, profile: str) -> dict[str, Any]:
    proc = _compose(repo_root, tmp_path, "--profile", profile)
    assert proc.returncode == 0, proc.stderr
    services: dict[str, Any] = yaml.safe_load(proc.stdout)["services"]
    # docker-compose 1.x renders every service; the profile's are the ones it selects.
    return {name: svc for name, svc in services.items() if profile in svc.get("profiles", [])}


@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=["profile_cpu", "profile_gpu"])
def test_each_profile_is_broker_ar_dit_from_one_built_image(repo_root: Path, tmp_path: Path, profile: str) -> None:
    config_path, image = PROFILES[profile]
    services = _rendered(repo_root, tmp_path, profile)
    assert set(services) == {f"broker-{profile}", f"ar-{profile}", f"dit-{profile}"}
    cfg = load_config(repo_root / config_path)
    assert cfg.ar_stage.advertise_host == "ar" and cfg.dit_stage.advertise_host == "dit"
    assert cfg.security.replica_tokens == "bound"
    for role in ("broker", "ar", "dit"):
        svc = services[f"{role}-{profile}"]
        assert svc["image"] == image and svc["build"]["dockerfile"] == "compose/Dockerfile"
        assert svc["command"][0] == role and svc["command"][svc["command"].index("--config") + 1] == f"/opt/kvrelay/{config_path}"
        # Peers dial the names the config advertises.
        assert svc["networks"]["default"]["aliases"] == [role]
        assert svc["restart"] == "unless-stopped"
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kvrelay", "health"]
        port = {"broker": cfg.broker.port, "ar": cfg.ar_stage.port_for(0), "dit": cfg.dit_stage.port_for(0)}[role]
        assert test[test.index("--target") + 1] == f"127.0.0.1:{port}"
        metrics = {"broker": cfg.broker.metrics_port, "ar": cfg.ar_stage.metrics_port_for(0),
                   "dit": cfg.dit_stage.metrics_port_for(0)}[role]
        published = {p["target"] for p in svc["ports"]} if isinstance(svc["ports"][0], dict) else {
            int(str(p).split(":")[-1].split("/")[0]) for p in svc["ports"]}
        assert metrics in published, f"{role}: metrics port {metrics} not published"
        if role != "broker":
            assert "--broker" in svc["command"] and svc["depends_on"][f"broker-{profile}"]["condition"] == "service_healthy"
            # A replica holds its own token only (as $KVRELAY_REPLICA_TOKEN), never the secret.
            held = {k: v for k, v in svc["environment"].items() if v in TOKENS.values()}
            assert held == {"KVRELAY_REPLICA_TOKEN": TOKENS[f"KVRELAY_{role.upper()}0_TOKEN"]}
        else:
            assert cfg.broker.port in published
            assert any(v.startswith("kvrelay-journal:/opt/kvrelay/.kvrelay") for v in map(str, svc["volumes"])) or any(
                isinstance(v, dict) and v.get("source") == "kvrelay-journal" for v in svc["volumes"])
            held = {k: v for k, v in svc["environment"].items() if v in TOKENS.values()}
            assert held == {k: TOKENS[k] for k in BROKER_SECRETS}
    if profile == "gpu":
        for role in ("ar", "dit"):
            devices = services[f"{role}-gpu"]["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"]
    else:
        assert all(s.model.preset == "small" for s in cfg.stages)
        assert all(s.devices == "cpu" for s in cfg.stages)


@pytest.mark.parametrize("missing", sorted(TOKENS))
def test_compose_refuses_to_start_without_a_token(repo_root: Path, tmp_path: Path, missing: str) -> None:
    env = {k: v for k, v in TOKENS.items() if k != missing}
    proc = _compose(repo_root, tmp_path, "--profile", "cpu", env=env)
    assert proc.returncode != 0 and missing in proc.stderr
    proc = _compose(repo_root, tmp_path, "--profile", "cpu", env={**env, missing: ""})
    assert proc.returncode != 0 and missing in proc.stderr


def test_build_context_keeps_the_venv_and_secrets_out(repo_root: Path) -> None:
    lines = [
        line.strip() for line in (repo_root / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # An allow-list: everything is ignored, then only what the Dockerfile copies comes back.
    assert lines[0] == "*"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    copied = set()
    for line in (repo_root / "compose" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied.update(line.split()[1:-1])
    assert copied <= allowed, f"the Dockerfile copies what the context leaves out: {copied - allowed}"
    assert not any(a.startswith((".venv", ".git", "compose", ".kvrelay")) for a in allowed)
    # `pip install .` in the image needs every folder the wheel maps (pyproject's package-dir).
    pyproject = tomllib.loads((repo_root / "pyproject.toml").read_text())
    sources = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert sources <= copied, f"pyproject maps folders the image does not copy: {sources - copied}"


def test_the_docs_env_file_snippet_derives_the_replica_tokens_from_the_secret(repo_root: Path, tmp_path: Path) -> None:
    """docs/operations.md's snippet that writes compose/kvrelay.env, run as a user would (bash,
    `kvrelay` on PATH, from a checkout): every key the template lists, the file private, fresh
    random secrets, and each replica's token the one the broker derives for its id (a made-up
    token would be refused at registration)."""
    text = (repo_root / "docs" / "operations.md").read_text()
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S) if "> compose/kvrelay.env" in b]
    assert len(blocks) == 1, "docs/operations.md: one block writes compose/kvrelay.env"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvrelay").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvrelay "$@"\n')
    (bin_dir / "kvrelay").chmod(0o755)
    checkout = tmp_path / "checkout"
    (checkout / "compose").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(repo_root))
    for run in (1, 2):
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[0]], cwd=checkout, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        path = checkout / "compose" / "kvrelay.env"
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, oct(path.stat().st_mode)
        values = dict(line.split("=", 1) for line in path.read_text().splitlines())
        template = (repo_root / "compose" / "kvrelay.env.example").read_text().splitlines()
        assert list(values) == [line.split("=", 1)[0] for line in template if line and not line.startswith("#")]
        assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values.values()), values
        assert len(set(values.values())) == len(values)
        secret = values["KVRELAY_REPLICA_SECRET"]
        assert values["KVRELAY_AR0_TOKEN"] == replica_token_for(secret, "ar-0")
        assert values["KVRELAY_DIT0_TOKEN"] == replica_token_for(secret, "dit-0")
        if run == 1:
            first = values
            # An existing file (a deployment's secrets) is never overwritten.
            again = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[0]], cwd=checkout, env=env,
                                   capture_output=True, text=True, timeout=120)  # fmt: skip
            assert again.returncode != 0 and path.read_text().splitlines()[0] == f"KVRELAY_API_TOKEN={values['KVRELAY_API_TOKEN']}"
            assert dict(line.split("=", 1) for line in path.read_text().splitlines()) == first
            path.unlink()
    assert first["KVRELAY_REPLICA_SECRET"] != values["KVRELAY_REPLICA_SECRET"]  # fresh each time
    proc = _compose(repo_root, tmp_path, "--profile", "cpu", env=values)
    assert proc.returncode == 0, proc.stderr
