"""What a new user following README.md and docs/ met, black-box, and what it is now: each error a
clear line with the documented exit code, checked before work that its cause would waste."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.config import ConfigError, load_config
from kvrelay.limits import MAX_CONFIG_FILE_BYTES, MAX_PEM_FILE_BYTES
from kvrelay.node import health_probe
from kvrelay.node.cli import main
from kvrelay.v1 import broker_pb2

REPO = Path(__file__).resolve().parents[2]
FAST = str(REPO / "tests/configs/test-fast.yaml")


def _closed_port() -> int:
    """A loopback port where nothing listens (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def closed_port() -> int:
    return _closed_port()


def kvrelay(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "KVRELAY_CONFIG"}
    base.update(KVRELAY_LOG_FORMAT="console", KVRELAY_NATIVE_CAPTURE="0")
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**base, **(env or {})},
    )  # fmt: skip


# --- a flag the subcommand does not have ------------------------------------------------------


@pytest.mark.parametrize("argv", [["generate", "a fox", "--bogus"], ["status", "--nope"], ["generate", "a", "b"]])
def test_an_unknown_flag_gets_the_subcommands_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the top-level usage (`usage: kvrelay [-h] [--version] COMMAND ...`, `kvrelay: error:`),
    # which does not show the flags the command does have.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvrelay {argv[0]} "), err
    assert err.splitlines()[-1] == f"kvrelay {argv[0]}: error: unrecognized arguments: {argv[-1]}"


@pytest.mark.parametrize(
    ("argv", "hint"),
    [(["up", "--confg", "x.yaml"], "--config"), (["generate", "a fox", "--seeed=3"], "--seed"),
     (["broker", "--metric-port", "0"], "--metrics-port")],
)  # fmt: skip
def test_a_misspelt_flag_says_which_flag_it_meant(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # As a misspelt config key does: argparse said only `unrecognized arguments`.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    flag = next(arg for arg in argv if arg.startswith("--"))
    assert last.startswith(f"kvrelay {argv[0]}: error: unrecognized arguments: {flag}"), last
    assert last.endswith(f" (did you mean {hint!r}?)"), last


@pytest.mark.parametrize(
    ("argv", "prefix", "hint"),
    [(["upp"], "kvrelay: error: argument COMMAND: invalid choice: 'upp'", "up"),
     (["generat", "a fox"], "kvrelay: error: argument COMMAND: invalid choice: 'generat'", "generate"),
     (["bench", "--scenario", "transfr"], "kvrelay bench: error: argument --scenario: invalid choice: 'transfr'", "transfer")],
)  # fmt: skip
def test_a_misspelt_choice_says_which_choice_it_meant(
    argv: list[str], prefix: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse's own `invalid choice` said only `(choose from ...)`, unlike every other refusal.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"{prefix} (did you mean {hint!r}?) (choose from "), last


def test_every_choice_of_every_command_is_suggested_when_misspelt(capsys: pytest.CaptureFixture[str]) -> None:
    # Every `choices=` flag a command has, now and later: a choice with its last letter doubled.
    import argparse

    from kvrelay.node.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, command in commands.choices.items():
        for action in command._actions:
            if not action.option_strings or not action.choices:
                continue
            for choice in action.choices:
                if not isinstance(choice, str):
                    continue
                with pytest.raises(SystemExit) as exit_info:
                    main([name, action.option_strings[-1], choice + choice[-1]])
                assert exit_info.value.code == 2
                last = capsys.readouterr().err.splitlines()[-1]
                assert f"invalid choice: {choice + choice[-1]!r} (did you mean {choice!r}?)" in last, last
                checked += 1
    assert checked >= 3  # bench --scenario's


def test_a_choice_close_to_none_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--scenario", "everything"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        "kvrelay bench: error: argument --scenario: invalid choice: 'everything' (choose from 'seed', 'transfer', 'both')"
    )


def test_a_misspelt_state_of_list_says_which_state_it_meant(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused before any call (nothing listens on the default target here).
    assert main(["list", "--state", "SUCEEDED", "--state", "denoising"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvrelay list: unknown state SUCEEDED (did you mean 'SUCCEEDED'?) (one of QUEUED, PREFILLING, TRANSFERRING, "
        "DENOISING, SUCCEEDED, FAILED, CANCELLED)"
    ], err


def test_help_gives_the_default_of_every_flag_that_has_one() -> None:
    # docs/client.md: "--help of every command gives each flag's default"; `health --timeout` (3 s),
    # `verify --device` and `--dit-cfg`, `generate --request-id`, the services' ports did not.
    import argparse

    from kvrelay.node.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            flags = action.option_strings
            if not flags or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            optional = action.default is None and flags[-1] not in ("--port", "--metrics-port", "--request-id")
            if not optional and "default" not in (action.help or ""):
                missing.append(f"{name} {flags[-1]}")
    assert missing == []


# --- kvrelay health --service ------------------------------------------------------------------


@pytest.fixture
def health_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_health_of_a_service_the_process_does_not_know_names_it(health_server: str) -> None:
    assert health_probe.check(health_server) == (0, f"{health_server}: SERVING")
    # Before: "HOST:PORT: NOT_FOUND: ", gRPC's empty details.
    code, line = health_probe.check(health_server, "bogus")
    assert code == 2
    assert line == f"{health_server}: NOT_FOUND: no health status for service 'bogus' (omit --service for the process)"


def test_health_of_nothing_listening_is_still_2(closed_port: int) -> None:
    code, line = health_probe.check(f"127.0.0.1:{closed_port}", "bogus", timeout_s=2)
    assert code == 2 and "UNAVAILABLE" in line


# --- kvrelay generate -o -----------------------------------------------------------------------


def test_an_output_that_cannot_be_written_is_refused_before_generating(
    tmp_path: Path, closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens at the target: a check made after the generation would answer UNAVAILABLE
    # (exit 1) first. Before, -o was tried only once the image had come back, and was lost.
    target = f"127.0.0.1:{closed_port}"
    afile = tmp_path / "afile"
    afile.write_text("")
    for output, problem in (
        (str(tmp_path), f"-o {tmp_path}: is a folder; name the PNG file, e.g. {tmp_path / 'out.png'}"),
        (str(afile / "x.png"), f"-o {afile / 'x.png'}: {afile} is a file, not a folder"),
        (str(afile / "a" / "b" / "x.png"), f"-o {afile / 'a' / 'b' / 'x.png'}: {afile} is a file, not a folder"),
    ):
        assert main(["generate", "a fox", "-q", "-o", output, "--target", target]) == 2
        assert capsys.readouterr().err == f"kvrelay generate: {problem}\n"
    # A folder whose permission bits say writable but where no file can be made: /proc, to a
    # root user (os.access answers yes to root for any mode bits). Before, found black-box:
    # `-o /proc/x.png` generated the image, then lost it with exit 1.
    if os.access("/proc", os.W_OK):
        assert main(["generate", "a fox", "-q", "-o", "/proc/x.png", "--target", target]) == 2
        assert capsys.readouterr().err.startswith("kvrelay generate: -o /proc/x.png: not writable")
    # A path that can be written goes on to the broker (here: not there), its folders made.
    fresh = tmp_path / "new" / "dir" / "fox.png"
    assert main(["generate", "a fox", "-q", "-o", str(fresh), "--target", target]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert fresh.parent.is_dir() and not fresh.exists()


# --- config files --------------------------------------------------------------------------------


def test_a_key_given_twice_in_the_config_is_refused(tmp_path: Path) -> None:
    text = (REPO / "configs/single-node.yaml").read_text()
    assert "  port: 50051\n" in text
    config = tmp_path / "dup.yaml"
    # An edit that added a port and forgot the first: PyYAML kept the last one without a word.
    config.write_text(text.replace("  port: 50051\n", "  port: 50051\n  port: 50052\n"))
    line = text.splitlines().index("  port: 50051") + 1
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value) == (
        f"invalid YAML in {config} line {line + 1} column 3: duplicate key 'port' (first on line {line})"
    )
    flow = tmp_path / "flow.yaml"
    flow.write_text("broker: {port: 1, port: 2}\n")
    with pytest.raises(ConfigError, match="duplicate key 'port' \\(first on line 1\\)"):
        load_config(flow)


def test_every_shipped_config_has_no_duplicate_key() -> None:
    for path in sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "tests/configs").glob("*.yaml")):
        load_config(path)


def test_a_config_path_that_is_no_regular_file_says_so_not_that_it_is_missing(tmp_path: Path) -> None:
    # Found black-box: `--config <(envsubst < node.yaml)` (a pipe, /dev/fd/63) and /dev/zero were
    # "config file not found", although they are there.
    fifo = tmp_path / "node.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value) == f"config {path} is not a regular file (a pipe or a device): give a YAML file"


def test_a_config_larger_than_any_config_is_refused_unread(tmp_path: Path) -> None:
    # Read whole before: a config path naming a file of gigabytes took that much memory.
    big = tmp_path / "huge.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_CONFIG_FILE_BYTES + 1)  # sparse: no disk, no memory unless read
    with pytest.raises(ConfigError) as err:
        load_config(big)
    assert str(err.value) == f"config {big}: {MAX_CONFIG_FILE_BYTES + 1} bytes: more than a YAML config may be (4 MiB)"
    assert main(["up", "--config", str(big)]) == 2


def test_a_config_path_that_is_a_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"config {tmp_path} is a folder, not a YAML file"


# --- ar / dit ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ar", "dit"])
def test_a_replica_out_of_range_is_one_line_on_stderr(command: str, tmp_path: Path) -> None:
    # Before, both printed it on stdout (a supervisor or a shell reading stderr saw nothing).
    proc = kvrelay(command, "--config", FAST, "--replica", "5", env={"KVRELAY_LOCK_DIR": str(tmp_path)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--replica 5" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvrelay {command}: --replica 5 "), proc.stderr


class _SilentBroker:
    """RegisterReplica answers `code` every time."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.calls = 0

    async def RegisterReplica(self, request: broker_pb2.RegisterReplicaRequest, **kwargs: object) -> None:
        self.calls += 1
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded")


class _Info:
    replica_id = "dit-0"

    def to_proto(self) -> broker_pb2.ReplicaInfo:
        return broker_pb2.ReplicaInfo(replica_id=self.replica_id)


def test_dit_registration_gives_up_on_a_silent_broker_as_unreachable() -> None:
    from kvrelay.dit_service.registration import BrokerUnreachable, Registration, RegistrationRefused

    def register(code: grpc.StatusCode) -> BaseException:
        stub = _SilentBroker(code)
        registration = Registration(stub, _Info(), interval_s=1.0, token=None, on_fenced=lambda _: None)  # type: ignore[arg-type]
        with pytest.raises(RegistrationRefused) as err:
            asyncio.run(registration.register(broker="127.0.0.1:1", wait_s=0.5))
        return err.value

    unreachable = register(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert isinstance(unreachable, BrokerUnreachable)
    assert (unreachable.code, unreachable.waited_s) == ("DEADLINE_EXCEEDED", 0.5)
    assert unreachable.__cause__ is None  # no chained gRPC traceback to print
    refused = register(grpc.StatusCode.PERMISSION_DENIED)
    assert not isinstance(refused, BrokerUnreachable)


def test_ar_registration_gives_up_on_a_silent_broker_as_unreachable() -> None:
    from kvrelay.ar_service.registration import (
        ArIdentity,
        ArRegistration,
        BrokerUnreachable,
        RegistrationRefused,
    )
    from kvrelay.ar_service.sender import WriteLedger, WriteReporter

    def register(code: grpc.StatusCode) -> BaseException:
        stub = _SilentBroker(code)
        ledger = WriteLedger()
        identity = ArIdentity("ar-0", "inc-1", "127.0.0.1:1", 2, 2, 8, "float32", 4, 1, 64, "grpc", 0, 4)
        reporter = WriteReporter(stub, ledger, "ar-0", "inc-1", rpc_timeout_s=1.0)  # type: ignore[arg-type]
        registration = ArRegistration(stub, identity, ledger, reporter, heartbeat_interval_s=1.0, token=None,  # type: ignore[arg-type]
                                      on_fail_stop=lambda _: None)  # fmt: skip
        with pytest.raises(RegistrationRefused) as err:
            asyncio.run(registration.register(broker="127.0.0.1:1", wait_s=0.5))
        return err.value

    unreachable = register(grpc.StatusCode.UNAVAILABLE)
    assert isinstance(unreachable, BrokerUnreachable) and unreachable.waited_s == 0.5
    assert not isinstance(register(grpc.StatusCode.INVALID_ARGUMENT), BrokerUnreachable)


# Two progress lines at least (kvrelay.broker_wait: one at the first unanswered try, then one
# every 5 s): the DiT's first RegisterReplica to a closed port is answered DEADLINE_EXCEEDED only
# after 5 s, its second after 10 s; 10 s was too short for it.
_REGISTER_WAIT_S = 12
_SILENT_BROKER_TEST = "test_a_replica_whose_broker_never_answers_says_what_it_waits_for_then_where_it_looked"


@pytest.fixture(scope="module")
def silent_broker_waits(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, futures.Future[tuple[str, subprocess.CompletedProcess[str]]]]]:
    """`kvrelay ROLE` against a broker that never answers, for every role the session runs the
    test below for, all at once: each process only waits (its own lock folder, config and port),
    so the roles share the wait instead of taking it one after the other."""
    roles = sorted({item.callspec.params["role"] for item in request.session.items
                    if getattr(item, "originalname", None) == _SILENT_BROKER_TEST})  # fmt: skip
    config = yaml.safe_load(Path(FAST).read_text())
    config["broker"]["register_wait_seconds"] = _REGISTER_WAIT_S

    def run(role: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        tmp = tmp_path_factory.mktemp(f"silent-broker-{role}")
        path = tmp / "wait.yaml"
        path.write_text(yaml.safe_dump(config))
        broker = f"127.0.0.1:{_closed_port()}"
        return broker, kvrelay(role, "--config", str(path), "--broker", broker, env={"KVRELAY_LOCK_DIR": str(tmp)},
                               timeout=150)  # fmt: skip

    with futures.ThreadPoolExecutor(max(1, len(roles))) as pool:
        yield {role: pool.submit(run, role) for role in roles}


@pytest.mark.slow
@pytest.mark.parametrize(("role", "exit_code"), [("dit", 3), ("ar", 1)])
def test_a_replica_whose_broker_never_answers_says_what_it_waits_for_then_where_it_looked(
    role: str, exit_code: int, silent_broker_waits: dict[str, futures.Future[tuple[str, subprocess.CompletedProcess[str]]]]
) -> None:
    # Before: `kvrelay dit: startup failed: RegisterReplica dit-0 failed: DEADLINE_EXCEEDED: Deadline
    # Exceeded` after a logged traceback, naming neither the broker's address nor what to check;
    # and the AR waited 120 s, the DiT 30 s, both silent but for a line per retry.
    # broker.register_wait_seconds is now the one wait of both (default 120 s).
    broker, proc = silent_broker_waits[role].result(timeout=200)
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"kvrelay {role}: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(
        f"kvrelay {role}: the broker at {broker} did not answer RegisterReplica for {_REGISTER_WAIT_S} s (last: "
    ), lines[0]
    assert lines[0].endswith("is it running, and is --broker (or the config's broker.host and broker.port) right?")
    # While it waited: a progress line every 5 s or so (not one per retry), saying what it waits for.
    progress = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if "broker_not_reachable_yet" in ln]
    assert 2 <= len(progress) <= 4, progress
    assert all(f"waiting_for='the broker at {broker} to answer RegisterReplica'" in ln for ln in progress), progress


# --- kvrelay bench's stdout ------------------------------------------------------------------------

_BENCH_LOGS = """
import sys
from kvrelay.logging import get_logger
from kvrelay.node import bench
from kvrelay.node.cli import main

def fake_scenario(*args, **kwargs):
    # What the nodes' supervisor logs while a real scenario runs, then the end of this check.
    get_logger("kvrelay.node.supervisor").info("child_started", child="broker")
    print("TABLE")
    raise SystemExit(7)

bench.run_scenario = fake_scenario
sys.exit(main(["bench", "--output", sys.argv[1], "--requests", "1", "--runs", "1"]))
"""


def test_bench_keeps_the_supervisors_logs_off_stdout(tmp_path: Path) -> None:
    # `kvrelay bench > results.md` got every child_started/child_serving/node_stopped line of each
    # node among the tables: structlog, never configured in bench, printed them on stdout.
    env = {k: v for k, v in os.environ.items() if k not in ("KVRELAY_CONFIG", "KVRELAY_LOG_FORMAT")}
    proc = subprocess.run(
        [sys.executable, "-c", _BENCH_LOGS, str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert proc.stdout == "TABLE\n"
    assert "child_started" in proc.stderr


# --- TLS files of the client commands ------------------------------------------------------------


@pytest.mark.parametrize("command", [["generate", "a fox", "-q"], ["status"], ["list"], ["cancel", "r1"]])
def test_tls_files_that_cannot_work_are_one_line_before_any_call(
    command: list[str], tmp_path: Path, closed_port: int, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for env in ("KVRELAY_TLS_CA", "KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY"):
        monkeypatch.delenv(env, raising=False)
    pem = tmp_path / "c.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    big = tmp_path / "big.pem"
    with open(big, "wb") as f:
        f.truncate(MAX_PEM_FILE_BYTES + 1)  # sparse: no disk, no memory unless read
    target = ["--target", f"127.0.0.1:{closed_port}", "-o", str(tmp_path / "o.png")][: 4 if "-q" in command else 2]
    name = command[0]
    cases = [
        # Before: the SDK's `ValueError: certificate_chain and private_key go together` traceback.
        (["--tls-cert", str(pem)], "--tls-cert needs --tls-key too: a client certificate and its private key go "
         "together (mutual TLS)"),
        (["--tls-key", str(pem)], "--tls-key needs --tls-cert too: a client certificate and its private key go "
         "together (mutual TLS)"),
        # Before: UNAVAILABLE at the handshake, with a hint to check the broker's TLS.
        (["--tls-ca", str(text)], f"--tls-ca {text}: not a PEM file (no -----BEGIN line)"),
        # A device or a pipe: /dev/zero was read until MemoryError (found black-box), a pipe read
        # empty by the client after this check. /dev/null: a device that ends at once.
        (["--tls-ca", "/dev/null"], "--tls-ca /dev/null: not a regular file (a pipe or a device): give a PEM file"),
        # A regular file is read with a bound too (kvrelay.limits.read_bounded_file): before, whole.
        (["--tls-ca", str(big)], f"--tls-ca {big}: {MAX_PEM_FILE_BYTES + 1} bytes: more than a PEM file may be (4 MiB)"),
        (["--tls-ca", str(tmp_path)], f"--tls-ca {tmp_path}: a folder, not a file: give a PEM file"),
    ]  # fmt: skip
    for flags, line in cases:
        assert main([*command, *target, *flags]) == 2
        assert capsys.readouterr().err == f"kvrelay {name}: {line}\n"
    monkeypatch.setenv("KVRELAY_TLS_CERT", str(pem))
    assert main([*command, *target]) == 2
    assert capsys.readouterr().err.startswith(f"kvrelay {name}: $KVRELAY_TLS_CERT needs --tls-key too")


@pytest.mark.parametrize("command", [["generate", "a fox", "-q"], ["status"]])
def test_a_client_certificate_and_key_that_are_no_pair_are_one_line_before_any_call(
    command: list[str], tmp_path: Path, closed_port: int, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.security.certs import TestCa

    for env in ("KVRELAY_TLS_CA", "KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY"):
        monkeypatch.delenv(env, raising=False)
    ca = TestCa(tmp_path)
    alice, bob = ca.issue("alice"), ca.issue("bob")
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
    target = ["--target", f"127.0.0.1:{closed_port}", "-o", str(tmp_path / "o.png")][: 4 if "-q" in command else 2]
    name = command[0]
    cases = [
        # Found black-box against a mutual-TLS node: gRPC's C-core log lines ("Invalid private key")
        # and then `UNAVAILABLE: empty address list`, with a hint about the broker's TLS.
        ((alice.cert, bob.key), f"--tls-key {bob.key} is not the private key of --tls-cert {alice.cert}"),
        ((alice.key, alice.cert), f"--tls-cert {alice.key}: holds no certificate (-----BEGIN CERTIFICATE-----)"),
        ((alice.cert, ca.path), f"--tls-key {ca.path}: holds no private key (-----BEGIN PRIVATE KEY-----)"),
        ((alice.cert, encrypted), f"--tls-key {encrypted}: the key is encrypted; the client needs it unencrypted"),
    ]  # fmt: skip
    for (cert, key), line in cases:
        flags = ["--tls-ca", str(ca.path), "--tls-cert", str(cert), "--tls-key", str(key)]
        assert main([*command, *target, *flags]) == 2
        assert capsys.readouterr().err == f"kvrelay {name}: {line}\n"
    # A true pair passes the check: the call is made (nothing listens there).
    flags = ["--tls-ca", str(ca.path), "--tls-cert", str(alice.cert), "--tls-key", str(alice.key)]
    assert main([*command, *target, *flags]) == 1
    assert "nothing listens" in capsys.readouterr().err
    # kvrelay health (compose's healthcheck) checks the pair too: the same C-core lines before.
    flags = ["--tls-ca", str(ca.path), "--tls-cert", str(alice.cert), "--tls-key", str(bob.key)]
    assert main(["health", "--target", f"127.0.0.1:{closed_port}", *flags]) == 2
    assert capsys.readouterr().err == f"kvrelay health: {cases[0][1]}\n"


# --- kvrelay generate's error lines --------------------------------------------------------------


def test_an_error_names_its_request_id_once(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.client import KvRelayError
    from kvrelay.client.cli import _print_error

    # The broker's REQUEST_ID_REUSED carries the id in its ErrorInfo too: it was printed twice.
    err = KvRelayError("ALREADY_EXISTS", "REQUEST_ID_REUSED", "request_id 'same-1' names a generation with "
                       "other parameters", {"request_id": "same-1", "field": "x"}, request_id="same-1")  # fmt: skip
    _print_error("generate", err, sys.stderr)
    assert capsys.readouterr().err.splitlines()[1:] == ["  field: x", "  request_id: same-1"]


def test_the_commands_own_deadline_is_named_with_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.client.harness import Harness, ServerThread

    server = ServerThread(Harness()).start()
    try:
        server.harness.step_delay = 0.1
        argv = ["generate", "slow", "--steps", "50", "--width", "64", "--height", "64", "-q",
                "--target", server.address, "-o", str(tmp_path / "x.png"), "--timeout", "0.5"]  # fmt: skip
        assert main(argv) == 1
    finally:
        server.stop()
    err = capsys.readouterr().err
    # Before: "DEADLINE_EXCEEDED: Deadline Exceeded" and the request id, nothing about --timeout.
    assert err.startswith("kvrelay generate: DEADLINE_EXCEEDED: "), err
    assert err.splitlines()[-1] == (
        "  hint: the generation did not end within --timeout (0.5 s): pass a larger --timeout for many steps "
        "or large images"
    )


# --- leases that cannot hold ---------------------------------------------------------------------


def _with_broker(tmp_path: Path, extra: str) -> Path:
    text = (REPO / "configs/single-node.yaml").read_text()
    assert "  lease_seconds: 10\n" in text
    config = tmp_path / "lease.yaml"
    config.write_text(text.replace("  lease_seconds: 10\n", extra))
    return config


def test_a_lease_too_short_to_heartbeat_is_refused(tmp_path: Path) -> None:
    # 0.0001 s was accepted: `kvrelay up` reported SERVING, every replica heartbeat in a busy loop,
    # none was ever UP, and every request failed NO_AR_REPLICA.
    with pytest.raises(ConfigError) as err:
        load_config(_with_broker(tmp_path, "  lease_seconds: 0.0001\n"))
    assert "broker.lease_seconds: must be at least 0.5 s (replicas heartbeat every lease_seconds / 3), got 0.0001" in str(
        err.value
    )
    assert load_config(_with_broker(tmp_path, "  lease_seconds: 0.6\n")).broker.heartbeat_interval == pytest.approx(0.2)


def test_a_heartbeat_no_shorter_than_the_lease_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_with_broker(tmp_path, "  lease_seconds: 10\n  heartbeat_seconds: 10\n"))
    assert "heartbeat_seconds (10) must be below lease_seconds (10)" in str(err.value)
    assert load_config(_with_broker(tmp_path, "  lease_seconds: 10\n  heartbeat_seconds: 9\n")).broker.heartbeat_interval == 9


def test_output_dash_writes_the_png_on_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.client.harness import Harness, ServerThread

    monkeypatch.chdir(tmp_path)
    server = ServerThread(Harness()).start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvrelay", "generate", "a fox", "--width", "64", "--height", "64",
             "--target", server.address, "-o", "-"],
            capture_output=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Before: a file named "-" in the working folder, and "wrote - (...)" on stdout.
    assert proc.stdout.startswith(b"\x89PNG\r\n\x1a\n")
    assert not (tmp_path / "-").exists()
    err = proc.stderr.decode()
    assert "wrote stdout (64x64, seed " in err and "timings: " in err


# --- --target at something that is not the broker ------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[str]:
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_target_that_is_a_metrics_port_says_so(http_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "hint: is the broker serving TLS? pass --tls-ca": no TLS setting helps an HTTP/1 server.
    assert main(["status", "--target", http_server]) == 1
    err = capsys.readouterr().err
    assert "Failed parsing HTTP/2" in err
    assert err.splitlines()[-1] == (
        f"  hint: {http_server} does not speak gRPC (a metrics port?): --target is the broker's gRPC HOST:PORT"
    )


def test_a_target_that_is_a_replica_says_so(health_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    # An AR or DiT port answers gRPC, but not the broker's services: UNIMPLEMENTED alone, before.
    assert main(["status", "--target", health_server]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvrelay status: UNIMPLEMENTED: ")
    assert err.splitlines()[-1] == (
        f"  hint: {health_server} does not serve this kvrelay API (an AR or DiT replica's port?): --target is the "
        "broker's HOST:PORT (kvrelay up prints it; 127.0.0.1:50051 by default)"
    )


# --- an advertise_host that does not resolve here ------------------------------------------------


def test_unresolvable_host_names_the_setting() -> None:
    from kvrelay.ports import unresolvable_host

    assert unresolvable_host("127.0.0.1", "stages[0].advertise_host") is None
    assert unresolvable_host("localhost", "stages[0].advertise_host") is None
    problem = unresolvable_host("kvrelay-ar.invalid", "stages[0].advertise_host")
    assert problem is not None and problem.startswith("stages[0].advertise_host 'kvrelay-ar.invalid' does not resolve")


@pytest.mark.slow
@pytest.mark.parametrize(("command", "index"), [("ar", 0), ("dit", 1)])
def test_a_replica_whose_advertise_host_does_not_resolve_is_one_line_exit_2(
    command: str, index: int, tmp_path: Path
) -> None:
    # configs/compose-node*.yaml outside compose: before, the DiT failed after starting its ranks,
    # `startup failed: DescribeRegion failed on rank(s) [0]: gaierror: [Errno -2] Name or service
    # not known`, exit 3 (naming no setting), and the AR only at registration.
    proc = kvrelay(command, "--config", FAST, "--advertise-host", "kvrelay-x.invalid", "--broker", "127.0.0.1:9",
                   env={"KVRELAY_LOCK_DIR": str(tmp_path)})  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"kvrelay {command}: --advertise-host 'kvrelay-x.invalid' does not resolve on this host ("
    ), proc.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_output_dash_onto_a_full_disk_is_one_line(tmp_path: Path) -> None:
    # `kvrelay generate ... -o - > fox.png` on a full disk printed an OSError traceback (found
    # black-box with stdout on /dev/full).
    from tests.client.harness import Harness, ServerThread

    server = ServerThread(Harness()).start()
    try:
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(
                [sys.executable, "-m", "kvrelay", "generate", "a fox", "--width", "64", "--height", "64", "-q",
                 "--target", server.address, "-o", "-"],
                stdout=full, stderr=subprocess.PIPE, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
    finally:
        server.stop()
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.strip() == "kvrelay generate: cannot write the PNG to stdout: No space left on device", err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("command", ["status", "list --json", "generate a-fox --width 64 --height 64 -q"])
def test_a_command_whose_stdout_is_on_a_full_disk_says_so_in_one_line(tmp_path: Path, command: str) -> None:
    # `kvrelay status > report.txt` on a full disk was an OSError traceback from print() (found
    # black-box with stdout on /dev/full), as was every client command's output.
    from tests.client.harness import Harness, ServerThread

    argv = command.split()
    if argv[0] == "generate":
        argv += ["-o", str(tmp_path / "fox.png")]
    server = ServerThread(Harness()).start()
    try:
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(
                [sys.executable, "-m", "kvrelay", *argv, "--target", server.address],
                stdout=full, stderr=subprocess.PIPE, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
    finally:
        server.stop()
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.strip() == f"kvrelay {argv[0]}: cannot write its output: No space left on device", err


def test_an_operator_command_refused_a_client_certificate_hints_at_operator_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from kvrelay.client import KvRelayError
    from kvrelay.client.cli import _print_error, _sent_token

    for env in ("KVRELAY_TLS_CERT", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_API_TOKEN"):
        monkeypatch.delenv(env, raising=False)
    err = KvRelayError("PERMISSION_DENIED", "PERMISSION_DENIED", "/kvrelay.v1.BrokerService/ListReplicas needs an "
                       "operator credential; the one presented is not")  # fmt: skip
    # Found black-box against a mutual-TLS node: `kvrelay status --tls-cert alice.pem` (a client,
    # not an operator, certificate) was told "needs the operator token: pass --token".
    args = argparse.Namespace(token=None, tls_cert="alice.pem")
    _print_error("status", err, sys.stderr, tls=True, sent=_sent_token("status", args))
    hint = capsys.readouterr().err.splitlines()[1]
    assert hint.startswith("  hint: the client certificate sent (--tls-cert alice.pem) is not an operator's: ")
    assert "security.tls.operator_names" in hint
    monkeypatch.setenv("KVRELAY_TLS_CERT", "bob.pem")
    _print_error("list", err, sys.stderr, tls=True, sent=_sent_token("list", argparse.Namespace(token=None)))
    assert "($KVRELAY_TLS_CERT (bob.pem)) is not an operator's" in capsys.readouterr().err
    # A token sent with the certificate is the credential the hint names.
    _print_error("status", err, sys.stderr, tls=True, sent=_sent_token("status", argparse.Namespace(token="t")))
    assert "the token sent (--token) is not the operator token" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("last_error", "hint"),
    [
        # Found black-box: a broker certificate of the right CA for another name, and one that does
        # not verify (another CA, expired) both got "does the broker serve TLS with a certificate
        # from --tls-ca, and accept --tls-cert?".
        ("UNKNOWN: ipv4:127.0.0.1:1: Peer name 127.0.0.1 is not in peer certificate",
         "  hint: the broker's certificate (from --tls-ca's CA) does not name the host of 127.0.0.1:1: --target a "
         "host its certificate names (subjectAltName), or reissue it for this one"),
        ("UNKNOWN: ipv4:127.0.0.1:1: Ssl handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
         "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED",
         "  hint: the certificate 127.0.0.1:1 presents does not verify against --tls-ca: signed by another CA, "
         "expired or not yet valid? (openssl s_client -connect HOST:PORT shows it)"),
    ],
)  # fmt: skip
def test_a_server_certificate_refused_by_the_client_names_why(
    last_error: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvrelay.client import KvRelayError
    from kvrelay.client.cli import _print_error

    err = KvRelayError("UNAVAILABLE", "UNAVAILABLE", f"failed to connect to all addresses; last error: {last_error}")
    _print_error("status", err, sys.stderr, tls=True, target="127.0.0.1:1", sent="")
    assert capsys.readouterr().err.splitlines()[1:] == [hint]
