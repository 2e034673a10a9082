"""Every tokenizer file kvrelay hands `tokenizers` or `transformers` (a tokenizer.json, a
checkpoint's tokenizer_config.json, vocabularies) passes kvrelay's bound first, as every other
file a setting names (kvrelay.limits): a pipe or a device is refused without being opened, a file
larger than MAX_TOKENIZER_FILE_BYTES without being read; at config load, one line, exit 2.

As in tests/security/test_file_bounds.py, nothing here reads /dev/zero: an oversized sparse file
and a FIFO show the refusals, and a reader without the bound fails them with another error (the
sparse file's NULs are no JSON) or blocks (the FIFO: a thread, given up on and unblocked).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvrelay.config import ConfigError, ModelConfig, load_config
from kvrelay.limits import MAX_TOKENIZER_FILE_BYTES, FileRefused
from kvrelay.models.formats import check_tokenizer_files

pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
NOT_REGULAR = "not a regular file (a pipe or a device)"
TOO_BIG = f"{MAX_TOKENIZER_FILE_BYTES + 1} bytes: more than a tokenizer"


def sparse(path: Path, size: int = MAX_TOKENIZER_FILE_BYTES + 1) -> Path:
    """A file of `size` bytes that takes no disk (and no memory, unless read)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def refusal(call: Callable[[], object], fifo: Path | None = None) -> BaseException:
    """What `call` raised, on a thread: a reader blocked on `fifo` (an open that waits for a
    writer) fails the test instead of hanging it."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            raised.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer arrives: the open returns
        thread.join(timeout=60)
        pytest.fail(f"the tokenizer's open of the FIFO {fifo} waited for a writer")
    assert raised, "accepted"
    return raised[0]


@pytest.mark.parametrize("kind", ["HfTokenizer", "BagelTokenizer"])
@pytest.mark.parametrize("given", ["directory", "file"])
def test_a_tokenizer_json_that_is_a_pipe_is_refused_unopened(kind: str, given: str, tmp_path: Path) -> None:
    from kvrelay.models import tokenizer

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    err = refusal(lambda: getattr(tokenizer, kind)(tmp_path if given == "directory" else fifo), fifo)
    # Before: from_file blocked in the open; with a directory, "no tokenizer.json at ...".
    assert isinstance(err, FileRefused), repr(err)
    assert str(err) == f"{fifo}: {NOT_REGULAR}: give a tokenizer.json"


@pytest.mark.parametrize("kind", ["HfTokenizer", "BagelTokenizer"])
def test_a_tokenizer_json_larger_than_the_bound_is_refused_unread(kind: str, tmp_path: Path) -> None:
    from kvrelay.models import tokenizer

    big = sparse(tmp_path / "tokenizer.json")
    err = refusal(lambda: getattr(tokenizer, kind)(tmp_path))
    assert isinstance(err, FileRefused), repr(err)
    assert str(err) == f"{big}: {TOO_BIG}.json may be (256 MiB)"


def test_a_checkpoints_tokenizer_json_that_is_a_pipe_is_not_taken_for_none(tmp_path: Path) -> None:
    # A model.path whose tokenizer.json is a FIFO silently got the byte tokenizer (is_file() False).
    from kvrelay.models.tokenizer import load_tokenizer

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    err = refusal(lambda: load_tokenizer(None, model=ModelConfig(path=str(tmp_path))), fifo)
    assert isinstance(err, FileRefused) and NOT_REGULAR in str(err), repr(err)


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model", "config.json"]
)
def test_every_file_transformers_reads_is_checked(name: str, tmp_path: Path) -> None:
    (tmp_path / "vocab.txt").write_text("[UNK]\nfox\n")  # a regular file among them passes
    os.mkfifo(tmp_path / name)
    with pytest.raises(FileRefused) as err:
        check_tokenizer_files(tmp_path)
    assert str(err.value) == f"{tmp_path / name}: {NOT_REGULAR}: give a tokenizer file"
    os.unlink(tmp_path / name)
    sparse(tmp_path / name)
    with pytest.raises(FileRefused, match=f"^{re.escape(str(tmp_path / name))}: {TOO_BIG} file may be"):
        check_tokenizer_files(tmp_path)
    os.unlink(tmp_path / name)
    check_tokenizer_files(tmp_path)  # what is missing is the library's to report
    with pytest.raises(FileRefused, match="not a regular file"):
        check_tokenizer_files("/dev/null")


def test_the_vllm_ars_tokenizer_checks_before_transformers_reads(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from kvrelay.ar_service.vllm_engine import VllmTokenizer

    big = sparse(tmp_path / "tokenizer_config.json")
    # Before: transformers read the 256 MiB of NULs whole, then failed to parse them.
    err = refusal(lambda: VllmTokenizer(str(tmp_path)))
    assert isinstance(err, FileRefused), repr(err)
    assert str(err).startswith(f"{big}: {TOO_BIG} file may be"), err


def _config(tmp_path: Path, ar_model: dict[str, str]) -> Path:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["stages"][0]["model"] = ar_model
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("key", ["tokenizer", "path"])
def test_a_config_naming_such_a_tokenizer_is_refused_at_load(key: str, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    os.mkfifo(tok / "tokenizer.json")
    model = {"preset": "tiny", "tokenizer": str(tok)} if key == "tokenizer" else {"path": str(tok)}
    cfg = _config(tmp_path, model)
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg))
    assert str(err.value) == (
        f"invalid config {cfg}: stages[0].model.{key}: {tok / 'tokenizer.json'}: {NOT_REGULAR}: give a tokenizer file"
    )


@pytest.mark.parametrize("process", ["ar", "up"])
def test_the_processes_that_read_it_exit_2_with_one_line(process: str, tmp_path: Path) -> None:
    """The real commands: before (`kvrelay ar`), the model loaded and then the tokenizer failed,
    exit 1; `kvrelay up` started a node whose AR did so."""
    big = sparse(tmp_path / "tokenizer.json")
    cfg = _config(tmp_path, {"preset": "tiny", "tokenizer": str(big)})
    argv = ["ar", "--replica", "0"] if process == "ar" else ["up", "--metrics-port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_LOG_FORMAT="console", KVRELAY_NATIVE_CAPTURE="0")
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv, "--config", str(cfg)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [
        f"kvrelay {process}: invalid config {cfg}: stages[0].model.tokenizer: {big}: {TOO_BIG} file may be (256 MiB)"
    ], out.stderr
