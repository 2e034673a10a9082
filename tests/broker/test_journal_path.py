"""An unusable broker.journal_path is a configuration error naming the key, not a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvrelay.broker.main import serve
from kvrelay.config import ConfigError, KvRelayConfig, load_config


def _with_journal(repo_root: Path, journal_path: str) -> KvRelayConfig:
    cfg = load_config(repo_root / "tests" / "configs" / "test-fast.yaml")
    return cfg.model_copy(update={"broker": cfg.broker.model_copy(update={"journal_path": journal_path})})


@pytest.mark.parametrize("kind", ["directory", "not_a_database"])
def test_unusable_journal_path_is_a_config_error(repo_root: Path, tmp_path: Path, kind: str) -> None:
    if kind == "directory":
        path = tmp_path
    else:
        path = tmp_path / "notes.txt"
        path.write_text("these are not the pages you are looking for\n" * 100)
    cfg = _with_journal(repo_root, str(path))
    with pytest.raises(ConfigError, match=r"broker\.journal_path: cannot open the journal"):
        asyncio.run(serve(cfg, "127.0.0.1", 0, 0))


def test_a_journal_path_that_is_a_directory_or_under_a_file_says_which(repo_root: Path, tmp_path: Path) -> None:
    # Before: "unable to open database file" (SQLite) and "File exists" (mkdir), naming neither.
    folder = tmp_path / "journals"
    folder.mkdir()
    with pytest.raises(ConfigError) as caught:
        asyncio.run(serve(_with_journal(repo_root, str(folder)), "127.0.0.1", 0, 0))
    assert str(caught.value) == (
        f"broker.journal_path: cannot open the journal {str(folder)!r}: it is a directory; journal_path "
        f"names the journal's file (e.g. {str(folder / 'broker.sqlite')!r})"
    )
    assert not (tmp_path / "journals.lock").exists()  # its lock was made beside the directory
    afile = tmp_path / "afile"
    afile.write_text("")
    path = afile / "sub" / "broker.sqlite"
    with pytest.raises(ConfigError) as caught:
        asyncio.run(serve(_with_journal(repo_root, str(path)), "127.0.0.1", 0, 0))
    assert str(caught.value) == (
        f"broker.journal_path: cannot open the journal {str(path)!r}: {str(afile)!r} is a file, not a directory"
    )
