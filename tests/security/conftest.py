"""Fixtures of the security tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """No token from the environment running the tests: the processes a test starts take only
    the credentials its config names."""
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_REPLICA_SECRET"):
        monkeypatch.delenv(env, raising=False)
