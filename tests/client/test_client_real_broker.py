"""The SDK and `kvrelay status` against the real `kvrelay broker` process (started by the supervisor).

First the broker's own answers with no replica registered (validation, unknown ids, the empty
registry, the bearer token), decoded by the client exactly as users will see them; then re-attach
against the real broker, with protocol-honest replicas and a connection cut mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
import yaml

from kvrelay.client import GenerationState, KvRelayClient, KvRelayError, RetryPolicy
from kvrelay.client.cli import run_status
from kvrelay.node.supervisor import Node, start_node
from tests.orchestrator.harness import ArReplica, DitMemory, DitReplica
from tests.tcp_proxy import TcpProxy

REPO = Path(__file__).resolve().parents[2]
TOKEN = "client-test-token"
OPERATOR_TOKEN = "client-test-operator-token"
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)
_T = TypeVar("_T")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("real-broker")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp / "journal.sqlite")
    secrets = {"api": TOKEN, "replica": "client-test-replica-token", "operator": OPERATOR_TOKEN}
    data["security"] = {}
    for name, secret in secrets.items():
        (tmp / f"{name}.token").write_text(secret)
        data["security"][f"{name}_token_file"] = str(tmp / f"{name}.token")
    path = tmp / "broker.yaml"
    path.write_text(yaml.safe_dump(data))
    with start_node(path, roles=("broker",), log_dir=tmp / "logs", ready_timeout=120) as node:
        yield node


def test_the_real_broker_answers_reads_and_errors_through_the_sdk(broker: Node) -> None:
    with KvRelayClient(broker.address(), token=OPERATOR_TOKEN, retry=FAST_RETRY) as operator:
        assert (operator.list_replicas(), operator.get_pools(), operator.list_tickets()) == ([], [], [])
    with KvRelayClient(broker.address(), token=TOKEN, retry=FAST_RETRY) as client:
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
    assert run_status(argparse.Namespace(target=broker.address(), json=False, token=OPERATOR_TOKEN)) == 0
    out = capsys.readouterr().out
    assert f"broker {broker.address()}" in out
    assert "none registered" in out and "POOLS: none" in out and "none in flight" in out


# ----------------------------------------------------------------------------- re-attach
# The detach rule against the real broker process: protocol-honest AR and DiT replicas
# (tests/orchestrator/harness.py, real gRPC, no model) register with it from a background loop,
# and a TCP proxy between the SDK and the broker cuts the connection mid-stream.


class Replicas:
    """The harness's AR and DiT replicas, and a TCP proxy to the broker, on a background loop."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="replicas", daemon=True)
        self.ar: ArReplica | None = None
        self.dit: DitReplica | None = None
        self.proxy: TcpProxy | None = None

    def call(self, fn: Callable[[], Awaitable[_T]], timeout: float = 30) -> _T:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self) -> Replicas:
        self._thread.start()

        async def start() -> None:
            memory = DitMemory(32)
            self.ar = ArReplica(self.target, memory)
            self.dit = DitReplica(self.target, memory)
            await self.ar.start()
            await self.dit.start()
            host, port = self.target.rsplit(":", 1)
            self.proxy = await TcpProxy(host, int(port)).start()

        self.call(start)
        return self

    def hold_steps(self, hold: bool) -> None:
        assert self.dit is not None
        gate = self.dit.step_gate
        self.loop.call_soon_threadsafe(gate.clear if hold else gate.set)

    def cut_then_release_after_reconnect(self) -> None:
        """Cut every connection through the proxy; let the steps go once a client reconnected."""
        assert self.proxy is not None and self.dit is not None
        proxy, gate = self.proxy, self.dit.step_gate

        async def cut() -> None:
            connections = proxy.connections
            assert proxy.cut() > 0

            async def release() -> None:
                while proxy.connections <= connections:
                    await asyncio.sleep(0.01)
                gate.set()

            self.loop.create_task(release())

        self.call(cut)

    def stop(self) -> None:
        async def stop() -> None:
            for part in (self.proxy, self.ar, self.dit):
                if part is not None:
                    await part.stop()

        self.call(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Replicas]]:
    tmp = tmp_path_factory.mktemp("live-broker")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp / "journal.sqlite")
    data["broker"]["lease_seconds"] = 120  # the harness replicas register once, no heartbeats
    path = tmp / "broker.yaml"
    path.write_text(yaml.safe_dump(data))
    with start_node(path, roles=("broker",), log_dir=tmp / "logs", ready_timeout=120) as node:
        replicas = Replicas(node.address()).start()
        try:
            yield node, replicas
        finally:
            replicas.stop()


REATTACH = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, reattach_seconds=10)


@pytest.mark.slow
def test_the_sdk_reattaches_through_a_cut_connection_to_the_real_broker(live: tuple[Node, Replicas]) -> None:
    node, replicas = live
    assert replicas.proxy is not None and replicas.ar is not None
    replicas.hold_steps(True)
    with KvRelayClient(replicas.proxy.address, retry=REATTACH) as client:
        handle = client.generate("a fox", seed=1, width=64, height=64, request_id="real-cut")
        states = []
        for event in handle.events():
            states.append(event.state)
            if event.state is GenerationState.DENOISING and states.count(GenerationState.DENOISING) == 1:
                replicas.cut_then_release_after_reconnect()  # the network fails mid-stream
        result = handle.result()
        assert result.request_id == "real-cut" and states[-1] is GenerationState.SUCCEEDED
        # The steps were held until the SDK reconnected: the stream was cut mid-generation, and the
        # re-attached stream saw it through (detach 0 would have cancelled it at the cut).
        assert replicas.proxy.connections >= 2
        assert replicas.ar.prefills.count("real-cut") == 1  # re-attached, never resubmitted
        assert client.get_generation("real-cut").state is GenerationState.SUCCEEDED


@pytest.mark.slow
def test_the_real_broker_cancels_a_detached_generation_when_nobody_reattaches(
    live: tuple[Node, Replicas],
) -> None:
    node, replicas = live
    replicas.hold_steps(True)
    patient = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, reattach_seconds=1.5)
    with KvRelayClient(node.address(), retry=patient) as observer:
        # With a request_id the stream asks the broker to wait reattach_seconds for a re-attach.
        away = KvRelayClient(node.address(), retry=patient)
        handle = away.generate("a hare", seed=2, width=64, height=64, request_id="real-detach")
        for event in handle.events():
            if event.state is GenerationState.DENOISING:
                break
        away.close()  # the client process goes away without cancelling
        dropped = time.monotonic()
        time.sleep(0.5)
        assert observer.get_generation("real-detach").state is GenerationState.DENOISING
        while not (gen := observer.get_generation("real-detach")).state.is_terminal:
            assert time.monotonic() - dropped < 10, gen
            time.sleep(0.05)
        assert time.monotonic() - dropped >= 1.5
        assert gen.state is GenerationState.CANCELLED and gen.error is not None
        assert gen.error.reason == "CLIENT_DISCONNECTED"

        # Without a request_id nothing can re-attach: the broker cancels at once (detach 0).
        away = KvRelayClient(node.address(), retry=patient)
        handle = away.generate("a hare", seed=3, width=64, height=64)
        for event in handle.events():
            if event.state is GenerationState.DENOISING:
                break
        request_id = handle.request_id
        assert request_id
        away.close()
        dropped = time.monotonic()
        while not (gen := observer.get_generation(request_id)).state.is_terminal:
            assert time.monotonic() - dropped < 10, gen
            time.sleep(0.02)
        assert gen.state is GenerationState.CANCELLED and gen.error is not None
        assert gen.error.reason == "CLIENT_DISCONNECTED"
    replicas.hold_steps(False)
