"""The SDK (kvrelay.client) against the real orchestrator and GenerationService: the two sides of
the public contract agree on states, results, errors and cancellation."""

from __future__ import annotations

import pytest

from kvrelay.client import AsyncKvRelayClient, KvRelayError
from kvrelay.client.types import GenerationState

from .harness import cluster, png_size, run, wait_until


def test_sdk_generate_result_errors_and_cancel() -> None:
    async def body() -> None:
        async with cluster() as c, AsyncKvRelayClient(c.target) as client:
            handle = await client.generate("a red fox", seed=5, width=80, height=64, num_inference_steps=3)
            states = [(e.state, e.step) async for e in handle.events()]
            assert states[-1] == (GenerationState.SUCCEEDED, 3)
            assert [s for s, _ in states[:4]] == [
                GenerationState.QUEUED,
                GenerationState.PREFILLING,
                GenerationState.TRANSFERRING,
                GenerationState.DENOISING,
            ]
            result = await handle.result()
            assert (result.width, result.height, result.seed) == (80, 64, 5)
            assert png_size(result.png) == (80, 64)
            assert result.timings.total_seconds > 0

            with pytest.raises(KvRelayError) as exc:
                await (await client.generate("a red fox", width=70)).result()
            assert (exc.value.code, exc.value.details.get("field")) == ("INVALID_ARGUMENT", "width")

            c.dit.step_gate.clear()
            running = await client.generate("a red fox", seed=6, request_id="sdk-cancel")
            await wait_until(
                lambda: (
                    (g := c.orchestrator.store.find("sdk-cancel")) is not None and g.state.name == "DENOISING"
                ),
                what="denoising",
            )
            await running.cancel()
            await wait_until(lambda: c.orchestrator.get("sdk-cancel").state.terminal, what="cancelled")
            assert c.orchestrator.get("sdk-cancel").state.name == "CANCELLED"
            await c.wait_pool_free()
            fetched = await client.get_generation("sdk-cancel")
            assert fetched.state is GenerationState.CANCELLED

    run(body())
