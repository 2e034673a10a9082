"""Fixtures of the foundation tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.foundation.wheel import BuiltWheel, build_wheel


@pytest.fixture(scope="session")
def built_wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> BuiltWheel:
    """The checkout's wheel, built once for the tests that read it (a build was most of each
    one's time)."""
    return build_wheel(repo_root, tmp_path_factory.mktemp("wheels"))
