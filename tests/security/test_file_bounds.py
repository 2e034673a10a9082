"""Every small file a setting or a flag names (token files, the replica secret file, TLS PEM files)
is read with a bound, by kvrelay.limits.read_bounded_file: one that is no regular file or is larger
than such a file may be is one line naming the key and exit 2 at start, in every process that reads
it. Found black-box: a TLS file or a token file pointing at /dev/zero was read until MemoryError.

No test here reads /dev/zero or /dev/urandom: against a reader without a bound it would take the
machine's memory. An oversized sparse file and /dev/null (a device that ends at once) show the
same refusals, and an unbounded reader fails them with another message instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.config import SecurityConfig
from kvrelay.limits import (
    LOG_TAIL_BYTES,
    MAX_CONFIG_FILE_BYTES,
    MAX_DATASET_FILE_BYTES,
    MAX_MODEL_JSON_BYTES,
    MAX_PEM_FILE_BYTES,
    MAX_SECRET_FILE_BYTES,
    FileRefused,
    read_bounded_file,
    read_file_tail,
)
from kvrelay.security import SecurityError, client_tls_from_files, load_credentials
from tests.security.harness import REPO

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (and no memory, unless read)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_read_bounded_file_reads_a_regular_file_up_to_its_bound(tmp_path: Path) -> None:
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 100)
    assert read_bounded_file(exact, 100, "token file") == b"x" * 100
    assert read_bounded_file(tmp_path / "exact", 1 << 20, "token file") == b"x" * 100
    with pytest.raises(FileRefused, match=r"^101 bytes: more than a token file may be \(100 bytes\)$"):
        read_bounded_file(sparse(tmp_path / "big", 101), 100, "token file")
    with pytest.raises(FileRefused, match=r"^not a regular file \(a pipe or a device\): give a PEM file$"):
        read_bounded_file("/dev/null", 100, "PEM file")
    with pytest.raises(FileRefused, match=r"^a folder, not a file: give a PEM file$"):
        read_bounded_file(tmp_path, 100, "PEM file")
    with pytest.raises(FileNotFoundError):
        read_bounded_file(tmp_path / "missing", 100, "PEM file")
    assert MAX_SECRET_FILE_BYTES < MAX_PEM_FILE_BYTES <= MAX_CONFIG_FILE_BYTES < 1 << 30


def test_a_log_tail_reads_only_the_end_of_a_file_from_a_line_start(tmp_path: Path) -> None:
    """`kvrelay up` reads a child's last lines from its log, appended to across restarts for as
    long as the node runs: before, the whole file (gigabytes after weeks)."""
    log = tmp_path / "ar-0.log"
    with open(log, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of NULs before the last lines
        f.seek(0, os.SEEK_END)
        f.write(b"partial line\n" + b"".join(b"line %d\n" % i for i in range(1000)) + b"kvrelay ar-0: the reason\n")
    tail = read_file_tail(log, LOG_TAIL_BYTES)
    assert len(tail) <= LOG_TAIL_BYTES
    assert tail.endswith(b"line 999\nkvrelay ar-0: the reason\n")
    assert tail.startswith(b"line ") or tail.startswith(b"partial")  # never half a line
    small = tmp_path / "small.log"
    small.write_bytes(b"a\nb\n")
    assert read_file_tail(small, LOG_TAIL_BYTES) == b"a\nb\n"
    assert read_file_tail(small, 3) == b"b\n"  # "\nb\n": the cut first line dropped


def test_kvrelay_up_reads_only_the_tail_of_a_childs_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.node.supervisor import ChildSpec, Node

    (tmp_path / "ar-0.log").write_bytes(b"x" * (2 * LOG_TAIL_BYTES) + b"\nstarting\nkvrelay ar: the reason\n")
    node = Node([[ChildSpec("ar-0", "ar", ("true",), "127.0.0.1:1")]], log_dir=tmp_path)
    child = node._children[0]

    def whole(*args: object, **kwargs: object) -> object:
        raise AssertionError("a child's whole log was read")

    monkeypatch.setattr(Path, "read_text", whole)
    monkeypatch.setattr(Path, "read_bytes", whole)
    assert node._printed_reason(child) == "kvrelay ar: the reason"
    assert node._log_tail(child).endswith("\nstarting\nkvrelay ar: the reason")


def test_a_bench_dataset_is_read_with_a_bound(tmp_path: Path) -> None:
    from kvrelay.node.bench import load_dataset

    big = sparse(tmp_path / "prompts.jsonl", MAX_DATASET_FILE_BYTES + 1)
    with pytest.raises(ValueError) as err:
        load_dataset(big)
    assert str(err.value) == (f"dataset {big}: {MAX_DATASET_FILE_BYTES + 1} bytes: more than a JSONL dataset "
                              "may be (64 MiB)")  # fmt: skip
    with pytest.raises(ValueError, match=r"dataset /dev/null: not a regular file"):
        load_dataset("/dev/null")
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "a fox"}\n')
    assert load_dataset(ok) == [{"prompt": "a fox"}]


def test_a_checkpoints_json_files_are_read_with_a_bound(tmp_path: Path) -> None:
    """A model directory (`stages[].model.path`, `kvrelay bench --ar-model`) is the operator's:
    its config.json, weight index, llm_config.json and tokenizer.json are read whole, so bounded."""
    from types import SimpleNamespace

    from kvrelay.models.checkpoint import CheckpointError, checkpoint_files, read_hf_config
    from kvrelay.models.formats import bagel_geometry, hf_geometry

    too_big = f"{MAX_MODEL_JSON_BYTES + 1} bytes: more than a JSON file may be (64 MiB)"
    for name in ("config.json", "model.safetensors.index.json", "llm_config.json"):
        sparse(tmp_path / name, MAX_MODEL_JSON_BYTES + 1)
    for call in (lambda: read_hf_config(tmp_path), lambda: checkpoint_files(tmp_path),
                 lambda: hf_geometry(SimpleNamespace(format="kvrelay", preset=None, path=str(tmp_path)), True),
                 lambda: bagel_geometry(SimpleNamespace(format="bagel", path=str(tmp_path), dtype=None))):  # fmt: skip
        # A loader names the refusal as a CheckpointError (what every bad checkpoint raises), the
        # geometry readers as the FileRefused itself: the same line either way.
        with pytest.raises((FileRefused, CheckpointError)) as err:
            call()
        assert str(err.value).endswith(f".json: {too_big}"), err.value
        assert str(err.value).startswith(str(tmp_path))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result: list[object] = []

    def read() -> None:
        try:
            result.append(read_bounded_file(fifo, 100, "PEM file"))
        except FileRefused as err:
            result.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():
        # Unblock the open (a writer arrives) so that the thread ends before the test does.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
        pytest.fail("the open of a FIFO waited for a writer")
    assert [str(r) for r in result] == ["not a regular file (a pipe or a device): give a PEM file"]


def test_a_file_that_grows_past_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size is checked before reading, and the read stops one byte past the bound: a file that
    grows meanwhile is refused, not read to its new end."""
    path = tmp_path / "token"
    path.write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def fstat_then_grow(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        with open(path, "ab") as f:
            f.write(b"y" * 1000)
        return st

    real_read = os.read
    read: list[int] = []

    def counted_read(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "fstat", fstat_then_grow)
    monkeypatch.setattr(os, "read", counted_read)
    with pytest.raises(FileRefused, match=r"more than a token may be \(100 bytes\): it grew while read"):
        read_bounded_file(path, 100, "token")
    assert sum(read) == 101  # one byte past the bound, not the file's 1010


def test_load_credentials_refuses_oversized_or_special_files_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_REPLICA_SECRET"):
        monkeypatch.delenv(name, raising=False)
    big = sparse(tmp_path / "big", MAX_SECRET_FILE_BYTES + 1)
    too_big = f"{MAX_SECRET_FILE_BYTES + 1} bytes: more than a file holding the token may be (64 KiB)"
    for key in ("api_token_file", "operator_token_file", "replica_token_file"):
        with pytest.raises(SecurityError) as err:
            load_credentials(SecurityConfig.model_validate({key: str(big)}), "ar-0")
        assert str(err.value) == f"security.{key}: {big}: {too_big}"
        with pytest.raises(SecurityError) as err:
            load_credentials(SecurityConfig.model_validate({key: "/dev/null"}), "ar-0")
        assert str(err.value) == (f"security.{key}: /dev/null: not a regular file (a pipe or a device): "
                                  "give a file holding the token")  # fmt: skip
    with pytest.raises(SecurityError) as err:
        load_credentials(SecurityConfig.model_validate({"replica_tokens": "bound", "replica_secret_file": str(big)}))
    assert str(err.value) == (f"security.replica_secret_file: {big}: {MAX_SECRET_FILE_BYTES + 1} bytes: "
                              "more than a file holding the secret may be (64 KiB)")  # fmt: skip
    # A token file at the bound is read (and then judged as a token).
    (tmp_path / "ok").write_text("t" * 100 + "\n")
    monkeypatch.setenv("KVRELAY_REPLICA_TOKEN", "replica-token")
    assert load_credentials(SecurityConfig.model_validate({"api_token_file": str(tmp_path / "ok")})).api_token == "t" * 100

    pem = tmp_path / "ok.pem"
    pem.write_bytes(PEM)
    big_pem = sparse(tmp_path / "big.pem", MAX_PEM_FILE_BYTES + 1)
    for key in ("cert_file", "key_file", "ca_file"):
        tls = {"cert_file": str(pem), "key_file": str(pem), "ca_file": str(pem), key: str(big_pem)}
        with pytest.raises(SecurityError) as err:
            load_credentials(SecurityConfig.model_validate({"tls": tls}))
        assert str(err.value) == (f"security.tls.{key}: {big_pem}: {MAX_PEM_FILE_BYTES + 1} bytes: "
                                  "more than a PEM file may be (4 MiB)")  # fmt: skip
    # `kvrelay health`'s --tls-* files (client_tls_from_files) go the same way, named by flag
    # (before: security.tls.ca_file, a config key the command line never set).
    with pytest.raises(SecurityError, match=r"^--tls-ca: /dev/null: not a regular file"):
        client_tls_from_files("/dev/null")
    with pytest.raises(SecurityError, match=rf"^--tls-cert: {big_pem}: {MAX_PEM_FILE_BYTES + 1} bytes"):
        client_tls_from_files(str(pem), str(big_pem), str(pem))
    assert client_tls_from_files(str(pem)) is not None


def _config(tmp_path: Path, security: dict[str, Any]) -> Path:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["security"] = security
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("process", ["broker", "ar", "dit", "up", "token"])
def test_every_process_that_reads_the_files_exits_2_with_one_line(process: str, tmp_path: Path) -> None:
    """The real commands, before anything starts: one stderr line naming the key, exit 2."""
    pem = tmp_path / "ok.pem"
    pem.write_bytes(PEM)
    big = sparse(tmp_path / "big", MAX_SECRET_FILE_BYTES + 1)
    big_pem = sparse(tmp_path / "big.pem", MAX_PEM_FILE_BYTES + 1)
    tls = {"cert_file": str(pem), "key_file": str(pem), "ca_file": str(pem)}
    # What each process reads: the broker its operator token, an AR its own token file
    # ({name}), a DiT its TLS roots, `kvrelay up` the node's certificate, `kvrelay token` the secret.
    security, argv, line = {
        "broker": ({"operator_token_file": str(big)}, ["broker", "--port", "0", "--metrics-port", "0"],
                   f"security.operator_token_file: {big}: {MAX_SECRET_FILE_BYTES + 1} bytes: more than a file "
                   "holding the token may be (64 KiB)"),
        "ar": ({"replica_token_file": str(tmp_path / "{name}.token")}, ["ar", "--replica", "0"],
               f"security.replica_token_file: {tmp_path / 'ar-0.token'}: not a regular file (a pipe or a device): "
               "give a file holding the token"),
        "dit": ({"tls": {**tls, "ca_file": "/dev/null"}}, ["dit", "--replica", "0"],
                "security.tls.ca_file: /dev/null: not a regular file (a pipe or a device): give a PEM file"),
        "up": ({"tls": {**tls, "cert_file": str(big_pem)}}, ["up"],
               f"security.tls.cert_file: {big_pem}: {MAX_PEM_FILE_BYTES + 1} bytes: more than a PEM file may be "
               "(4 MiB)"),
        "token": ({"replica_tokens": "bound", "replica_secret_file": str(big)}, ["token", "ar-0"],
                  f"security.replica_secret_file: {big}: {MAX_SECRET_FILE_BYTES + 1} bytes: more than a file "
                  "holding the secret may be (64 KiB)"),
    }[process]  # fmt: skip
    os.mkfifo(tmp_path / "ar-0.token")  # before: the AR's open waited for a writer forever
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_LOG_FORMAT="console", KVRELAY_REPLICA_TOKEN="replica-token", KVRELAY_OPERATOR_TOKEN="operator")
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv, "--config", str(_config(tmp_path, security))],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [f"kvrelay {process}: {line}"], out.stderr
