"""The SDK and `kvrelay status` against the real `kvrelay broker` process (started by the supervisor).

No AR or DiT replica runs here: these are the broker's own answers (validation, unknown ids, the
empty registry, the bearer token), decoded by the client exactly as users will see them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError, RetryPolicy
from kvrelay.client.cli import run_status
from kvrelay.supervisor import Node, start_node

REPO = Path(__file__).resolve().parents[2]
TOKEN = "client-test-token"
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("real-broker")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp / "journal.sqlite")
    data["broker"]["api_token"] = TOKEN
    path = tmp / "broker.yaml"
    path.write_text(yaml.safe_dump(data))
    with start_node(path, roles=("broker",), log_dir=tmp / "logs", ready_timeout=120) as node:
        yield node


def test_the_real_broker_answers_reads_and_errors_through_the_sdk(broker: Node) -> None:
    with KvRelayClient(broker.address(), token=TOKEN, retry=FAST_RETRY) as client:
        assert (client.list_replicas(), client.get_pools(), client.list_tickets()) == ([], [], [])
        assert client.list_generations() == []
        with pytest.raises(KvRelayError) as info:
            client.get_generation("no-such-request")
        assert (info.value.code, info.value.reason) == ("NOT_FOUND", "GENERATION_NOT_FOUND")
        with pytest.raises(KvRelayError) as info:
            client.generate("a fox", width=100).result()
        assert (info.value.code, info.value.details.get("field")) == ("INVALID_ARGUMENT", "width")
        assert not isinstance(info.value, grpc.RpcError)
        with pytest.raises(KvRelayError) as info:
            client.generate("   ").result()
        assert info.value.details.get("field") == "prompt"
        # No AR replica is registered: the broker cannot take the request; the SDK says so.
        with pytest.raises(KvRelayError) as info:
            client.generate("a fox", width=64, height=64, timeout=20).result()
        assert info.value.code == "UNAVAILABLE"
        assert [g for g in client.list_generations() if g.state == GenerationState.SUCCEEDED] == []


def test_a_request_id_waits_for_a_replica_within_the_reattach_window(broker: Node) -> None:
    # The broker answers UNAVAILABLE with its own reason (no AR replica is up): with a request_id
    # the handle keeps re-attaching for the window, as it would while a replica restarts.
    window = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, reattach_seconds=1.5)
    with KvRelayClient(broker.address(), token=TOKEN, retry=window) as client:
        started = time.monotonic()
        with pytest.raises(KvRelayError) as info:
            client.generate("a fox", width=64, height=64, request_id="waits-for-ar").result()
        elapsed = time.monotonic() - started
    assert info.value.code == "UNAVAILABLE" and info.value.reason != "UNAVAILABLE"
    assert 1.5 <= elapsed < 6


def test_the_real_broker_requires_the_api_token_on_the_public_api(broker: Node) -> None:
    with KvRelayClient(broker.address(), retry=FAST_RETRY) as anonymous:
        with pytest.raises(KvRelayError) as info:
            anonymous.list_generations()
        assert info.value.code == "UNAUTHENTICATED"
    with KvRelayClient(broker.address(), token="wrong", retry=FAST_RETRY) as wrong:
        with pytest.raises(KvRelayError) as info:
            wrong.generate("a fox", width=64, height=64).result()
        assert info.value.code == "UNAUTHENTICATED"


def test_kvrelay_status_against_the_real_broker(broker: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_status(argparse.Namespace(target=broker.address(), json=False, token=TOKEN)) == 0
    out = capsys.readouterr().out
    assert f"broker {broker.address()}" in out
    assert "none registered" in out and "POOLS: none" in out and "none in flight" in out
