"""End to end with real processes: the same bits over every transport, and the seed's debug
topology (AR TP=2 -> DiT TP=2, 20/20 sequential requests, pools full afterwards) on CPU."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client import GenerationState, KvRelayClient
from tests.e2e.node import fallback, running_node, threads_of_the_ranks, wait_pools_full

pytestmark = pytest.mark.slow

PROMPT, NEGATIVE, SEED = "a lighthouse on a cliff at sunset", "blurry", 4242


def _generate(address: str, **kw: Any) -> Any:
    with KvRelayClient(address, timeout=60) as client:
        handle = client.generate(PROMPT, negative_prompt=NEGATIVE, seed=SEED, width=64, height=96, timeout=120, **kw)
        states = [e.state for e in handle.events()]
        result = handle.result()
        wait_pools_full(client)
    return states, result


def test_same_seed_same_image_bits_over_mooncake_fallback_and_colocated(tmp_path: Path) -> None:
    from PIL import Image

    from kvrelay.models.image import decode_png
    from kvrelay.node.colocated import ColocatedPipeline

    def run(name: str, edit: Any) -> tuple[list[Any], Any]:
        with running_node(tmp_path, name, edit) as node:
            return _generate(node.address())

    # The two nodes run side by side (as in test_demo_prompts.py): one's start-up and stop overlap
    # the other's; neither's bits depend on the other.
    images = {}
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(run, name, edit) for name, edit in (("mooncake", None), ("grpc", fallback))}
    for name, done in runs.items():
        states, result = done.result()
        assert states[0] == GenerationState.QUEUED and states[-1] == GenerationState.SUCCEEDED
        assert GenerationState.TRANSFERRING in states and GenerationState.DENOISING in states
        assert Image.open(io.BytesIO(result.png)).size == (64, 96)
        images[name] = result.png
    assert images["mooncake"] == images["grpc"], "the transports delivered different prefixes"
    # Disaggregated == colocated: the KV relayed over the network is the KV computed in place.
    with threads_of_the_ranks(tmp_path / "mooncake.yaml"):
        colocated = ColocatedPipeline("tiny")
        local = colocated.dit.decode(
            colocated.dit.denoise(
                _colocated_rows(colocated), width=64, height=96, steps=2, guidance_scale=2.0, seed=SEED
            )
        )
    assert (decode_png(images["mooncake"]) == local.numpy()).all()


def _colocated_rows(pipe: Any) -> list[Any]:
    return pipe.hand_over(pipe.prefill([PROMPT, NEGATIVE]))


def test_debug_topology_tp2_to_tp2_twenty_sequential_requests(tmp_path: Path) -> None:
    def tp2(cfg: dict[str, Any]) -> None:
        for stage in cfg["stages"]:
            stage["tensor_parallel_size"] = 2

    with running_node(tmp_path, "tp2", tp2) as node, KvRelayClient(node.address(), timeout=60) as client:
        (replica_ar,) = [r for r in client.list_replicas() if r.role.name == "AR"]
        (replica_dit,) = [r for r in client.list_replicas() if r.role.name == "DIT"]
        assert replica_ar.tensor_parallel_size == 2 and replica_dit.tensor_parallel_size == 2
        done = 0
        for i in range(20):
            result = client.generate(
                f"request {i}: {PROMPT}", negative_prompt=NEGATIVE if i % 2 else "", seed=i, width=64, height=64,
                timeout=120,
            ).result()
            assert result.width == 64 and result.png
            done += 1
        assert done == 20
        pools = wait_pools_full(client)
        assert pools[0].draining_pages == 0 and pools[0].reserved_pages == 0
        assert not client.list_tickets(), "every ticket is released"


def test_dit_weights_from_a_safetensors_directory(tmp_path: Path) -> None:
    from kvrelay.models.dit import DitRunner
    from kvrelay.models.image import decode_png
    from kvrelay.node.colocated import ColocatedPipeline

    checkpoint = tmp_path / "dit-weights"
    DitRunner("tiny", weight_seed=7).save_checkpoint(checkpoint)

    def with_weights(cfg: dict[str, Any]) -> None:
        cfg["stages"][1]["model"] = {"preset": "tiny", "path": str(checkpoint)}

    with running_node(tmp_path, "dit-ckpt", with_weights) as node:
        _, result = _generate(node.address())
    with threads_of_the_ranks(tmp_path / "dit-ckpt.yaml"):
        pipe = ColocatedPipeline("tiny")  # the AR of the node: weight_seed 0
        local_dit = DitRunner("tiny", weight_seed=7)
        local = local_dit.decode(
            local_dit.denoise(_colocated_rows(pipe), width=64, height=96, steps=2, guidance_scale=2.0, seed=SEED)
        )
    assert (decode_png(result.png) == local.numpy()).all()
