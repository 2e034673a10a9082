"""The `kvrelay` CLI as a new user meets it: every subcommand's --help works, and input it cannot
use (a config that is missing or not YAML, an unknown preset, a port in use) is one line naming
the problem, a non-zero exit and no traceback. Real processes, as a shell runs them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG_COMMANDS = ["up", "broker", "ar", "dit", "bench"]


def kvrelay(*argv: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run `kvrelay ARGV` to its end (a command that does not end within 60 s fails the test)."""
    base = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
    # Console logs, as on a terminal: a service's error line is then the plain line a user reads.
    base.update(KVRELAY_LOG_FORMAT="console", KVRELAY_NATIVE_CAPTURE="0")
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv],
        capture_output=True, text=True, timeout=60, cwd=cwd, env={**base, **(env or {})},
    )  # fmt: skip


def assert_one_clear_line(proc: subprocess.CompletedProcess[str], command: str, *names: str) -> None:
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvrelay {command}: "), err
    # One prefix: a port in use read "kvrelay broker: broker: port ...".
    assert not lines[0].startswith(f"kvrelay {command}: {command}: "), err
    for name in names:
        assert name in lines[0], err


@pytest.fixture
def fast_config(tmp_path: Path) -> str:
    """tests/configs/test-fast.yaml with the broker's journal in this test's tmp_path. The shipped
    one names `.kvrelay/test-broker.sqlite`, relative to where the command runs (the checkout,
    here): a journal another run left there (docs/operations.md's `start_node` example) was
    replayed, and its `broker_restored` line came before the error line under test."""
    import yaml

    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    path = tmp_path / "test-fast.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


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


def test_a_config_with_one_problem_is_one_line_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "preset.yaml"
    config.write_text((REPO / "tests/configs/test-fast.yaml").read_text().replace("preset: tiny", "preset: huge"))
    assert "preset: huge" in config.read_text()
    for command in ("up", "broker", "ar", "dit"):
        assert_one_clear_line(
            kvrelay(command, "--config", str(config)), command,
            f"invalid config {config}: stages[0].model.preset: unknown model preset 'huge'",
        )  # fmt: skip


def test_a_misspelt_key_is_one_line_that_says_which_key_it_meant(tmp_path: Path) -> None:
    config = tmp_path / "misspelt.yaml"
    text = (REPO / "tests/configs/test-fast.yaml").read_text()
    config.write_text(text.replace("max_num_seqs:", "max_num_seq:", 1))
    assert "max_num_seq:" in config.read_text()
    for command in ("up", "broker", "ar", "dit"):
        proc = kvrelay(command, "--config", str(config))
        assert_one_clear_line(proc, command, f"invalid config {config}: stages.")
        assert proc.stderr.rstrip().endswith(".max_num_seq: unknown key (did you mean 'max_num_seqs'?)"), proc.stderr
        assert proc.returncode == 2


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["bench", "--preset", "huge"], ["unknown model preset 'huge'"]),
        (["verify", "--preset", "huge"], ["unknown model preset 'huge'"]),
        (["verify", "--device", "tpu"], ["--device tpu"]),
        (["verify", "--ar-tp", "3"], ["num_kv_heads=4"]),
        (["generate", "a fox", "--tls-ca", "/nonexistent/ca.pem"], ["/nonexistent/ca.pem", "No such file"]),
    ],
)
def test_bad_input_of_a_command_is_one_line(argv: list[str], names: list[str]) -> None:
    proc = kvrelay(*argv)
    assert_one_clear_line(proc, argv[0], *names)
    assert proc.returncode == 2


def test_verify_on_a_host_without_cuda_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert_one_clear_line(kvrelay("verify", "--device", "cuda"), "verify", "--device cuda: no CUDA device")


@pytest.mark.parametrize("command", ["up", "broker"])
@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--log-level", "LOUD"], "argument --log-level: unknown level 'LOUD'"),
        (["--log-level", "DEBG"], "argument --log-level: unknown level 'DEBG' (did you mean 'DEBUG'?)"),
        (["--metrics-port", "70000"], "argument --metrics-port: must be a TCP port in [0, 65535]"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error(command: str, argv: list[str], name: str) -> None:
    # --log-level LOUD was a ValueError traceback from logging; --port 99999 listened on a random port.
    proc = kvrelay(command, *argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"kvrelay {command}: error: {name}"), proc.stderr


def test_a_port_out_of_range_is_a_usage_error() -> None:
    proc = kvrelay("broker", "--port", "99999")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "kvrelay broker: error: argument --port: must be a TCP port in [0, 65535] (0 = any free port), got 99999"
    )


def test_a_bad_kvrelay_log_level_is_one_line() -> None:
    proc = kvrelay("broker", env={"KVRELAY_LOG_LEVEL": "chatty"})
    assert_one_clear_line(proc, "broker", "$KVRELAY_LOG_LEVEL: unknown level 'chatty'")
    proc = kvrelay("broker", env={"KVRELAY_LOG_LEVEL": "warnng"})
    assert_one_clear_line(proc, "broker", "$KVRELAY_LOG_LEVEL: unknown level 'warnng' (did you mean 'WARNING'?)")


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_a_port_in_use_is_one_line_and_the_process_exits(busy_port: int, tmp_path: Path, fast_config: str) -> None:
    config = fast_config
    # gRPC's own failed bind printed a C-core error (two lines of absl) before ours.
    proc = kvrelay("broker", "--config", config, "--port", str(busy_port), "--metrics-port", "0")
    assert_one_clear_line(proc, "broker", f"kvrelay broker: port {busy_port} (broker gRPC, on 127.0.0.1) is already in use by pid")
    # A metrics port in use left the gRPC server running: the broker printed its line, then hung.
    proc = kvrelay("broker", "--config", config, "--port", "0", "--metrics-port", str(busy_port))
    assert_one_clear_line(proc, "broker", f"kvrelay broker: port {busy_port} (broker metrics, on 127.0.0.1) is already in use")
    # Its own lock folder: another ar-0 of a "127.0.0.1:1" deployment on this host holds the shared one.
    proc = kvrelay("ar", "--config", config, "--port", str(busy_port), "--broker", "127.0.0.1:1",
                   env={"KVRELAY_LOCK_DIR": str(tmp_path / "locks")})  # fmt: skip
    assert_one_clear_line(proc, "ar", f"kvrelay ar: port {busy_port} (ar-0 gRPC, on 127.0.0.1) is already in use")
    proc = kvrelay("up", "--config", config, "--metrics-port", str(busy_port))
    assert_one_clear_line(proc, "up", f"port {busy_port} (node metrics, on 127.0.0.1) is already in use")


# A broker or AR whose port is in use, run to its exit in a process of its own:
# exit_without_teardown records the code instead of exiting; then the journal's lock is tried.
_FAILED_START = """
import fcntl, os, socket, sys
import kvrelay.ar_service.main as am
import kvrelay.broker.main as bm
import kvrelay.dit_service.main as dm
from kvrelay.node.cli import build_parser

class Exited(Exception):
    pass

def record(code):
    raise Exited(code)

am.exit_without_teardown = bm.exit_without_teardown = dm.exit_without_teardown = record
config, journal, flag = sys.argv[1:]
with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    argv = {
        "metrics": ["broker", "--port", "0", "--metrics-port", port],
        "grpc": ["broker", "--port", port, "--metrics-port", "0"],
        "ar": ["ar", "--port", port, "--broker", "127.0.0.1:1"],
        # Warnings and errors only: an info line of its start (stale_pools_removed, when another
        # test's killed dit-0 left pools in /dev/shm) is no part of a failed start.
        "dit": ["dit", "--port", port, "--broker", "127.0.0.1:1", "--log-level", "warning"],
    }[flag]
    main = {"ar": am, "dit": dm}.get(flag, bm)
    try:
        print("returned", main.run(build_parser().parse_args([*argv, "--config", config])))
    except Exited as exited:
        print("exit_without_teardown", exited.args[0])
if flag not in ("ar", "dit"):
    fd = os.open(journal + ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("journal released")
    except BlockingIOError:
        print("journal held")
"""


@pytest.mark.parametrize(("flag", "code"), [("metrics", 1), ("grpc", 1), ("ar", 2), ("dit", 2)])
def test_a_failed_start_skips_teardown(fast_config: str, tmp_path: Path, flag: str, code: int) -> None:
    # Brokers started at once against one metrics port: one of six losers printed its line and
    # hung (faulthandler: grpc.aio's shutdown joining its poller thread in the interpreter's
    # last garbage collection, the gRPC server of the failed start being garbage by then).
    proc = subprocess.run(
        [sys.executable, "-c", _FAILED_START, fast_config, str(tmp_path / "journal.sqlite"), flag],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "KVRELAY_LOG_FORMAT": "console", "KVRELAY_NATIVE_CAPTURE": "0",
             "KVRELAY_LOCK_DIR": str(tmp_path / "locks")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # The broker's journal is closed by the failed start itself, not left to a teardown.
    expected = [f"exit_without_teardown {code}", *([] if flag in ("ar", "dit") else ["journal released"])]
    assert proc.stdout.splitlines() == expected, (proc.stdout, proc.stderr)
    # One line, the error (the DiT followed it with the stop of a running replica: fail_stop,
    # grpc_stopped, dit_stopped).
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    [line] = proc.stderr.splitlines()
    assert "is already in use" in line, proc.stderr


def test_an_address_this_host_does_not_have_is_one_line(fast_config: str) -> None:
    config = fast_config
    # 192.0.2.0/24 is TEST-NET-1: never a local address.
    proc = kvrelay("broker", "--config", config, "--host", "192.0.2.1", "--insecure-bind", "--port", "0")
    assert_one_clear_line(proc, "broker", "kvrelay broker: cannot listen on 192.0.2.1:0 (broker gRPC): Cannot assign requested address")


def test_a_journal_path_the_broker_cannot_use_is_one_line_exit_2(tmp_path: Path, fast_config: str) -> None:
    import yaml

    afile = tmp_path / "afile"
    afile.write_text("")
    for journal, reason in [
        (tmp_path, "it is a directory; journal_path names the journal's file"),
        (afile / "broker.sqlite", f"{str(afile)!r} is a file, not a directory"),
    ]:
        data = yaml.safe_load(Path(fast_config).read_text())
        data["broker"]["journal_path"] = str(journal)
        config = tmp_path / "journal.yaml"
        config.write_text(yaml.safe_dump(data))
        proc = kvrelay("broker", "--config", str(config), "--port", "0", "--metrics-port", "0")
        assert proc.returncode == 2, proc.stderr
        assert_one_clear_line(proc, "broker", f"kvrelay broker: broker.journal_path: cannot open the journal {str(journal)!r}: {reason}")


@pytest.mark.parametrize("command", ["generate", "status", "health", "list", "cancel"])
def test_a_target_port_out_of_range_is_a_usage_error(command: str) -> None:
    # gRPC took it modulo 65536: 127.0.0.1:99999 dialled 127.0.0.1:34463.
    extra = {"generate": ["a fox"], "cancel": ["r1"]}.get(command, [])
    proc = kvrelay(command, *extra, "--target", "127.0.0.1:99999")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"kvrelay {command}: error: argument --target: port 99999 of 127.0.0.1:99999 is not a TCP port in [1, 65535]"
    )


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path: Path, fast_config: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    config = fast_config
    proc = kvrelay("up", "--config", config, "--metrics-port", "0", "--log-dir", str(afile / "logs"))
    assert_one_clear_line(proc, "up", f"--log-dir {afile / 'logs'}: Not a directory")
    proc = kvrelay("bench", "--config", config, "--output", str(afile / "out"))
    assert_one_clear_line(proc, "bench", f"--output {afile / 'out'}: cannot create the folder: Not a directory")
