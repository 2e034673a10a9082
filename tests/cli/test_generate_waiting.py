"""`kvrelay generate` says what it waits out. README's first steps are `kvrelay up`, then
`kvrelay generate` (another terminal): sent before the node's replicas registered, the broker
refused it `UNAVAILABLE NO_AR_REPLICA`, the SDK asked again (the CLI always sends a request_id,
so it re-attaches) and the command printed nothing for 8-20 s until QUEUED, found running the
README on a fresh clone. Now each retryable refusal it waits out is one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.client.harness import Harness, ServerThread

REPO = Path(__file__).resolve().parents[2]


def test_generate_prints_why_it_waits_before_the_first_event(tmp_path: Path) -> None:
    harness = Harness()
    harness.unavailable["Generate"] = 2  # two refusals UNAVAILABLE REPLICA_DOWN, then served
    server = ServerThread(harness).start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvrelay", "generate", "a fox", "--width", "64", "--height", "64",
             "--target", server.address, "-o", str(tmp_path / "fox.png")],
            capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert harness.calls["Generate"] == 3
    lines = proc.stderr.splitlines()
    waits = [line for line in lines if "waiting:" in line]
    # Once per reason (not once per attempt), before the first event.
    assert len(waits) == 1, proc.stderr
    assert waits[0].endswith(
        "waiting: UNAVAILABLE REPLICA_DOWN: injected: try again (asking again; Ctrl-C cancels)"
    )
    assert lines.index(waits[0]) < next(i for i, line in enumerate(lines) if line.endswith("QUEUED"))
    assert (tmp_path / "fox.png").read_bytes().startswith(b"\x89PNG")
