"""The orchestrator with the real processes: `kvrelay broker`, `kvrelay ar` and `kvrelay dit`
(tiny models, Mooncake TCP on loopback) started by the supervisor, driven over GenerationService."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow

S = generation_pb2


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[str]:
    from kvrelay.node.supervisor import start_node

    tmp = tmp_path_factory.mktemp("node")
    cfg = yaml.safe_load((repo_root / "tests/configs/test-fast.yaml").read_text())
    cfg["broker"]["journal_path"] = str(tmp / "broker.sqlite")
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with start_node(path, log_dir=tmp) as started:
        yield started.address()


@pytest.fixture
def channel(node: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(node) as ch:
        yield ch


def wait_pool_full(channel: grpc.Channel, timeout: float = 15.0) -> None:
    broker = broker_pb2_grpc.BrokerServiceStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        (pool,) = broker.GetPool(broker_pb2.GetPoolRequest(), timeout=5).pools
        if pool.free_pages == pool.total_pages:
            return
        assert time.monotonic() < deadline, f"pages did not come back: {pool}"
        time.sleep(0.05)


def test_real_generation_png_and_same_seed_same_bits(channel: grpc.Channel) -> None:
    from PIL import Image

    api = generation_pb2_grpc.GenerationServiceStub(channel)
    req = S.GenerateRequest(prompt="a red fox", seed=1234, width=96, height=64)
    first = list(api.Generate(req, timeout=120))
    assert [e.state for e in first][:3] == [
        S.GENERATION_STATE_QUEUED,
        S.GENERATION_STATE_PREFILLING,
        S.GENERATION_STATE_TRANSFERRING,
    ]
    final = first[-1]
    assert final.state == S.GENERATION_STATE_SUCCEEDED, final.error
    assert [e.step for e in first if e.state == S.GENERATION_STATE_DENOISING] == [0, 1, 2]
    image = Image.open(io.BytesIO(final.image.png))
    assert image.size == (96, 64)
    assert final.timings.total_seconds > 0 and final.timings.load_seconds > 0
    again = list(
        api.Generate(S.GenerateRequest(prompt="a red fox", seed=1234, width=96, height=64), timeout=120)
    )
    assert again[-1].image.png == final.image.png
    wait_pool_full(channel)


def _denoising(
    api: generation_pb2_grpc.GenerationServiceStub, request_id: str
) -> tuple[object, list[object]]:
    """A long generation read until its first denoising step."""
    call = api.Generate(
        S.GenerateRequest(
            prompt="long", request_id=request_id, seed=1, width=64, height=64, num_inference_steps=1000
        ),
        timeout=120,
    )
    seen = []
    for event in call:
        seen.append(event)
        assert event.state not in (S.GENERATION_STATE_FAILED, S.GENERATION_STATE_CANCELLED), event.error
        if event.state == S.GENERATION_STATE_DENOISING and event.step >= 1:
            return call, seen
    raise AssertionError(f"stream ended before denoising: {seen}")


def test_real_cancel_while_denoising_frees_the_pages(channel: grpc.Channel) -> None:
    api = generation_pb2_grpc.GenerationServiceStub(channel)
    call, _ = _denoising(api, "real-cancel")
    started = time.monotonic()
    reply = api.CancelGeneration(S.CancelGenerationRequest(request_id="real-cancel"), timeout=5)
    assert reply.generation.state == S.GENERATION_STATE_CANCELLED
    rest = list(call)  # type: ignore[call-overload]
    assert rest[-1].state == S.GENERATION_STATE_CANCELLED
    assert time.monotonic() - started < 5.0
    wait_pool_full(channel)


def test_real_dropped_stream_cancels(channel: grpc.Channel) -> None:
    api = generation_pb2_grpc.GenerationServiceStub(channel)
    call, _ = _denoising(api, "real-drop")
    call.cancel()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        got = api.GetGeneration(S.GetGenerationRequest(request_id="real-drop"), timeout=5).generation
        if got.state == S.GENERATION_STATE_CANCELLED:
            assert got.error.reason == "CLIENT_DISCONNECTED"
            break
        assert time.monotonic() < deadline, f"still {got.state}"
        time.sleep(0.05)
    wait_pool_full(channel)


def test_real_concurrent_generations_share_the_pool(channel: grpc.Channel) -> None:
    api = generation_pb2_grpc.GenerationServiceStub(channel)
    results: list[int] = []

    def one(i: int) -> None:
        events = list(
            api.Generate(S.GenerateRequest(prompt=f"p{i}", seed=i, width=64, height=64), timeout=120)
        )
        results.append(events[-1].state)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [S.GENERATION_STATE_SUCCEEDED] * 6
    wait_pool_full(channel)
