"""What a new user walking README.md and docs/ met that worked but did not tell them what to do
next: `kvrelay up` suggested a prompt the demo model cannot draw (and a command that fails on a
node with TLS or a token file), a taken port named its holder but not the setting to change, and
an invalid `kvrelay generate` flag was named by its API field (`num_inference_steps`, not
`--steps`)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvrelay.config import KvRelayConfig, load_config
from kvrelay.node.cli import build_parser, main
from kvrelay.node.supervisor import API_TOKEN_ENV, try_command

REPO = Path(__file__).resolve().parents[2]


def _parse_try(line: str) -> tuple[list[str], object]:
    argv = shlex.split(line)
    assert argv[:2] == ["kvrelay", "generate"], line
    return argv, build_parser().parse_args(argv[1:])


# --- the `try:` line of kvrelay up ------------------------------------------------------------


def test_up_suggests_a_picture_the_demo_model_draws_with_the_quick_starts_settings() -> None:
    from kvrelay.models.demo import COLOURS, PLACES, SHAPES, caption

    cfg = load_config(REPO / "configs/single-node.yaml")
    assert cfg.dit_stage.model.format == "demo"
    _, args = _parse_try(try_command(cfg, "127.0.0.1:50051"))
    # Before: "a red fox in the snow" at 2 steps, which the demo model draws as a red blur.
    drawable = {caption(c, s, b, p) for c in COLOURS for s in SHAPES for b in COLOURS if b != c for p in PLACES}
    assert args.prompt in drawable  # type: ignore[attr-defined]
    assert (args.steps, args.guidance_scale, args.target) == (8, 3.0, "127.0.0.1:50051")  # type: ignore[attr-defined]
    quickstart = (REPO / "scripts/quickstart.sh").read_text()
    assert "--steps 8 --guidance-scale 3.0" in quickstart


def test_up_on_a_preset_model_keeps_the_server_defaults() -> None:
    cfg = load_config(REPO / "tests/configs/test-fast.yaml")
    argv, args = _parse_try(try_command(cfg, "127.0.0.1:7"))
    assert args.prompt == "a red fox in the snow" and args.steps == 2  # type: ignore[attr-defined]
    assert argv[2:] == ["a red fox in the snow", "--target", "127.0.0.1:7"]


def _secured(tmp_path: Path, security: dict[str, object]) -> KvRelayConfig:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["security"] = security
    return KvRelayConfig.model_validate(data)


def test_up_on_a_tls_node_with_a_token_file_suggests_a_command_that_carries_them(tmp_path: Path) -> None:
    ca, token = tmp_path / "my ca.pem", tmp_path / "api.token"
    tls = {"cert_file": "c.pem", "key_file": "k.pem", "ca_file": str(ca), "require_client_cert": True}
    cfg = _secured(tmp_path, {"api_token_file": str(token), "tls": tls})
    argv, args = _parse_try(try_command(cfg, "127.0.0.1:7", api_token=True))
    # Before: a bare `kvrelay generate ... --target` that a TLS broker never answers.
    assert args.tls_ca == str(ca) and args.target == "127.0.0.1:7"  # type: ignore[attr-defined]
    assert (args.tls_cert, args.tls_key) == ("CERT.pem", "KEY.pem")  # type: ignore[attr-defined]
    assert args.token == f"$(cat {token})"  # type: ignore[attr-defined]  # the shell expands it
    # No token configured: none suggested.
    assert "--token" not in try_command(cfg, "127.0.0.1:7", api_token=False)


def test_up_names_the_token_variable_only_when_the_cli_would_not_read_it(tmp_path: Path) -> None:
    from kvrelay.client.cli import TOKEN_ENV

    assert API_TOKEN_ENV == TOKEN_ENV  # the variable `kvrelay generate` reads by itself
    default = _secured(tmp_path, {})
    assert "--token" not in try_command(default, "h:1", api_token=True)
    other = _secured(tmp_path, {"api_token_env": "MY_API_TOKEN"})
    _, args = _parse_try(try_command(other, "h:1", api_token=True))
    assert args.token == "$MY_API_TOKEN"  # type: ignore[attr-defined]


# --- a port that is taken -------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("where", "setting"),
    [("broker", "broker.port"), ("dit", "port of the dit stage"), ("dit-metrics", "metrics_port of the dit stage")],
)
def test_up_on_a_taken_port_says_which_setting_to_change(
    tmp_path: Path, taken_port: int, where: str, setting: str
) -> None:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    if where == "broker":
        data["broker"]["port"] = taken_port
    else:
        data["stages"][1]["metrics_port" if where == "dit-metrics" else "port"] = taken_port
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay", "up", "--config", str(config), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**env, "KVRELAY_LOG_FORMAT": "console"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("kvrelay up: port "))
    # Before: "... is already in use by pid P (...)" and nothing about how to get past it.
    assert line.startswith(f"kvrelay up: port {taken_port} (")
    assert line.endswith(f": stop it, or set another {setting} in the config (0 = any free port)"), line


def test_up_on_a_taken_node_metrics_port_names_the_flag(tmp_path: Path, taken_port: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay", "up", "--config", str(REPO / "tests/configs/test-fast.yaml"),
         "--metrics-port", str(taken_port)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].endswith("stop it, or pass another --metrics-port (0 = any free port)")


# --- kvrelay generate: an API field named by its flag -------------------------------------------


@pytest.mark.parametrize(
    ("flags", "field", "flag"),
    [(["--steps", "0"], "num_inference_steps", "--steps"),
     (["--guidance-scale", "0.5"], "guidance_scale", "--guidance-scale"),
     (["--request-id", "no spaces"], "request_id", "--request-id")],
)  # fmt: skip
def test_an_invalid_generate_flag_is_named_by_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], field: str, flag: str
) -> None:
    # The SDK refuses these before any call: nothing needs to listen at --target.
    argv = ["generate", "a red circle", *flags, "--target", "127.0.0.1:9", "-q", "-o", str(tmp_path / "x.png")]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"kvrelay generate: INVALID_ARGUMENT: {field}: "), err
    assert f"  hint: {field} is {flag} here" in err


def test_a_field_that_is_its_flags_name_gets_no_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "a red circle", "--width", "100", "--target", "127.0.0.1:9", "-q", "-o", str(tmp_path / "x.png")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "field: width" in err and "hint" not in err


# --- the client commands on a machine with the SDK's dependencies alone --------------------------

# What docs/operations.md (Install) says a client-only machine needs: grpcio, grpcio-status and
# protobuf. Everything else kvrelay depends on is made unimportable.
_CLIENT_ONLY = r"""
import importlib.abc, runpy, sys
SERVER_SIDE = {"pydantic", "yaml", "structlog", "torch", "numpy", "psutil", "prometheus_client", "PIL",
               "safetensors", "xxhash", "tqdm", "diffusers", "tokenizers", "mooncake", "grpc_health",
               "grpc_reflection"}
class ServerSide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in SERVER_SIDE:
            raise ModuleNotFoundError(f"No module named {name!r} (not on a client-only machine)")
sys.meta_path.insert(0, ServerSide())
sys.argv = ["kvrelay", *sys.argv[1:]]
runpy.run_module("kvrelay", run_name="__main__")
"""


def test_the_client_commands_run_with_the_sdks_dependencies_alone(tmp_path: Path) -> None:
    from tests.client.harness import Harness, ServerThread

    server = ServerThread(Harness()).start()
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        runs = {
            name: subprocess.run(
                [sys.executable, "-c", _CLIENT_ONLY, *argv], capture_output=True, text=True, timeout=120,
                cwd=tmp_path, env=env,
            )  # fmt: skip
            for name, argv in {
                "generate": ["generate", "a red circle", "--width", "64", "--height", "64", "-q",
                             "--target", server.address, "-o", "x.png"],
                "list": ["list", "--target", server.address],
                "version": ["--version"],
            }.items()  # fmt: skip
        }
    finally:
        server.stop()
    # Before: every kvrelay command, --version included, was `ModuleNotFoundError: No module named
    # 'yaml'` there (kvrelay.node.cli imported kvrelay.config for its default config path).
    for name, done in runs.items():
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
    assert (tmp_path / "x.png").read_bytes().startswith(b"\x89PNG")
    assert "a red circle" in runs["list"].stdout


def test_the_cli_names_the_configs_default_config() -> None:
    from kvrelay.config import DEFAULT_CONFIG
    from kvrelay.node import cli

    assert cli.DEFAULT_CONFIG == DEFAULT_CONFIG


def test_every_argument_of_every_command_says_what_it_is_in_help() -> None:
    # `kvrelay cancel --help` listed "REQUEST_ID" and `kvrelay forget --help` "REPLICA_ID" without
    # a word on where to find one.
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [
        f"{name} {action.dest}"
        for name, parser in sub.choices.items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert bare == []


# --- a secured broker: which token, from where ------------------------------------------------


@pytest.fixture
def secured_broker(tmp_path: Path) -> Iterator[str]:
    """A real `kvrelay broker` whose deployment sets an api and an operator token."""
    from kvrelay.node.supervisor import start_node

    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    tokens = {"KVRELAY_API_TOKEN": "api-secret", "KVRELAY_OPERATOR_TOKEN": "op-secret",
              "KVRELAY_REPLICA_TOKEN": "replica-secret"}  # fmt: skip
    with start_node(config, roles=("broker",), log_dir=tmp_path / "logs", cwd=tmp_path, env=tokens) as node:
        yield node.address()


def _clean_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_TLS_CA", "KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_missing_or_wrong_token_says_which_token_and_where_from(
    secured_broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: only the broker's "needs an operator or public credential (authorization: Bearer
    # <token> ...)", which names neither --token nor the variable nor which of the tokens.
    _clean_env(monkeypatch)
    out = str(tmp_path / "x.png")
    assert main(["generate", "a red circle", "-q", "-o", out, "--target", secured_broker]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "  hint: kvrelay generate needs the deployment's api token: pass --token TOKEN or set $KVRELAY_API_TOKEN "
        "(docs/operations.md, Security)"
    )
    assert main(["cancel", "some-id", "--target", secured_broker, "--token", "wrong"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "  hint: the token sent (--token) is not the deployment's api token: pass --token TOKEN or set "
        "$KVRELAY_API_TOKEN (docs/operations.md, Security)"
    )
    # The api token where the operator's is needed: the variable it came from is named.
    _clean_env(monkeypatch, KVRELAY_API_TOKEN="api-secret")
    assert main(["status", "--target", secured_broker]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvrelay status: PERMISSION_DENIED: "), err
    assert err.splitlines()[-1] == (
        "  hint: the token sent ($KVRELAY_API_TOKEN) is not the operator token: pass --token TOKEN or set "
        "$KVRELAY_OPERATOR_TOKEN (else $KVRELAY_API_TOKEN) (docs/operations.md, Security)"
    )
    # With the right tokens the same commands work (the hint is about credentials, not the node).
    _clean_env(monkeypatch, KVRELAY_OPERATOR_TOKEN="op-secret")
    assert main(["status", "--target", secured_broker]) == 0
    assert "hint" not in capsys.readouterr().err


# --- a generation that failed on the way and may be retried --------------------------------------


@pytest.mark.parametrize("request_id", [None, "mine-1"])
def test_a_retryable_failed_generation_says_how_to_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], request_id: str | None
) -> None:
    # A DiT killed under a generation: FAILED UNAVAILABLE (REPLICA_UNAVAILABLE), "can be retried";
    # re-running with the same --request-id attaches to the FAILED generation and fails again.
    from tests.client.harness import Harness, ServerThread

    def generate(prompt: str, rid: str | None) -> list[str]:
        argv = ["generate", prompt, "-q", "-o", str(tmp_path / "x.png"), "--target", server.address]
        assert main([*argv, *(["--request-id", rid] if rid else [])]) == 1
        return capsys.readouterr().err.splitlines()

    server = ServerThread(Harness()).start()
    try:
        failed = generate("fail:UNAVAILABLE/REPLICA_UNAVAILABLE", request_id)
        # A failure that is not retryable gets no such hint.
        other = generate("fail:TRANSFER_TIMEOUT", f"{request_id}-2" if request_id else None)
    finally:
        server.stop()
    assert failed[0].startswith("kvrelay generate: UNAVAILABLE (REPLICA_UNAVAILABLE): "), failed
    again = " with another --request-id (this one stays FAILED)" if request_id else ""
    assert failed[-1] == f"  hint: retryable: run the command again{again}"
    assert other[0].startswith("kvrelay generate: DEADLINE_EXCEEDED (TRANSFER_TIMEOUT): ") and "retryable" not in "".join(other)


@pytest.mark.parametrize("module", ["kvrelay", "kvrelay.node.cli"])
def test_python_dash_m_runs_the_cli(module: str) -> None:
    # `python -m kvrelay.node.cli` (what the `kvrelay` console script calls) ran nothing, exit 0.
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60,
                          cwd=REPO)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, f"kvrelay {__import__('kvrelay').__version__}")


def test_output_dash_onto_a_terminal_is_refused_before_generating() -> None:
    # `kvrelay generate PROMPT -o -` typed without a redirect wrote the PNG's bytes onto the screen.
    import pty

    controller, terminal = pty.openpty()
    try:
        env = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
        # Nothing listens at --target: the refusal comes before any call.
        done = subprocess.run(
            [sys.executable, "-m", "kvrelay", "generate", "a red circle", "-o", "-", "--target", "127.0.0.1:9"],
            stdout=terminal, stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO, env=env,
        )  # fmt: skip
    finally:
        os.close(terminal)
        os.close(controller)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kvrelay generate: -o -: stdout is a terminal; redirect it (-o - > fox.png, -o - | display) or give a file name"
    ]
