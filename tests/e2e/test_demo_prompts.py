"""End to end with real processes: the default demo model draws what each prompt asks for, over
every transport (Mooncake TCP and the gRPC fallback on CPU; CUDA IPC on a GPU host), and every
transport delivers the same picture. Judged with image statistics, which a corrupted KV prefix
fails even when two transports agree bit for bit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client import GenerationState, KvRelayClient
from tests.bagel.demo_judge import judge
from tests.e2e.node import fallback, running_node, wait_pools_full

pytestmark = pytest.mark.slow

PROMPTS = [
    ("red", "circle", "blue", "top left"),
    ("yellow", "square", "black", "bottom right"),
    ("white", "triangle", "green", "center"),
    ("orange", "circle", "purple", "top right"),
]


def _demo(cfg: dict[str, Any]) -> None:
    for stage in cfg["stages"]:
        stage["model"] = {"format": "demo"}


def _demo_fallback(cfg: dict[str, Any]) -> None:
    _demo(cfg)
    fallback(cfg)


def _demo_cuda_ipc(cfg: dict[str, Any]) -> None:
    _demo(cfg)
    for stage, dev in zip(cfg["stages"], ("cuda:0", "cuda:0"), strict=True):
        stage["devices"] = dev
        stage["kv_transfer_config"]["kv_connector"] = "CudaIpcConnector"
        stage["kv_transfer_config"]["kv_connector_extra_config"].pop("mooncake_protocol", None)


def _run(tmp_path: Path, name: str, edit: Any) -> list[bytes]:
    from kvrelay.models.image import decode_png

    pngs = []
    with running_node(tmp_path, name, edit) as node, KvRelayClient(node.address(), timeout=60) as client:
        for i, (colour, shape, bg, place) in enumerate(PROMPTS):
            text = f"a {colour} {shape} on a {bg} background, {place}"
            handle = client.generate(text, seed=100 + i, width=512, height=512, num_inference_steps=8, guidance_scale=3.0,
                                     timeout=180)
            states = [e.state for e in handle.events()]
            result = handle.result()
            assert states[-1] == GenerationState.SUCCEEDED, states
            verdict = judge(decode_png(result.png), colour, bg, place)
            assert verdict.ok, (name, text, verdict)
            pngs.append(result.png)
        wait_pools_full(client)
    return pngs


def test_demo_prompts_over_mooncake_and_the_fallback(tmp_path: Path) -> None:
    # The two nodes run side by side (each node's children are forked by its own monitor thread):
    # one's start-up and stop, mostly waiting, overlap the other's, where in turn they were most
    # of the test. Each node's bits do not depend on the other (threads per rank: its own config).
    with ThreadPoolExecutor(2) as pool:
        mooncake = pool.submit(_run, tmp_path, "demo-mooncake", _demo)
        grpc = pool.submit(_run, tmp_path, "demo-grpc", _demo_fallback)
        assert mooncake.result() == grpc.result()


@pytest.mark.gpu
def test_demo_prompts_over_cuda_ipc(tmp_path: Path) -> None:
    _run(tmp_path, "demo-cuda-ipc", _demo_cuda_ipc)
